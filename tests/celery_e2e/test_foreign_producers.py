"""Producers in other languages: examples/node/publish.js and examples/shell/publish.sh.

Each one builds a Celery protocol v2 envelope itself and calls lua/publish.lua with
EVALSHA; a real Celery worker on the transport must then run the task with the given
arguments, in priority order relative to tasks from other producers (Celery's own
included), and not before its countdown by the server's clock.

The Node producer needs `node` and `npm` (its `redis` package is installed once per
run with `npm ci` into examples/node/node_modules, which git ignores); the shell
producer needs `redis-cli`, `base64`, `date` and `sha1sum`. Where one is missing the
test skips and says why; under CI (the CI variable set) that is a failure instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Server

from .harness import Broker, Worker, running, wait_for

ON_REDIS = True  # its Redis run is in `make test` too (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "examples" / "node"
SHELL_PRODUCER = ROOT / "examples" / "shell" / "publish.sh"
QUEUE = "celery"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

Publish = Callable[..., str]


def require_tools(what: str, *tools: str) -> None:
    missing = [tool for tool in tools if not shutil.which(tool)]
    if not missing:
        return
    reason = f"the {what} producer needs {', '.join(missing)} on PATH"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the {what} producer test: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def node_ready() -> Path:
    """examples/node with its dependencies installed (once; `npm ci` from the lock file)."""
    require_tools("Node.js", "node", "npm")
    npm = shutil.which("npm")
    assert npm is not None
    installed = subprocess.run([npm, "ls", "--omit=dev"], cwd=NODE_DIR, capture_output=True,
                               text=True, timeout=120)
    if installed.returncode != 0:
        install = "ci" if (NODE_DIR / "package-lock.json").exists() else "install"
        result = subprocess.run([npm, install, "--no-audit", "--no-fund"], cwd=NODE_DIR,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"npm {install} failed:\n{result.stdout}\n{result.stderr}"
    return NODE_DIR / "publish.js"


@pytest.fixture(params=["node", "shell"])
def command(request: pytest.FixtureRequest) -> list[str]:
    """The command line of the producer under test (without its options)."""
    if request.param == "node":
        node = shutil.which("node")
        script = request.getfixturevalue("node_ready")
        assert node is not None
        return [node, str(script)]
    require_tools("shell", "bash", "redis-cli", "base64", "date", "sha1sum")
    return ["bash", str(SHELL_PRODUCER)]


@pytest.fixture
def publish(command: list[str], servers: tuple[Server, Server]) -> Publish:
    """Run the producer against the broker server; return the task id it printed."""
    url = f"redis://127.0.0.1:{servers[0].port}/0"

    def run(task: str, args: str = "[]", *, kwargs: str | None = None, priority: int | None = None,
            countdown: float | None = None) -> str:
        line = [*command, "--url", url, "--queue", QUEUE, "--task", task, "--args", args]
        if kwargs is not None:
            line += ["--kwargs", kwargs]
        if priority is not None:
            line += ["--priority", str(priority)]
        if countdown is not None:
            line += ["--countdown", str(countdown)]
        result = subprocess.run(line, capture_output=True, text=True, timeout=60, cwd="/")
        assert result.returncode == 0, f"{line} failed: {result.stderr}"
        task_id = result.stdout.strip()
        assert UUID.match(task_id), f"expected a task id, got {result.stdout!r} {result.stderr!r}"
        return task_id

    return run


def server_time(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1_000_000


def test_foreign_tasks_run_with_their_arguments_in_priority_order(
        broker: Broker, producer: Celery, publish: Publish, servers: tuple[Server, Server],
        log_dir: Path) -> None:
    # (label, priority, published by): the foreign producer's tasks interleaved with
    # Celery's own, every priority out of order, two equal ones far apart.
    plan = [("f-low", 0, "foreign"), ("c-mid", 6, "celery"), ("f-top", 255, "foreign"),
            ("f-five-a", 5, "foreign"), ("c-high", 9, "celery"), ("f-seven", 7, "foreign"),
            ("f-five-b", 5, "foreign"), ("c-low", 1, "celery")]
    ids: dict[str, str] = {}
    for number, (label, priority, by) in enumerate(plan):
        if by == "celery":
            ids[label] = producer.send_task("celery_e2e.app.note", (label,), priority=priority).id
        elif number % 2:  # some by position, some by keyword: both reach the task
            ids[label] = publish("celery_e2e.app.note", "[]", kwargs=f'{{"label": "{label}"}}',
                                 priority=priority)
        else:
            ids[label] = publish("celery_e2e.app.note", f'["{label}"]', priority=priority)
    lib = ScriptLibrary(servers[0].client(), Keyspace())
    assert lib.stats([QUEUE])[0].ready == len(plan)  # the whole backlog waits in the broker

    worker = Worker(broker, name="foreign-prio", concurrency=1, env={"CRL_PREFETCH": "1"},
                    log_dir=log_dir)
    with running(worker):
        wait_for(lambda: len(broker.entries("ran")) >= len(plan), timeout=60,
                 what="every task to run")
    ran = broker.entries("ran")
    want = [label for label, _, _ in sorted(plan, key=lambda item: -item[1])]  # stable sort
    assert [entry["label"] for entry in ran] == want
    assert {entry["label"]: entry["id"] for entry in ran} == ids  # the ids the producers printed
    assert all((e["delivery_count"], e["redelivered"]) == (0, False) for e in ran)


def test_foreign_countdown_waits_in_the_broker_and_args_reach_the_task(
        broker: Broker, producer: Celery, publish: Publish, servers: tuple[Server, Server],
        log_dir: Path) -> None:
    client = servers[0].client()
    lib = ScriptLibrary(client, Keyspace())
    with running(Worker(broker, name="foreign-countdown", log_dir=log_dir)):
        sent = server_time(client)
        later = publish("celery_e2e.app.note", '["later"]', priority=200, countdown=2)
        held = lib.stats([QUEUE])[0]
        assert (held.ready, held.delayed) == (0, 1)  # held in delayed:{celery}, not in the worker
        [(_, eta_ms)] = client.zrange(Keyspace().delayed(QUEUE), 0, -1, withscores=True)
        # Published after it, ready at once: a plain task with positional args runs meanwhile.
        added = publish("celery_e2e.app.add", "[1, 2]", priority=3)
        assert producer.AsyncResult(added).get(timeout=30) == 3
        entry = wait_for(lambda: next((e for e in broker.entries("ran") if e["label"] == "later"), None),
                         timeout=30, what="the countdown task")
    assert eta_ms >= sent * 1000 + 2000  # its ETA, by the server's clock
    after = entry["at"] - sent  # worker clock vs server TIME: the same kernel clock here
    print(f"2 s countdown from a foreign producer ran {after:.3f}s after send")
    assert after >= 2.0, f"ran {after:.3f}s after send, before its countdown"
    assert (entry["id"], entry["delivery_count"], entry["redelivered"]) == (later, 0, False)


def test_where_finds_a_foreign_task_ready_then_delayed(publish: Publish,
                                                       servers: tuple[Server, Server]) -> None:
    """The foreign producers pass the task id to publish, so the index knows their tasks."""
    from celery_redis_lua.tools.locate import locate_task

    lib = ScriptLibrary(servers[0].client(), Keyspace())
    ready = publish("celery_e2e.app.note", '["now"]', priority=3)
    later = publish("celery_e2e.app.note", '["later"]', countdown=600)
    found = locate_task(lib, ready)
    assert (found.state, found.queue, found.priority) == ("ready", QUEUE, 3)
    delayed = locate_task(lib, later)
    assert delayed.state == "delayed" and delayed.eta_ms is not None
    assert delayed.eta_ms / 1000 - server_time(servers[0].client()) > 590


def test_the_node_producer_passes_a_dedup_id_and_says_which_message_holds_it(
        node_ready: Path, servers: tuple[Server, Server]) -> None:
    """The same reply a Python producer reads: the second publish of a held dedup id is not
    stored, and the Node producer names the message that holds it."""
    node = shutil.which("node")
    assert node is not None
    line = [node, str(node_ready), "--url", f"redis://127.0.0.1:{servers[0].port}/0", "--queue", QUEUE,
            "--task", "celery_e2e.app.note", "--args", '["once"]', "--dedup-id", "report:42"]
    first = subprocess.run(line, capture_output=True, text=True, timeout=60, cwd="/")
    again = subprocess.run(line, capture_output=True, text=True, timeout=60, cwd="/")
    assert first.returncode == again.returncode == 0, (first.stderr, again.stderr)
    [held_by] = [i.decode() for i in servers[0].client().hkeys(Keyspace().message(QUEUE))]
    assert first.stderr == ""
    assert again.stderr == f"publish.js: not stored: message {held_by} holds dedup id report:42\n"
    bad = subprocess.run([*line, "--dedup", "once"], capture_output=True, text=True, timeout=60, cwd="/")
    assert bad.returncode == 1 and "dedup_mode must be simple, throttle or debounce, got 'once'" in bad.stderr
