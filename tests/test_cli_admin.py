"""`celery-redis-lua scripts ...` and `celery-redis-lua dead ...` against a real Valkey."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
import sys

import pytest
import redis
from click.testing import CliRunner, Result

from celery_redis_lua import Keyspace, ScriptLibrary, load_scripts
from celery_redis_lua.protocol.contract import read_manifest
from celery_redis_lua.protocol.producer import build_envelope, dumps
from celery_redis_lua.tools.cli import main
from scripts.servers import Server


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def url(standalone: redis.Redis, valkey_server: Server) -> str:
    standalone.script_flush()
    return f"redislua://127.0.0.1:{valkey_server.port}/0"


def rows(result: Result) -> list[list[str]]:
    return [line.split() for line in result.stdout.splitlines()]


def test_list_load_verify_follow_the_servers_script_cache(url: str, standalone: redis.Redis) -> None:
    manifest = read_manifest()
    names = sorted(manifest)

    unloaded = invoke("scripts", "verify", "--url", url)
    assert unloaded.exit_code == 1
    assert rows(unloaded) == [[n, manifest[n]["sha1"], "not", "loaded"] for n in names]
    assert unloaded.stderr.strip().splitlines() == [
        f"celery-redis-lua: error: {len(names)} of {len(names)} scripts failed verification "
        f"(load them with: celery-redis-lua scripts load) [asked the broker {url} (from --url)]"]
    listed = invoke("scripts", "list", "--url", url)
    assert rows(listed)[1:] == [[n, str(manifest[n]["version"]), manifest[n]["sha1"], "no"] for n in names]

    loaded = invoke("scripts", "load", "--url", url)
    assert loaded.exit_code == 0
    assert rows(loaded) == [[n, manifest[n]["sha1"]] for n in names]
    assert all(standalone.script_exists(*(manifest[n]["sha1"] for n in names)))
    verified = invoke("scripts", "verify", "--url", url)
    assert verified.exit_code == 0 and {row[2] for row in rows(verified)} == {"ok"}
    assert {row[3] for row in rows(invoke("scripts", "list", "--url", url))[1:]} == {"yes"}

    standalone.script_flush()
    standalone.script_load(load_scripts()["publish"].source)
    partial = invoke("scripts", "verify", "--url", url)
    assert partial.exit_code == 1 and f"{len(names) - 1} of {len(names)}" in partial.stderr
    assert [row[0] for row in rows(partial) if row[2] == "ok"] == ["publish"]


def test_show_prints_the_header_contract_only() -> None:
    shown = invoke("scripts", "show", "publish")
    assert shown.exit_code == 0
    contract = load_scripts()["publish"].contract
    lines = shown.stdout.splitlines()
    assert lines[0] == "#!lua" and lines[1] == "-- name: publish"
    assert all(line.startswith("--") for line in lines[1:])
    assert all(f"--   {error}" in lines for error in contract.errors)
    assert "rcall" not in shown.stdout  # no code
    missing = invoke("scripts", "show", "publsh")
    assert missing.exit_code == 1 and len(missing.stderr.splitlines()) == 1
    assert "no script named 'publsh'; scripts: ack, bind" in missing.stderr


def dead_lettered(lib: ScriptLibrary, queue: str) -> tuple[str, str]:
    """Dead-letter an envelope and a payload that is not one; returns the envelope's task id."""
    envelope = build_envelope("tasks.add", [1, 2], queue=queue)
    lib.publish(queue, dumps(envelope))
    lib.publish(queue, "not a kombu envelope")
    ids = [d.id for d in lib.consume([queue], 2).deliveries]
    assert lib.reject(queue, ids, requeue=False).dead_lettered == 2
    return envelope["headers"]["id"], dumps(envelope)


def test_dead_list_replay_purge(url: str, standalone: redis.Redis) -> None:
    lib = ScriptLibrary(standalone, Keyspace())
    assert invoke("dead", "list", "dq", "--url", url).exit_code == 3  # no such queue (yet)
    lib.declare("dq")
    assert invoke("dead", "list", "dq", "--url", url).stdout.strip() == "no dead letters in 'dq'"
    task_id, payload = dead_lettered(lib, "dq")
    letters = lib.dead_list("dq")

    listed = invoke("dead", "list", "dq", "--url", url)
    assert listed.exit_code == 0
    assert rows(listed) == [
        ["entry", "message", "reason", "count", "task", "task_id"],
        [letters[0].entry_id, letters[0].id, "rejected", "0", "tasks.add", task_id],
        [letters[1].entry_id, letters[1].id, "rejected", "0", "-", "-"],
    ]
    after = invoke("dead", "list", "dq", "--after", letters[0].entry_id, "--count", "5", "--url", url)
    assert [row[0] for row in rows(after)[1:]] == [letters[1].entry_id]

    replayed = invoke("dead", "replay", "dq", letters[0].entry_id, "--url", url)
    assert replayed.exit_code == 0, replayed.output
    head, new_id = replayed.stdout.splitlines()
    assert head == "replayed 1 dead letters into 'dq'"
    [stats] = lib.stats(["dq"])
    assert (stats.ready, stats.dead) == (1, 1)
    [delivery] = lib.consume(["dq"], 5).deliveries
    assert delivery.id == new_id and delivery.payload.decode() == payload
    assert json.loads(delivery.payload)["headers"]["id"] == task_id

    purged = invoke("dead", "purge", "dq", "--url", url)
    assert purged.stdout.strip() == "purged 1 dead letters of 'dq'"
    assert lib.stats(["dq"])[0].dead == 0


def test_bad_dead_list_count_is_the_scripts_one_line_error(url: str, standalone: redis.Redis) -> None:
    ScriptLibrary(standalone, Keyspace()).declare("dq")
    result = invoke("dead", "list", "dq", "--count", "0", "--url", url)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "celery-redis-lua: error: dead_list: count must be an integer in 1..10000, got '0' "
        f"[asked the broker {url} (from --url)]"]


def test_dead_replay_of_more_than_one_call_takes_goes_in_batches(url: str, standalone: redis.Redis) -> None:
    """The script replays at most 10,000 a call; the command replays any count, a batch at a
    time (a progress bar only on a terminal: none here, stderr is a pipe)."""
    lib = ScriptLibrary(standalone)
    lib.declare("many")
    pipe = standalone.pipeline(transaction=False)
    for i in range(10_050):
        pipe.xadd(lib.keys.dead("many"), {"id": f"{i:014x}", "reason": "rejected", "delivery_count": 0,
                                           "priority": 0, "payload": f"m{i}"})
    pipe.execute()
    done = invoke("dead", "replay", "many", "--count", "10050", "--url", url)
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("replayed 10050 dead letters into 'many'")
    assert lib.stats(["many"])[0].ready == 10_050 and standalone.xlen(lib.keys.dead("many")) == 0
    assert "replaying" not in done.stderr


def test_a_long_replay_draws_a_progress_bar_on_a_terminal(url: str, standalone: redis.Redis) -> None:
    """stderr a terminal (a pty): rich's bar is drawn there while the batches go."""
    lib = ScriptLibrary(standalone)
    lib.declare("barred")
    pipe = standalone.pipeline(transaction=False)
    for i in range(3000):
        pipe.xadd(lib.keys.dead("barred"), {"id": f"{i:014x}", "reason": "rejected", "delivery_count": 0,
                                             "priority": 0, "payload": f"m{i}"})
    pipe.execute()
    main_fd, terminal = pty.openpty()
    command = [sys.executable, "-m", "celery_redis_lua", "dead", "replay", "barred", "--count", "3000"]
    done = subprocess.Popen([*command, "--url", url], stdout=subprocess.PIPE, stderr=terminal)
    os.close(terminal)
    drawn = b""
    with contextlib.suppress(OSError):  # EIO once the command has exited and closed its end
        while chunk := os.read(main_fd, 4096):
            drawn += chunk
    os.close(main_fd)
    stdout, _ = done.communicate(timeout=60)
    assert done.returncode == 0 and stdout.startswith(b"replayed 3000 dead letters")
    assert b"replaying dead letters of 'barred'" in drawn
