"""celery-redis-lua status: --json's stable shape, and --watch in a real terminal (tmux): the
live table follows the broker, shows rates, and Ctrl-C leaves a usable shell behind it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_redis_lua import ScriptLibrary
from conftest import require_tool
from helpers import wait_until
from scripts.servers import Server

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery_redis_lua", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def lib(valkey_server: Server) -> ScriptLibrary:
    client = valkey_server.client()
    client.flushall()
    return ScriptLibrary(client)


def test_status_json_has_a_stable_shape(valkey_server: Server, lib: ScriptLibrary) -> None:
    for i in range(3):
        lib.publish("jobs", f"m{i}")
    lib.declare("quiet")
    lib.pause("quiet", "deploy")
    lib.limit("jobs", in_flight=4, rate="20/s")
    done = cli("status", "--json", "--url", valkey_server.url)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert set(shown) == {"server_time_ms", "queues", "maxmemory_policy", "eviction_warning"}
    assert isinstance(shown["server_time_ms"], int)
    assert (shown["maxmemory_policy"], shown["eviction_warning"]) == ("noeviction", None)
    jobs, quiet = sorted(shown["queues"], key=lambda q: q["queue"])
    assert set(jobs) == {"queue", "ready", "delayed", "retrying", "in_flight", "dead", "paused", "limits",
                         "redelivered", "dropped", "oldest_ready_age_ms", "next_eta_in_ms"}
    assert (jobs["queue"], jobs["ready"], jobs["in_flight"], jobs["paused"]) == ("jobs", 3, 0, None)
    assert jobs["limits"] == {"in_flight": 4, "rate": "20/s"} and jobs["next_eta_in_ms"] is None
    assert (quiet["paused"], quiet["limits"]) == ("deploy", {"in_flight": None, "rate": None})
    empty = cli("status", "--json", "--queue", "quiet", "--url", valkey_server.url)
    assert json.loads(empty.stdout)["queues"][0]["ready"] == 0
    missing = cli("status", "--json", "--queue", "nothing-here", "--url", valkey_server.url)
    assert (missing.returncode, missing.stdout) == (3, "")
    assert "no queue 'nothing-here'" in missing.stderr


@pytest.fixture
def tmux() -> Iterator[tuple[str, str]]:
    binary = require_tool("tmux", "tmux", "run status --watch in a real terminal")
    session = f"crl-{uuid.uuid4().hex[:8]}"
    subprocess.run([binary, "new-session", "-d", "-s", session, "-x", "160", "-y", "20", "bash", "--norc"],
                   check=True)
    try:
        yield binary, session
    finally:
        subprocess.run([binary, "kill-session", "-t", session], check=False)


def screen(tmux: tuple[str, str]) -> str:
    binary, session = tmux
    return subprocess.run([binary, "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                          check=True).stdout


def test_status_watch_follows_the_broker_and_ctrl_c_leaves_the_terminal_usable(
        valkey_server: Server, lib: ScriptLibrary, tmux: tuple[str, str]) -> None:
    binary, session = tmux
    lib.publish("watched", "first")
    command = f"cd {ROOT} && {sys.executable} -m celery_redis_lua status --watch --interval 0.3 " \
              f"--url {valkey_server.url}; echo exited-$?"
    subprocess.run([binary, "send-keys", "-t", session, command, "Enter"], check=True)
    wait_until(lambda: "watched" in screen(tmux) and "ready/s" in screen(tmux), timeout=30,
               what="the live table")
    for i in range(5):
        lib.publish("watched", f"more{i}")
    row = wait_until(lambda: next((line for line in screen(tmux).splitlines()
                                   if "watched" in line and " 6 " in line), None), timeout=30,
                     what="the table follows the broker: 6 ready")
    assert "no" in row  # not paused
    subprocess.run([binary, "send-keys", "-t", session, "C-c"], check=True)
    wait_until(lambda: "exited-0" in screen(tmux), timeout=30, what="Ctrl-C ends it, status 0")
    subprocess.run([binary, "send-keys", "-t", session, "echo usable", "Enter"], check=True)
    wait_until(lambda: screen(tmux).count("usable") >= 2, timeout=10, what="the shell answers again")
    assert shutil.which(binary)


def test_every_table_has_its_json(valkey_server: Server, lib: ScriptLibrary) -> None:
    """scripts list, dead list and migrate --dry-run print JSON with --json, in the shapes
    docs/operations.md shows."""
    lib.declare("deadq")
    message_id = lib.publish("deadq", '{"headers": {"task": "tasks.add", "id": "t-9"}}')
    lib.consume(["deadq"], 1)
    lib.reject("deadq", [message_id], requeue=False)
    scripts = json.loads(cli("scripts", "list", "--json", "--url", valkey_server.url).stdout)
    assert {s["script"] for s in scripts} >= {"publish", "consume", "limit"}
    assert set(scripts[0]) == {"script", "version", "sha1", "loaded"}
    assert isinstance(scripts[0]["loaded"], bool)
    [letter] = json.loads(cli("dead", "list", "deadq", "--json", "--url", valkey_server.url).stdout)
    assert (letter["message"], letter["reason"], letter["task"], letter["task_id"]) == (
        message_id, "rejected", "tasks.add", "t-9")
    assert set(letter) == {"entry", "message", "reason", "delivery_count", "priority", "task", "task_id"}
    stock = valkey_server.client()
    stock.lpush("_stock_prefix_celery", json.dumps({"body": "", "headers": {}, "properties": {}}))
    planned = cli("migrate", "--from", valkey_server.url, "--from-prefix", "_stock_prefix_", "--queue",
                  "celery", "--dry-run", "--json", "--url", valkey_server.url)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout) == {"planned": {"celery": 1}}
