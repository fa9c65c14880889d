"""examples/compose/ (Valkey, a worker, a producer, the exporter, Prometheus, Grafana) is valid and
follows docs/operations.md, without a Docker engine: `docker-compose config` (Debian's
docker-compose 1.29 parses and validates a file without one) and `promtool`.

What is checked: the six services, the shared redislua:// broker URL, the worker's and
the producer's commands, an exporter command with the flags and the port the page
documents (read off docs/operations.md, so a change there the compose file does not follow
fails here) and every one of them in `celery-redis-lua exporter --help`, the image built
from the repository, Prometheus scraping the exporter's service and port, and the
celery-mixin alert CeleryHighQueueLength (its expression, and that it fires).

PyYAML is not a dependency of ours: without it in this venv, YAML is read by the Python
docker-compose 1.29 runs on, which always has it.
"""

from __future__ import annotations

import ast
import json
import os
import py_compile
import re
import shlex
import subprocess
import sys
from fnmatch import fnmatch
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from conftest import require_tool

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "compose"
COMPOSE_FILE = EXAMPLE / "docker-compose.yml"
PAGE = ROOT / "docs" / "operations.md"  # its sections "Monitoring (Prometheus)" and the compose one
SERVICES = {"valkey", "worker", "producer", "exporter", "prometheus", "grafana"}
BUILT = ("worker", "producer", "exporter")  # the services that run the project's image
# celery-mixin's CeleryHighQueueLength (celery-exporter's mixin), with the job selector left out.
HIGH_QUEUE_LENGTH = 'sum by (queue_name) (celery_queue_length{queue_name!~"None"}) > 100'
EXPORTER = re.compile(r"`celery-redis-lua exporter ([^`]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")


def tool(name: str, package: str) -> str:
    return require_tool(name, package, "validate examples/compose/")


@pytest.fixture(scope="module")
def docker_compose() -> str:
    return tool("docker-compose", "docker-compose")


@pytest.fixture(scope="module")
def promtool() -> str:
    return tool("promtool", "prometheus")


def compose_env() -> dict[str, str]:
    """No COMPOSE_* settings and no broker URL of the shell running the test: the result
    must not depend on them (the file interpolates nothing from the host)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("COMPOSE_", "DOCKER_")) and k != "CELERY_BROKER_URL"}


@cache
def yaml_loader(docker_compose: str) -> list[str] | None:
    """None: PyYAML is importable here; else the command line of the docker-compose
    script's own Python (read off its #! line), which has PyYAML."""
    try:
        import yaml  # noqa: F401
    except ImportError:
        pass
    else:
        return None
    with open(docker_compose, "rb") as script:
        first = script.readline().decode(errors="replace").strip()
    if first.startswith("#!") and "python" in first:
        return [*shlex.split(first[2:]), "-c",
                "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"]
    if os.environ.get("CI"):
        pytest.fail(f"no YAML parser: PyYAML is not in this venv and {docker_compose} is not a Python script")
    pytest.skip(f"no YAML parser: PyYAML is not in this venv and {docker_compose} is not a Python script")


def load_yaml(text: str, docker_compose: str) -> Any:
    loader = yaml_loader(docker_compose)
    if loader is None:
        import yaml
        return yaml.safe_load(text)
    done = subprocess.run(loader, input=text, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def run_compose(docker_compose: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([docker_compose, "-f", str(COMPOSE_FILE), *args], cwd=ROOT, env=compose_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"docker-compose {' '.join(args)} failed:\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def config(docker_compose: str) -> dict[str, Any]:
    """The file as docker-compose resolved it (anchors merged, paths absolute)."""
    done = run_compose(docker_compose, "config")
    # A variable taken from the shell running compose is blank there: an error in an example.
    assert "variable is not set" not in done.stderr, done.stderr
    return load_yaml(done.stdout, docker_compose)


def services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return config["services"]


def argv(command: str | list[str]) -> list[str]:
    """A service's command as the container runs it ($$ reaches it as $); a `sh -c` script split."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    words = [word.replace("$$", "$") for word in words]
    if words[:2] == ["sh", "-c"] and len(words) == 3:
        words = shlex.split(words[2])
    if words and words[0] == "exec":
        words = words[1:]
    return words


def options(words: list[str]) -> dict[str, str]:
    """--flag value pairs (every exporter flag used here takes a value)."""
    found: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            assert i + 1 < len(words), f"{word} without a value in {words}"
            found[word] = words[i + 1]
    return found


def page_section(title: str) -> str:
    text = PAGE.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/operations.md has no section '## {title}'"
    return match.group(1)


def page_exporter_command(title: str) -> list[str]:
    """The first `celery-redis-lua exporter ...` command of a section of the page, split."""
    match = EXPORTER.search(page_section(title))
    assert match, f"docs/operations.md's section '{title}' shows no `celery-redis-lua exporter ...` command"
    return shlex.split(match.group(1))


def exporter_args(config: dict[str, Any]) -> list[str]:
    words = argv(services(config)["exporter"]["command"])
    assert words[:2] == ["celery-redis-lua", "exporter"], words
    return words[2:]


def broker_url(service: dict[str, Any]) -> str:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    assert "CELERY_BROKER_URL" in environment, service
    return environment["CELERY_BROKER_URL"]


def test_compose_file_validates_and_lists_the_services(docker_compose: str, config: dict[str, Any]) -> None:
    listed = run_compose(docker_compose, "config", "--services").stdout.split()
    assert set(listed) == SERVICES
    assert set(services(config)) == SERVICES


def test_valkey_with_appendonly(config: dict[str, Any]) -> None:
    valkey = services(config)["valkey"]
    assert re.fullmatch(r"valkey/valkey:(8|9)(\.\d+)*", valkey["image"]), valkey["image"]
    words = argv(valkey["command"])
    assert words[0] == "valkey-server"
    assert options(words).get("--appendonly") == "yes", words
    assert "healthcheck" in valkey


def test_one_redislua_broker_url_for_every_service_on_the_broker(config: dict[str, Any]) -> None:
    urls = {name: broker_url(services(config)[name]) for name in BUILT}
    assert len(set(urls.values())) == 1, urls
    url = urlsplit(urls["worker"])
    assert url.scheme == "redislua", urls
    assert (url.hostname, url.port) == ("valkey", 6379), urls  # the valkey service
    for name in BUILT:
        assert "valkey" in services(config)[name]["depends_on"], name
    assert "exporter" in services(config)["prometheus"]["depends_on"]
    assert "prometheus" in services(config)["grafana"]["depends_on"]


def test_grafana_is_provisioned_with_the_prometheus_and_the_dashboard(config: dict[str, Any]) -> None:
    """The datasource the dashboard's panels name (uid 'prometheus') points at the prometheus
    service, and the dashboards directory the provider reads is the one mounted."""
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in services(config)["grafana"]["volumes"]}
    provisioning = EXAMPLE / mounts["/etc/grafana/provisioning"].removeprefix("./")
    datasource = (provisioning / "datasources" / "prometheus.yml").read_text()
    assert "uid: prometheus" in datasource and "url: http://prometheus:9090" in datasource
    provider = (provisioning / "dashboards" / "celery-redis-lua.yml").read_text()
    assert "path: /var/lib/grafana/dashboards" in provider
    dashboards = EXAMPLE / mounts["/var/lib/grafana/dashboards"].removeprefix("./")
    dashboard = json.loads((dashboards / "celery-redis-lua.json").read_text())
    assert {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} == {"prometheus"}


def test_the_image_installs_the_project_from_the_build_context(config: dict[str, Any]) -> None:
    images = set()
    for name in BUILT:
        build = services(config)[name]["build"]
        context = Path(build["context"])
        assert context.resolve() == ROOT, build  # ../.. from examples/compose/
        # docker-compose checks that the context exists, not the Dockerfile.
        assert (context / build["dockerfile"]).resolve() == EXAMPLE / "Dockerfile", build
        images.add(services(config)[name].get("image"))
    assert len(images) == 1, images  # one image for the three

    dockerfile = (EXAMPLE / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim\b", dockerfile, re.M), dockerfile
    copied = re.search(r"^COPY \. (\S+)$", dockerfile, re.M)
    assert copied, "the Dockerfile copies the build context (the checkout)"
    assert re.search(rf"^RUN pip install [^\n]*(?<!\S){re.escape(copied.group(1))}/?$", dockerfile, re.M), \
        "the Dockerfile pip-installs the copied checkout"
    assert re.search(r"^COPY examples/compose/tasks\.py examples/compose/producer\.py \S+", dockerfile, re.M)
    assert re.search(r"^WORKDIR ", dockerfile, re.M)

    # What building and installing the wheel needs stays in the context.
    ignored = [line.strip() for line in (EXAMPLE / "Dockerfile.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for needed in ("pyproject.toml", "README.md", "python", "lua", "examples/compose/tasks.py",
                   "python/celery_redis_lua/tools/cli/__init__.py", "lua/publish.lua"):
        assert not any(fnmatch(needed, pattern) or needed.startswith(pattern.rstrip("/") + "/")
                       for pattern in ignored), needed
    assert {".venv", ".git"} <= set(ignored)


def test_worker_and_producer_commands(config: dict[str, Any]) -> None:
    worker = ["celery", "-A", "tasks", "worker", "--loglevel", "INFO"]
    assert argv(services(config)["worker"]["command"]) == worker
    assert argv(services(config)["producer"]["command"]) == ["python", "producer.py"]


def test_exporter_command_follows_the_docs(config: dict[str, Any]) -> None:
    used = options(exporter_args(config))
    monitoring = options(page_exporter_command("Monitoring (Prometheus)"))
    # The page's own compose section shows the command exactly.
    assert exporter_args(config) == page_exporter_command("Running it with docker-compose")

    assert used["--port"] == monitoring["--port"] == "9808", (used, monitoring)
    assert "--url" in monitoring
    assert used["--url"] in ("$CELERY_BROKER_URL", "${CELERY_BROKER_URL}"), used  # the container's variable
    # Flags the page's command has and the example leaves out: only --prefix, as long as
    # the example sets no global_keyprefix (the exporter must name the workers' prefix).
    assert set(monitoring) - set(used) <= {"--prefix"}, (monitoring, used)
    if "--prefix" in used:
        assert used["--prefix"] in (EXAMPLE / "tasks.py").read_text()
    else:
        assert "global_keyprefix" not in (EXAMPLE / "tasks.py").read_text()
    documented = set(FLAG.findall(page_section("Monitoring (Prometheus)"))) \
        | set(FLAG.findall(page_section("Running it with docker-compose")))
    assert set(used) <= documented, set(used) - documented

    published = [str(port) for port in services(config)["exporter"].get("ports", [])]
    assert any(re.search(rf"(^|:){used['--port']}(/tcp)?$", port) for port in published), published


def test_every_exporter_flag_is_in_its_help(config: dict[str, Any]) -> None:
    script = Path(sys.executable).with_name("celery-redis-lua")
    command = [str(script)] if script.exists() else \
        [sys.executable, "-c", "from celery_redis_lua.tools.cli import main; main()"]
    done = subprocess.run([*command, "exporter", "--help"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    help_flags = set(FLAG.findall(done.stdout))
    used = set(options(exporter_args(config)))
    assert used <= help_flags, used - help_flags
    # The same variable is the CLI's --url default, as the example's README says.
    assert "CELERY_BROKER_URL" in done.stdout


def test_prometheus_scrapes_the_exporter(docker_compose: str, config: dict[str, Any], promtool: str) -> None:
    prometheus = services(config)["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus"), prometheus["image"]
    mounts = {}
    for volume in prometheus["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = Path(source)
        # docker-compose does not check that a bind-mounted file exists.
        assert Path(source).is_file(), volume
    assert mounts["/etc/prometheus/prometheus.yml"] == EXAMPLE / "prometheus.yml"

    scrape = load_yaml((EXAMPLE / "prometheus.yml").read_text(), docker_compose)
    port = options(exporter_args(config))["--port"]
    jobs = [job for job in scrape["scrape_configs"]
            if any(f"exporter:{port}" in static.get("targets", [])
                   for static in job.get("static_configs", []))]
    assert len(jobs) == 1, scrape
    assert jobs[0].get("scrape_interval", scrape.get("global", {}).get("scrape_interval")) == "15s"
    # Rule files are relative to the config file: each is mounted beside it.
    for rule_file in scrape["rule_files"]:
        assert mounts[f"/etc/prometheus/{rule_file}"] == EXAMPLE / rule_file, rule_file
    assert "alerts.yml" in scrape["rule_files"]

    done = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=EXAMPLE,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_celery_mixin_alert(docker_compose: str, promtool: str, tmp_path: Path) -> None:
    alerts = load_yaml((EXAMPLE / "alerts.yml").read_text(), docker_compose)
    rules = {rule["alert"]: rule for group in alerts["groups"] for rule in group["rules"] if "alert" in rule}
    rule = rules["CeleryHighQueueLength"]
    assert rule["expr"].strip() == HIGH_QUEUE_LENGTH
    assert "CeleryHighQueueLength" in page_section("Monitoring (Prometheus)")

    # It fires for a queue above 100 for its `for:` (20m), never for queue_name="None".
    labels = {"alertname": "CeleryHighQueueLength", "queue_name": "celery", **rule.get("labels", {})}
    annotations = {key: value.replace("{{ $labels.queue_name }}", "celery")
                   for key, value in rule.get("annotations", {}).items()}
    tests = {"rule_files": [str(EXAMPLE / "alerts.yml")], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": 'celery_queue_length{queue_name="celery", job="celery-exporter"}', "values": "150x40"},
            {"series": 'celery_queue_length{queue_name="None", job="celery-exporter"}', "values": "500x40"},
            {"series": 'celery_queue_length{queue_name="quiet", job="celery-exporter"}', "values": "100x40"},
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "CeleryHighQueueLength", "exp_alerts": []},
            {"eval_time": "30m", "alertname": "CeleryHighQueueLength",
             "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}]},
        ],
    }]}
    (tmp_path / "alerts_test.yml").write_text(json.dumps(tests))  # JSON is YAML
    done = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", ["tasks.py", "producer.py"])
def test_the_python_files_compile_and_read_the_broker_url(name: str, tmp_path: Path) -> None:
    path = EXAMPLE / name
    py_compile.compile(str(path), cfile=str(tmp_path / (name + "c")), doraise=True)
    constants = {node.value for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert "CELERY_BROKER_URL" in constants, f"{name} does not read CELERY_BROKER_URL"


def test_the_app_selects_our_transport() -> None:
    """tasks.py's app, given the compose file's URL, gets celery-redis-lua's transport
    (making the Connection connects to nothing)."""
    probe = ("import tasks; t = tasks.app.connection_for_write().transport; "
             "print(type(t).__module__, tasks.app.conf.broker_url)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=EXAMPLE, capture_output=True, text=True,
                          env={**os.environ, "CELERY_BROKER_URL": "redislua://valkey:6379/0"},
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    module, url = done.stdout.split()
    assert module.startswith("celery_redis_lua."), module
    assert url == "redislua://valkey:6379/0"
