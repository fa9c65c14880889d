"""The celery-redis-lua command line: publish and status against a real server, URLs
(our schemes, the environment variable, a Unix socket), and one-line failures that never
show a password. tests/test_cli_admin.py covers `scripts` and `dead`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import click
import pytest
import redis
from click.testing import CliRunner, Result

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.producer import decode_body
from celery_redis_lua.protocol.retry import DelayedRetry
from celery_redis_lua.tools.cli import main
from celery_redis_lua.tools.cli.broker import DEFAULT_URL, broker_of, transport_url
from celery_redis_lua.tools.cli.output import mask
from helpers import message_state, server_now_ms, wait_for_server_time
from scripts.servers import Server, free_port

SECRET = "s3cret-Pw"


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def one_line_error(result: Result, *needles: str) -> str:
    """The command failed with exactly one line on stderr (containing ``needles``)."""
    assert result.exit_code != 0, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("celery-redis-lua: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert SECRET not in result.output
    return lines[0]


@pytest.fixture
def url(standalone: redis.Redis, valkey_server: Server) -> str:
    return f"redis://127.0.0.1:{valkey_server.port}/0"


def status_rows(result: Result) -> dict[str, list[int]]:
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["queue", "ready", "delayed", "retrying", "in_flight", "dead", "paused",
                              "limits"]
    assert all(row.split()[6] == "no" for row in rows)
    # ready, delayed, in_flight, dead (retrying: see test_status_shows_a_retry_waiting_as_retrying)
    return {row.split()[0]: [int(n) for i, n in enumerate(row.split()[1:6]) if i != 2] for row in rows}


def test_publish_stores_a_celery_envelope_and_status_shows_it_ready(
        url: str, standalone: redis.Redis) -> None:
    result = invoke("publish", "tasks.add", "--args", "[2, 3]", "--kwargs", '{"z": 1}',
                    "--queue", "cliq", "--priority", "7", "--url", url)
    assert result.exit_code == 0, result.output
    task_id = result.stdout.strip()
    assert len(task_id) == 36 and task_id.count("-") == 4
    assert invoke("publish", "tasks.other", "--queue", "other", "--url", url).exit_code == 0

    assert status_rows(invoke("status", "--queue", "cliq", "--url", url)) == {"cliq": [1, 0, 0, 0]}
    # Without --queue, the queues are found from their meta:{Q} keys.
    assert status_rows(invoke("status", "--url", url)) == {"cliq": [1, 0, 0, 0], "other": [1, 0, 0, 0]}

    [delivery] = ScriptLibrary(standalone, Keyspace()).consume(["cliq"], 10).deliveries
    envelope = json.loads(delivery.payload)
    assert envelope["headers"]["task"] == "tasks.add" and envelope["headers"]["id"] == task_id
    assert envelope["properties"]["priority"] == 7
    assert envelope["properties"]["delivery_info"]["routing_key"] == "cliq"
    assert decode_body(envelope)[:2] == [[2, 3], {"z": 1}]
    # The script stored the priority in the message's state: (state, count, priority, expires_at).
    assert message_state(standalone, Keyspace(), "cliq", delivery.id) == ("unacked", 0, 7, "-")


def test_status_shows_a_retry_waiting_as_retrying(url: str, standalone: redis.Redis) -> None:
    """A message waiting for its delayed retry is one of the delayed, and the table says which
    (issue 42 §1.6: it showed as a countdown)."""
    lib = ScriptLibrary(standalone, Keyspace(), visibility_ms=60_000)
    lib.declare("backoff", retry=DelayedRetry("failed", 60_000, 120_000))
    lib.publish("backoff", "fails once")
    lib.publish("backoff", "later", eta_ms=server_now_ms(standalone) + 60_000)
    [taken] = lib.consume(["backoff"], 1).deliveries
    assert lib.reject("backoff", [taken.id], requeue=True).requeued == 1  # into its retry
    shown = invoke("status", "--queue", "backoff", "--url", url)
    assert shown.exit_code == 0, shown.output
    header, row = shown.stdout.splitlines()
    assert dict(zip(header.split(), row.split(), strict=False)) == {
        "queue": "backoff", "ready": "0", "delayed": "2", "retrying": "1", "in_flight": "0",
        "dead": "0", "paused": "no", "limits": "-"}


def test_countdown_is_an_eta_by_the_servers_clock(url: str, standalone: redis.Redis) -> None:
    before = server_now_ms(standalone)
    result = invoke("publish", "tasks.later", "--countdown", "30", "--prefix", "app:", "--url", url)
    after = server_now_ms(standalone)
    assert result.exit_code == 0, result.output
    keys = Keyspace("app:")
    [(member, eta)] = standalone.zrange(keys.delayed("celery"), 0, -1, withscores=True)
    assert before + 30_000 <= eta <= after + 30_000
    payload = json.loads(standalone.hget(keys.message("celery"), member))
    assert payload["headers"]["id"] == result.stdout.strip()
    assert message_state(standalone, keys, "celery", member.decode()) == ("delayed", 0, 0, "-")
    assert status_rows(invoke("status", "--prefix", "app:", "--url", url)) == {"celery": [0, 1, 0, 0]}
    # The prefix matters: without it there is no queue.
    assert invoke("status", "--url", url).stdout.startswith("no queues")


def test_publish_with_a_dedup_id_stores_one_and_names_it(url: str, standalone: redis.Redis) -> None:
    """--dedup simple: the same task and arguments again is not stored while the first waits;
    stderr names the message that holds the id. Throttle needs --dedup-ttl."""
    first = invoke("publish", "tasks.add", "--args", "[1, 2]", "--dedup", "simple", "--url", url)
    assert first.exit_code == 0 and "not stored" not in first.stderr, first.output
    [held_by] = [i.decode() for i in standalone.hkeys(Keyspace().message("celery"))]
    again = invoke("publish", "tasks.add", "--args", "[1, 2]", "--dedup", "simple", "--url", url)
    assert again.exit_code == 0, again.output
    assert f"celery-redis-lua publish: not stored: message {held_by} holds dedup id " \
        f"'tasks.add:{hashlib.sha1(b'[[1,2],{}]').hexdigest()}'\n" in again.stderr
    other = invoke("publish", "tasks.add", "--args", "[2, 1]", "--dedup", "simple", "--url", url)
    assert "not stored" not in other.stderr
    assert standalone.hlen(Keyspace().message("celery")) == 2
    one_line_error(invoke("publish", "tasks.add", "--dedup", "throttle", "--url", url),
                   "--dedup: dedup mode 'throttle' needs a ttl")


def test_publish_with_a_fairness_key_makes_the_queue_fair(url: str, standalone: redis.Redis) -> None:
    """--fairness-key: the key's start tag is in meta; a bad key is refused by name, nothing stored."""
    assert invoke("publish", "tasks.add", "--fairness-key", "tenant-42", "--url", url).exit_code == 0
    meta = Keyspace().meta("celery")
    assert int(standalone.hget(meta, "fair:tenant-42")) == int(standalone.hget(meta, "fair")) + 1
    refused = invoke("publish", "tasks.add", "--fairness-key", "k" * 257, "--queue", "other", "--url", url)
    one_line_error(refused, "--fairness-key must be a string of 1..256 bytes")
    assert standalone.exists(Keyspace().queue("other")) == 0


def test_priority_out_of_range_is_the_scripts_one_line_error(url: str, standalone: redis.Redis) -> None:
    result = invoke("publish", "tasks.add", "--priority", "256", "--url", url)
    one_line_error(result, "priority must be an integer in 0..255, got '256'")
    assert standalone.exists(Keyspace().queue("celery")) == 0


@pytest.mark.parametrize(("option", "value", "needle"), [
    ("--args", "[1,", "--args is not valid JSON"),
    ("--kwargs", "{'z': 1}", "--kwargs is not valid JSON"),
    ("--args", '{"a": 1}', "--args must be a JSON array"),
    ("--kwargs", "[1]", "--kwargs must be a JSON object"),
    ("--countdown", "-1", "--countdown must be >= 0"),
    ("--priority", "high", "'high' is not a valid integer"),
    ("--dedup", "once", "'once' is not one of 'simple', 'throttle', 'debounce'"),
    ("--dedup-ttl", "0", "--dedup: the task option dedup's 'ttl' must be a positive number of seconds"),
])
def test_bad_publish_arguments_fail_in_one_line_and_store_nothing(
        url: str, standalone: redis.Redis, option: str, value: str, needle: str) -> None:
    one_line_error(invoke("publish", "tasks.add", option, value, "--url", url), needle)
    assert standalone.dbsize() == 0


@pytest.mark.parametrize(("bad", "needle", "shown"), [
    (f"http://:{SECRET}@127.0.0.1:1/0", "expected redis://", "'http://:***@127.0.0.1:1/0'"),
    (f"user:{SECRET}@127.0.0.1:1/0", "(no scheme)", None),
    (f"redislua://:{SECRET}@127.0.0.1:notaport/0", "Port could not be cast", "redislua://:***@"),
    (f"redis://:{SECRET}@127.0.0.1:1/db", "database must be a number, got 'db'", "redis://:***@"),
])
def test_bad_url_is_one_line_without_the_password(bad: str, needle: str, shown: str | None) -> None:
    line = one_line_error(invoke("status", "--url", bad), "bad URL", needle)
    assert shown is None or shown in line


def test_unreachable_server_is_one_line_without_the_password() -> None:
    port = free_port()  # nothing listens there
    line = one_line_error(invoke("status", "--url", f"redislua://user:{SECRET}@127.0.0.1:{port}/0"),
                          "cannot reach", f"redislua://user:***@127.0.0.1:{port}/0")
    assert "Connection refused" in line


def test_wrong_password_is_refused_and_never_printed() -> None:
    with Server("valkey") as server:
        server.client().config_set("requirepass", SECRET)
        ok = invoke("publish", "tasks.add", "--url", f"redislua://:{SECRET}@127.0.0.1:{server.port}/0")
        assert ok.exit_code == 0 and SECRET not in ok.output
        wrong = f"redis://:wrong-{SECRET}@127.0.0.1:{server.port}/0"
        one_line_error(invoke("status", "--url", wrong), "cannot log in", "redis://:***@")
        env_url = f"redis://:nope{SECRET}@127.0.0.1:{server.port}/0"
        one_line_error(invoke("status", env={"CELERY_BROKER_URL": env_url}), "cannot log in",
                       "redis://:***@")
        # kombu's parse_url fails on ?password= with a TypeError, for a worker too: refused
        # here, by name, without the password.
        query_url = f"redis://127.0.0.1:{server.port}/0?password=nope{SECRET}"
        one_line_error(invoke("status", "--url", query_url), "bad URL", "userinfo", "password=***")


def test_url_comes_from_celery_broker_url_and_lua_schemes_map_to_redis(valkey_server: Server,
                                                                        standalone: redis.Redis) -> None:
    env = {"CELERY_BROKER_URL": f"redislua://127.0.0.1:{valkey_server.port}/3"}
    assert invoke("publish", "tasks.add", "--queue", "envq", env=env).exit_code == 0
    assert status_rows(invoke("status", env=env)) == {"envq": [1, 0, 0, 0]}
    assert standalone.dbsize() == 0  # it went to db 3, as the URL says
    assert transport_url(f"rediss://:{SECRET}@h:1/2") == f"redisluas://:{SECRET}@h:1/2"
    assert transport_url("unix:///run/r.sock") == "redislua+socket:///run/r.sock"
    assert transport_url("sentinel://h:1;sentinel://g:2") == "redislua+sentinel://h:1;redislua+sentinel://g:2"
    assert transport_url("redis://h:1/0;redis://g:2/0") == "redislua://h:1/0"  # Celery's failover list
    assert mask(f"rediss://u:{SECRET}@h:1/0?a=1&password={SECRET}") == "rediss://u:***@h:1/0?a=1&password=***"


@pytest.fixture
def socket_server() -> Iterator[Server]:
    with Server("valkey", unix_socket=True) as server:
        yield server


@pytest.mark.parametrize("scheme", ["unix", "redislua+socket"])
def test_unix_socket(socket_server: Server, scheme: str) -> None:
    url = f"{scheme}://{socket_server.socket_path}"
    assert invoke("publish", "tasks.add", "--queue", "sockq", "--url", url).exit_code == 0
    assert status_rows(invoke("status", "--url", url)) == {"sockq": [1, 0, 0, 0]}


def test_installed_console_script_publishes_and_reports(url: str) -> None:
    script = Path(sys.executable).parent / "celery-redis-lua"
    assert script.exists(), "console script missing: pip install -e . (pyproject [project.scripts])"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(script), *args, "--url", url.replace("redis://", "redislua://")],
                              capture_output=True, text=True, timeout=60)

    published = run("publish", "tasks.add", "--args", "[1, 2]", "--queue", "subq", "--countdown", "60")
    assert published.returncode == 0, published.stderr
    ready = run("publish", "tasks.add", "--queue", "subq")
    assert ready.returncode == 0 and ready.stdout.strip() != published.stdout.strip()
    status = run("status", "--queue", "subq")
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[1].split() == ["subq", "1", "1", "0", "0", "0", "no", "-"]
    bad = run("publish", "tasks.add", "--args", "nope")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("celery-redis-lua: error: --args is not valid JSON")


# -- which server a command asked ---------------------------------------------------------

def run_in(directory: Path, *args: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it, from ``directory``, without CELERY_BROKER_URL."""
    environment = {k: v for k, v in os.environ.items() if k != "CELERY_BROKER_URL"} | (env or {})
    return subprocess.run([sys.executable, "-m", "celery_redis_lua", *args], cwd=directory,
                          env=environment, capture_output=True, text=True, timeout=60)


def test_every_command_names_the_server_it_asked(valkey_server: Server, tmp_path: Path) -> None:
    client = valkey_server.client()
    client.flushall()
    ScriptLibrary(client, Keyspace("proj:")).publish("orders", "m")
    (tmp_path / "proj.py").write_text(
        "from celery import Celery\n"
        f"app = Celery('proj', broker='redislua://127.0.0.1:{valkey_server.port}/0')\n"
        "app.conf.broker_transport_options = {'global_keyprefix': 'proj:'}\n")
    from_app = run_in(tmp_path, "status", "-A", "proj")
    assert from_app.returncode == 0, from_app.stderr
    assert "orders" in from_app.stdout  # the app's broker, and its key prefix
    assert (f"celery-redis-lua: asked the broker redislua://127.0.0.1:{valkey_server.port}/0, "
            "key prefix 'proj:' (from the Celery app proj)") in from_app.stderr
    from_env = run_in(tmp_path, "status", "--prefix", "proj:", env={"CELERY_BROKER_URL": valkey_server.url})
    assert "orders" in from_env.stdout and "(from $CELERY_BROKER_URL)" in from_env.stderr
    given = run_in(tmp_path, "status", "--url", valkey_server.url)
    assert f"broker {valkey_server.url} (from --url)" in given.stderr


def test_without_a_url_the_default_is_named() -> None:
    """In process: the machine's own Redis listens on the default port, and tests never use it."""
    with click.Context(main, info_name="celery-redis-lua"):
        assert broker_of(None, "") == (DEFAULT_URL, "", "the default: no --url, $CELERY_BROKER_URL or "
                                                        "-A APP given")


def test_a_bad_app_is_one_line_naming_it(tmp_path: Path) -> None:
    missing = run_in(tmp_path, "status", "-A", "nosuchmodule")
    assert missing.returncode == 1 and "cannot load the Celery app -A 'nosuchmodule'" in missing.stderr
    (tmp_path / "nobroker.py").write_text("from celery import Celery\napp = Celery('nobroker')\n"
                                          "app.conf.broker_url = ''\n")
    no_broker = run_in(tmp_path, "status", "-A", "nobroker")
    assert no_broker.returncode == 1 and "names no broker_url" in no_broker.stderr, no_broker.stderr


# -- issue 42 §1.2-§1.5: a mistyped name is not success, and errors speak the CLI's language --

NO_QUEUE = "no queue 'nosuch' (never declared, deleted, or expired)"


@pytest.mark.parametrize("command", [
    ["status", "--queue", "nosuch"], ["pause", "nosuch"], ["resume", "nosuch"],
    ["limit", "nosuch", "--in-flight", "3"], ["dead", "list", "nosuch"],
    ["dead", "replay", "nosuch"], ["dead", "replay", "nosuch", "1-0"], ["dead", "purge", "nosuch"],
], ids=lambda c: "-".join(c[:2]))
def test_a_queue_that_does_not_exist_is_not_found(url: str, command: list[str]) -> None:
    result = invoke(*command, "--url", url)
    assert result.exit_code == 3, result.output
    one_line_error(result, NO_QUEUE)
    assert "meta:" not in result.stderr


def test_a_queue_in_braces_is_named_as_typed(url: str) -> None:
    result = invoke("pause", "{flow}", "--url", url)
    assert result.exit_code == 3
    one_line_error(result, "no queue '{flow}'")
    assert "meta:" not in result.stderr


def test_dead_letters_of_a_queue_that_exists_but_has_none(url: str, standalone: redis.Redis) -> None:
    ScriptLibrary(standalone, Keyspace()).declare("flow")
    listed = invoke("dead", "list", "flow", "--url", url)
    assert (listed.exit_code, listed.stdout.strip()) == (0, "no dead letters in 'flow'")
    replayed = invoke("dead", "replay", "flow", "123-0", "--url", url)
    assert replayed.exit_code == 3, replayed.output
    assert replayed.stdout.startswith("replayed 0 dead letters into 'flow'")
    assert "1 of the 1 entry ids given are not dead letters of 'flow'" in replayed.stderr
    purged = invoke("dead", "purge", "flow", "--url", url)
    assert (purged.exit_code, purged.stdout.strip()) == (0, "purged 0 dead letters of 'flow'")


def test_limit_names_its_clear_flag_not_the_scripts_word(url: str, standalone: redis.Redis) -> None:
    ScriptLibrary(standalone, Keyspace()).declare("flow")
    result = invoke("limit", "flow", "--in-flight", "0", "--url", url)
    assert result.exit_code == 2, result.output
    assert "--in-flight must be an integer in 1..1000000 (or --clear-in-flight), got '0'" in result.stderr
    assert "'clear' or ''" not in result.stderr
    rate = invoke("limit", "flow", "--rate", "fast", "--url", url)
    assert "(or --clear-rate)" in rate.stderr and "'clear' or ''" not in rate.stderr


def test_cancel_of_a_cancelled_task_says_what_where_says(url: str, standalone: redis.Redis) -> None:
    task_id = invoke("publish", "tasks.add", "--queue", "flow", "--url", url).stdout.strip()
    assert invoke("cancel", task_id, "--url", url).exit_code == 0
    again = invoke("cancel", task_id, "--url", url)
    assert again.exit_code == 3, again.output
    where = invoke("where", task_id, "--url", url).stdout.strip()
    assert where.startswith(f"{task_id}: dead-lettered in 'flow': reason cancelled")
    assert again.stdout.strip() == f"{where}: nothing cancelled"


def test_dead_list_warns_that_an_expired_task_replays_only_to_be_discarded(
        url: str, standalone: redis.Redis) -> None:
    lib = ScriptLibrary(standalone, Keyspace())
    lib.publish("flow", "{}", ttl_ms=1)
    wait_for_server_time(standalone, server_now_ms(standalone) + 2)
    assert lib.consume(["flow"], 1).expired == 1
    listed = invoke("dead", "list", "flow", "--url", url)
    assert listed.exit_code == 0 and "expired" in listed.stdout
    assert "keeps its task's expires time" in listed.stderr


def test_dead_replay_renews_or_clears_a_task_s_expires_and_keeps_the_rest(
        url: str, standalone: redis.Redis) -> None:
    lib = ScriptLibrary(standalone, Keyspace())
    headers = {"id": "t-1", "task": "tasks.add", "expires": "2000-01-01T00:00:00+00:00",
               "retries": 12345678901234567890, "timelimit": [None, 7.5]}  # numbers cjson would round
    envelope = {"body": "W10=", "headers": headers, "properties": {"priority": 3, "delivery_info": {}},
                "content-type": "application/json"}
    for task_id in ("t-1", "t-2", "t-3"):
        envelope["headers"]["id"] = task_id
        lib.publish("flow", json.dumps(envelope), ttl_ms=1, task_id=task_id)
    lib.publish("flow", "not json", ttl_ms=1)
    wait_for_server_time(standalone, server_now_ms(standalone) + 2)
    assert lib.consume(["flow"], 10).expired == 4
    entries = [d.entry_id for d in lib.dead_list("flow")]
    both = invoke("dead", "replay", "flow", "--clear-expires", "--renew-expires", "5", "--url", url)
    assert both.exit_code == 2 and "cannot be combined" in both.stderr
    assert invoke("dead", "replay", "flow", "--renew-expires", "0", "--url", url).exit_code == 2
    before = server_now_ms(standalone) / 1000
    renewed = invoke("dead", "replay", "flow", entries[0], entries[3], "--renew-expires", "60", "--url", url)
    assert renewed.exit_code == 0, renewed.output
    cleared = invoke("dead", "replay", "flow", "--clear-expires", "--count", "1", "--url", url)
    assert cleared.exit_code == 0 and lib.dead_list("flow")[0].entry_id == entries[2]
    payloads = [d.payload for d in lib.consume(["flow"], 10).deliveries]
    assert b"not json" in payloads  # no Celery envelope: replayed as it was
    decoded = {d["headers"]["id"]: d for d in (json.loads(p) for p in payloads if p != b"not json")}
    expires = datetime.fromisoformat(decoded["t-1"]["headers"]["expires"]).timestamp()
    assert before + 60 <= expires <= before + 62
    assert decoded["t-2"]["headers"]["expires"] is None
    for task_id in ("t-1", "t-2"):  # the rest of the envelope as it was
        kept = {**envelope, "headers": {**envelope["headers"], "id": task_id}}
        assert {**decoded[task_id], "headers": {**decoded[task_id]["headers"], "expires": None}} == \
            {**kept, "headers": {**kept["headers"], "expires": None}}
