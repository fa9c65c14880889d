"""The eviction guard (issue 39 §5): a server whose maxmemory-policy may evict keys is named,
with what it can evict, when a worker connects, in status and in the exporter. Memorystore's
default, volatile-lru, evicts the keys that carry a TTL: x-expires queues among them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
from kombu import Connection

from celery_redis_lua.kombu import transport
from celery_redis_lua.protocol.eviction import read_eviction
from scripts.servers import Server


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    """Each test sees the warning as a new process would (it is given once per process)."""
    transport._warned_of_eviction.clear()
    yield
    transport._warned_of_eviction.clear()


def connect_and_publish(server: Server) -> None:
    with Connection(f"redislua://127.0.0.1:{server.port}/0") as connection:
        queue = connection.SimpleQueue("guarded")
        queue.put({"n": 1})
        queue.close()


def eviction_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "maxmemory-policy" in r.getMessage()]


@pytest.mark.parametrize(("policy", "what"), [
    ("volatile-lru", "keys with a TTL: x-expires queues"),
    ("allkeys-lfu", "any key: every queue"),
    ("volatile-ttl", "keys with a TTL"),
])
def test_a_worker_connecting_to_an_evicting_server_is_warned_once(
        scratch_server: Server, caplog: pytest.LogCaptureFixture, fresh_warnings: None,
        policy: str, what: str) -> None:
    scratch_server.client().config_set("maxmemory-policy", policy)
    with caplog.at_level(logging.WARNING, logger="celery_redis_lua.kombu.transport"):
        connect_and_publish(scratch_server)
        connect_and_publish(scratch_server)  # a second connection of the same process
    lines = eviction_lines(caplog)
    assert len(lines) == 1, lines
    assert f"has maxmemory-policy {policy}" in lines[0] and what in lines[0]
    assert f"127.0.0.1:{scratch_server.port}" in lines[0] and "noeviction" in lines[0]


def test_noeviction_is_not_warned_of(scratch_server: Server, caplog: pytest.LogCaptureFixture,
                                     fresh_warnings: None) -> None:
    assert scratch_server.client().config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    with caplog.at_level(logging.WARNING, logger="celery_redis_lua.kombu.transport"):
        connect_and_publish(scratch_server)
    assert eviction_lines(caplog) == []


def test_a_user_without_info_connects_and_the_policy_reads_unknown(
        valkey_server: Server, caplog: pytest.LogCaptureFixture, fresh_warnings: None) -> None:
    admin = valkey_server.client()
    admin.config_set("maxmemory-policy", "volatile-lru")
    admin.acl_setuser("noinfo", enabled=True, passwords=["+pw"], keys=["*"],
                      commands=["+@all", "-info"])
    try:
        with caplog.at_level(logging.WARNING, logger="celery_redis_lua.kombu.transport"), \
                Connection(f"redislua://noinfo:pw@127.0.0.1:{valkey_server.port}/0") as connection:
            queue = connection.SimpleQueue("guarded-noinfo")
            queue.put({"n": 1})
            assert queue.get(timeout=5).payload == {"n": 1}
            queue.close()
        assert eviction_lines(caplog) == []
        assert admin.execute_command("AUTH", "noinfo", "pw")  # this connection now refused INFO
        assert read_eviction(admin).policy is None
    finally:
        admin = valkey_server.client()
        admin.acl_deluser("noinfo")
        admin.config_set("maxmemory-policy", "noeviction")


def test_status_names_the_policy_on_stderr_and_in_json(valkey_server: Server) -> None:
    from click.testing import CliRunner

    from celery_redis_lua.tools.cli import main

    admin = valkey_server.client()
    admin.config_set("maxmemory-policy", "volatile-lru")
    try:
        # A real process: there the transport's own log warning would reach stderr too (logging's
        # last-resort handler), which pytest's log capture hides from an in-process run.
        shown = subprocess.run([sys.executable, "-m", "celery_redis_lua", "status",
                                "--url", valkey_server.url],
                               capture_output=True, text=True, timeout=60, check=False)
        assert shown.returncode == 0, shown.stderr
        assert "celery-redis-lua: warning: the broker has maxmemory-policy volatile-lru" in shown.stderr
        assert shown.stderr.count("maxmemory-policy volatile-lru") == 1, shown.stderr  # said once
        assert "maxmemory-policy" not in shown.stdout  # stdout stays the table
        as_json = CliRunner().invoke(main, ["status", "--json", "--url", valkey_server.url])
        payload = json.loads(as_json.stdout)
        assert payload["maxmemory_policy"] == "volatile-lru"
        assert "x-expires queues" in payload["eviction_warning"]
    finally:
        admin.config_set("maxmemory-policy", "noeviction")


def test_the_exporter_serves_the_policy(valkey_server: Server) -> None:
    from celery_redis_lua import Keyspace, ScriptLibrary
    from celery_redis_lua.tools.exporter import QueueCollector

    admin = valkey_server.client()
    collector = QueueCollector(ScriptLibrary(valkey_server.client(), Keyspace()), ["guarded"])

    def samples() -> list[tuple[dict[str, str], float]]:
        [family] = [f for f in collector.collect() if f.name == "celery_redis_lua_eviction_policy"]
        return [(s.labels, s.value) for s in family.samples]

    assert samples() == [({"policy": "noeviction"}, 0)]
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        assert samples() == [({"policy": "allkeys-lru"}, 1)]
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
