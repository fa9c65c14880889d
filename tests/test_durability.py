"""The durability option: publishes confirmed by a replica (WAIT) or the AOF (WAITAOF), one
wait per pipeline, a clear error when the wait falls short, and at connect time when the
server cannot honour the setting. Real primaries and replicas of each kind."""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_redis_lua import Keyspace, Policy, ScriptLibrary
from celery_redis_lua.protocol.durability import Durability, DurabilityUnavailable, NotDurable
from conftest import require_kind
from helpers import wait_until
from scripts.servers import Server


class Pair:
    """A primary and one replica of it."""

    def __init__(self, kind: str, args: list[str]) -> None:
        args = [*args, "--repl-diskless-sync-delay", "0"]
        self.primary = Server(kind, args=args).start()
        self.replica = Server(kind, args=[*args, "--replicaof", "127.0.0.1", str(self.primary.port)]).start()
        wait_until(lambda: self.replica.client().info("replication")["master_link_status"] == "up"
                   and self.primary.client().info("replication").get("slave0", {}).get("state") == "online",
                   timeout=20, what="the replica in sync")
        # Redis 7.0 calls a new replica online a moment before it acknowledges writes.
        wait_until(self.confirms_a_write, timeout=20, what="the replica acknowledges a write")

    def confirms_a_write(self) -> bool:
        pipe = self.primary.client().pipeline(transaction=False)
        pipe.set("probe", "1")
        pipe.execute_command("WAIT", 1, 200)
        return pipe.execute()[1] == 1

    def stop(self) -> None:
        self.replica.stop(signal.SIGKILL)
        self.primary.stop()

    def connection(self, **options: Any) -> Connection:
        return Connection(f"redislua://127.0.0.1:{self.primary.port}/0", transport_options=options)


@pytest.fixture(params=["valkey", "redis"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    require_kind(request.param)
    started = Pair(request.param, [])
    yield started
    started.stop()


def lib_for(server: Server, setting: str, timeout_ms: int = 300) -> ScriptLibrary:
    lib = ScriptLibrary(server.client(socket_timeout=10), Keyspace(),
                        Policy(durability=Durability.parse(setting, timeout_ms)))
    lib.runner.load()  # so no call meets NOSCRIPT (a reloaded pipeline waits again)
    return lib


def stopped(server: Server) -> Any:
    """SIGSTOP a replica: it stays connected and acknowledges nothing."""
    assert server.process is not None
    pid = server.process.pid

    class Stopped:
        def __enter__(self) -> None:
            os.kill(pid, signal.SIGSTOP)

        def __exit__(self, *exc: object) -> None:
            os.kill(pid, signal.SIGCONT)
    return Stopped()


def wait_calls(server: Server) -> int:
    return int(server.client().info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_a_confirmed_publish_is_on_the_replica_when_it_returns(pair: Pair) -> None:
    lib = lib_for(pair.primary, "replicas:1", timeout_ms=5000)
    message_id = lib.publish("q", "payload")
    assert pair.replica.client().hget(Keyspace().message("q"), message_id) == b"payload"


def test_a_publish_no_replica_confirms_raises_and_says_the_message_may_survive(pair: Pair) -> None:
    """Without WAIT the publish would report success; with it, the caller is told."""
    lib = lib_for(pair.primary, "replicas:1", timeout_ms=300)
    with stopped(pair.replica), pytest.raises(NotDurable) as raised:
        lib.publish("q", "unconfirmed")
    assert "publish: the write was applied on the primary but not confirmed as " \
           "durability='replicas:1' within 300 ms (0 replica(s) acknowledged)" in str(raised.value)
    assert "may or may not survive a failover" in str(raised.value)
    (message_id,) = raised.value.results
    assert pair.primary.client().hget(Keyspace().message("q"), message_id) == b"unconfirmed"


def test_an_ack_no_replica_confirms_stands_and_is_logged(pair: Pair,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    lib = lib_for(pair.primary, "replicas:1", timeout_ms=300)
    lib.publish("q", "work")
    (delivery,) = lib.consume(["q"], 1).deliveries
    with stopped(pair.replica), caplog.at_level(logging.WARNING):
        assert lib.ack("q", [delivery.id]) == 1  # no exception: the task is done
    assert "ack: the write was applied on the primary but not confirmed" in caplog.text
    assert lib.stats(["q"])[0].in_flight == 0


def test_fanout_publishes_are_not_waited_for(pair: Pair) -> None:
    """Events, heartbeats and remote control: transient, and sent every few seconds."""
    lib = lib_for(pair.primary, "replicas:1", timeout_ms=300)
    before = wait_calls(pair.primary)
    with stopped(pair.replica):
        lib.fanout_publish("celeryev", "heartbeat", maxlen=100)  # neither raises nor waits
    assert wait_calls(pair.primary) == before


def test_one_wait_per_pipeline_not_per_message(pair: Pair) -> None:
    lib = lib_for(pair.primary, "replicas:1", timeout_ms=5000)
    before = wait_calls(pair.primary)
    ids = lib.run_many([lib.calls.publish("q", f"m{i}") for i in range(50)])
    assert len(ids) == 50
    assert wait_calls(pair.primary) - before == 1
    lib.consume(["q"], 1)  # consume is not confirmed: no wait
    assert wait_calls(pair.primary) - before == 1


def test_publish_ack_and_reject_through_kombu_wait_each(pair: Pair) -> None:
    lib_for(pair.primary, "replicas:1")  # loads the scripts
    with pair.connection(durability="replicas:1") as connection:
        simple = connection.SimpleQueue("k")
        simple.put("declares the queue and its binding, once")
        simple.get(timeout=5).ack()
        simple.channel.outbox.send()  # that ack's wait is counted before, whenever it leaves
        before = wait_calls(pair.primary)
        simple.put("a")
        simple.put("b")
        simple.get(timeout=5).ack()
        simple.get(timeout=5).reject()
        simple.close()
    assert wait_calls(pair.primary) - before == 4


def test_too_few_replicas_at_connect_is_a_warning(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pair.connection(durability="replicas:2") as connection:
        connection.connect()
    assert "durability='replicas:2' asks for 2 replica(s) but the primary has 1 connected" in caplog.text


@pytest.fixture
def aof_valkey() -> Iterator[Server]:
    with Server("valkey", args=["--appendonly", "yes", "--appendfsync", "everysec"]) as server:
        yield server


def test_aof_durability_confirms_the_fsync(aof_valkey: Server) -> None:
    with Connection(f"redislua://127.0.0.1:{aof_valkey.port}/0",
                    transport_options={"durability": "aof"}) as connection:
        simple = connection.SimpleQueue("aof")
        simple.put("on disk")
        assert simple.get(timeout=5).payload == "on disk"
        simple.close()
    calls = aof_valkey.client().info("commandstats")["cmdstat_waitaof"]["calls"]
    assert calls >= 3  # the connect-time check, the publish, the ack


def test_aof_durability_under_everysec_on_valkey_is_warned_of(aof_valkey: Server,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Valkey's WAITAOF confirms writes before the fsync under everysec (the chaos harness's
    power loss, docs/deployment.md): the transport says so at connect; not with always."""
    for fsync, warned in (("everysec", True), ("always", False)):
        aof_valkey.client().config_set("appendfsync", fsync)
        caplog.clear()
        url = f"redislua://127.0.0.1:{aof_valkey.port}/0"
        options = {"durability": "aof"}
        with caplog.at_level(logging.WARNING), Connection(url, transport_options=options) as connection:
            connection.connect()
        assert ("WAITAOF confirms writes before they are fsynced (Valkey " in caplog.text) is warned, fsync


def test_aof_durability_without_appendonly_is_refused_at_connect(valkey_server: Server) -> None:
    with Connection(f"redislua://127.0.0.1:{valkey_server.port}/0",
                    transport_options={"durability": "aof"}) as connection, \
            pytest.raises(DurabilityUnavailable, match=r"'durability'='aof' cannot be honoured by this "
                                                       r"server: .*appendonly"):
        connection.connect()


def test_aof_durability_on_redis_7_0_is_refused_at_connect(redis_server: Server) -> None:
    version = redis_server.client().info("server")["redis_version"]
    if tuple(int(x) for x in version.split(".")[:2]) >= (7, 2):
        pytest.skip(f"redis {version} has WAITAOF")
    with Connection(f"redislua://127.0.0.1:{redis_server.port}/0",
                    transport_options={"durability": "aof+replicas:1"}) as connection, \
            pytest.raises(DurabilityUnavailable, match=r"WAITAOF is not a command of this server "
                                                       r"\(WAITAOF needs Redis 7.2\+ or Valkey\)"):
        connection.connect()


@pytest.mark.parametrize(("setting", "message"), [
    ("replicas", "expected 'replicas:N', 'aof' or 'aof+replicas:N', got 'replicas'"),
    ("replicas:0", "'replicas:N' needs N >= 1"),
    ("aof+replicas:x", "expected 'replicas:N'"),
])
def test_bad_durability_settings_name_themselves(setting: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"transport option 'durability': {message}")):
        Connection("redislua://127.0.0.1:1/0", transport_options={"durability": setting}).transport  # noqa: B018


def test_a_wait_the_acl_refuses_is_an_error_not_a_success(pair: Pair) -> None:
    admin = pair.primary.client()
    admin.execute_command("ACL", "SETUSER", "nowait", "on", ">pw", "~*", "+@all", "-wait")
    lib = ScriptLibrary(redis.Redis(port=pair.primary.port, username="nowait", password="pw"),
                        Keyspace(), Policy(durability=Durability.parse("replicas:1", 300)))
    with pytest.raises(redis.exceptions.NoPermissionError):
        lib.publish("q", "x")
