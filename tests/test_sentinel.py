"""Sentinel through kombu: both URL routes, a failover and a primary's SIGKILL under a
consumer, and the errors a bad setup gets at connect time. Real sentinels (the server
binary with --sentinel) of each kind, a primary and a replica."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Producer, Queue

import celery_redis_lua
from celery_redis_lua.protocol.options import OptionError
from celery_redis_lua.protocol.sentinel import SentinelConfigError
from conftest import require_kind
from helpers import wait_until
from scripts.servers import SentinelGroup, Server, free_port

MASTER = "mymaster"
OPTIONS = {"master_name": MASTER}


@pytest.fixture(params=["valkey", "redis"])
def group(request: pytest.FixtureRequest) -> Iterator[SentinelGroup]:
    """A fresh group per test (failovers change it)."""
    require_kind(request.param)
    with SentinelGroup(request.param, master_name=MASTER) as started:
        yield started


def roundtrip(connection: Connection, queue: str) -> Any:
    simple = connection.SimpleQueue(queue)
    try:
        simple.put({"q": queue})
        message = simple.get(timeout=10)
        message.ack()
        return message.payload
    finally:
        simple.close()


@pytest.mark.parametrize("route", ["scheme", "class"])
def test_both_routes_reach_the_primary_the_sentinels_name(group: SentinelGroup, route: str) -> None:
    if route == "scheme":
        connection = Connection(group.broker_url("redislua+sentinel", db=3), transport_options=OPTIONS)
    else:  # broker_transport = "celery_redis_lua:Transport" with kombu's sentinel:// URLs
        connection = Connection(group.broker_url("sentinel", db=3), transport="celery_redis_lua:Transport",
                                transport_options=OPTIONS)
    with connection:
        assert type(connection.transport) is celery_redis_lua.Transport
        assert roundtrip(connection, "routes") == {"q": "routes"}
        simple = connection.SimpleQueue("kept")
        simple.put("stays")
        simple.close()
    primary = group.primary.client()
    assert primary.dbsize() == 0  # db 3, from the last URL, as kombu's stock Sentinel takes it
    primary.execute_command("SELECT", 3)
    assert primary.keys("*{kept}*")
    replica = next(s for s in group.servers if s.port != group.primary.port).client()
    replica.execute_command("SELECT", 3)
    wait_until(lambda: replica.keys("*{kept}*"), what="the replica has the queue")


def test_held_and_batch_connections_find_the_primary_through_the_sentinels(group: SentinelGroup) -> None:
    """The channel's own connections (runner.HeldConnection for single calls, BatchWriter for
    unconfirmed batches) are Sentinel-managed: they ask the sentinels where the primary is
    (a Sentinel-managed connection that skipped connect() would go to localhost:6379)."""
    options = {**OPTIONS, "confirm_publish": False, "publish_pipeline": 10}
    with Connection(group.broker_url("redislua+sentinel"), transport_options=options) as connection:
        queue = Queue("held", routing_key="held")
        producer = Producer(connection, routing_key="held")
        for i in range(25):  # two full batches written, five pending until the close
            producer.publish({"n": i}, declare=[queue])
    primary = celery_redis_lua.ScriptLibrary(group.primary.client(), celery_redis_lua.Keyspace())
    assert primary.stats(["held"])[0].ready == 25


def consume_until(connection: Connection, queue: Queue, got: list[Any], count: int,
                  timeout: float) -> None:
    """A consumer that survives connection loss as kombu users write one: on a connection
    error, ensure_connection and consume again."""
    deadline = time.monotonic() + timeout
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"got {len(got)} of {count} within {timeout}s")
        try:
            with Consumer(connection, [queue], callbacks=[lambda body, m: (got.append(body), m.ack())]):
                while len(got) < count and time.monotonic() < deadline:
                    with contextlib.suppress(socket.timeout):
                        connection.drain_events(timeout=1)
        except connection.connection_errors:
            connection.ensure_connection(max_retries=60, interval_start=0.2, interval_step=0.2,
                                         interval_max=0.5)


@pytest.mark.parametrize("fault", ["failover", "kill"])
def test_a_consumer_follows_the_primary_through_a_failover(group: SentinelGroup, fault: str) -> None:
    """Messages published before and after the primary changes are all delivered, to one
    connection object that reconnected on its own (the sentinels named the new primary)."""
    queue = Queue("follow")
    url = group.broker_url()
    with Connection(url, transport_options={**OPTIONS, "durability": "replicas:1"}) as producer_conn:
        producer = Producer(producer_conn)
        for i in range(20):
            producer.publish({"n": i}, routing_key="follow", declare=[queue])
    got: list[Any] = []
    with Connection(url, transport_options=OPTIONS) as consumer_conn:
        consume_until(consumer_conn, queue, got, 10, timeout=30)
        old = group.primary.port
        if fault == "failover":
            group.failover()
        else:
            group.kill_primary()
        assert group.primary.port != old
        with Connection(url, transport_options=OPTIONS) as producer_conn:
            producer = Producer(producer_conn)
            for i in range(20, 30):
                producer.publish({"n": i}, routing_key="follow", declare=[queue])
        consume_until(consumer_conn, queue, got, 30, timeout=60)
    # Everything published with the durability option survived the failover; a message
    # delivered just as the primary changed may come again (its ack lost), never missing.
    assert {body["n"] for body in got} == set(range(30))


def test_passwords_for_the_primary_and_for_the_sentinels() -> None:
    """The URL's password is the primary's; the sentinels' own goes in sentinel_kwargs."""
    require_kind("valkey")
    with SentinelGroup("valkey", password="data-Pw", sentinel_password="sentinel-Pw") as group:
        url = group.broker_url()
        with Connection(url, transport_options={**OPTIONS, "sentinel_kwargs": {"password": "sentinel-Pw"}}) \
                as connection:
            assert roundtrip(connection, "guarded") == {"q": "guarded"}
        began = time.monotonic()
        with Connection(url, transport_options=OPTIONS) as connection, \
                pytest.raises(redis.ConnectionError, match=r"no sentinel answered for master 'mymaster': "
                                                           r"127.0.0.1:\d+ \(AuthenticationError"):
            connection.connect()  # the sentinels refuse us: no password for them
        # At once, not ridden out as a broker out of reach for reconnect_window (10 s) on each
        # of kombu's tries: this process reached these sentinels a moment ago.
        assert time.monotonic() - began < 10


def test_an_unknown_master_name_is_a_clear_error_at_connect(group: SentinelGroup) -> None:
    with Connection(group.broker_url(), transport_options={"master_name": "nosuch"}) as connection, \
            pytest.raises(SentinelConfigError, match=r"no sentinel monitors a master named 'nosuch' "
                                                     r"\(monitored: mymaster\)"):
        connection.connect()


def test_unreachable_sentinels_are_named_at_connect() -> None:
    ports = [free_port(), free_port()]
    url = ";".join(f"redislua+sentinel://127.0.0.1:{p}" for p in ports) + "/0"
    with Connection(url, transport_options=OPTIONS) as connection, \
            pytest.raises(redis.ConnectionError, match=rf"no sentinel answered for master 'mymaster': "
                                                       rf"127.0.0.1:{ports[0]} \(ConnectionError.*; "
                                                       rf"127.0.0.1:{ports[1]} \(ConnectionError"):
        connection.connect()


@pytest.mark.parametrize(("options", "message"), [
    ({}, r"'master_name' is required with sentinel:// URLs"),
    ({"master_name": MASTER, "min_other_sentinels": -1}, r"'min_other_sentinels' must be an integer >= 0"),
    ({"master_name": MASTER, "sentinel_kwargs": "password"}, r"'sentinel_kwargs' must be dict"),
])
def test_bad_sentinel_options_name_themselves(options: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError, match=message):
        Connection("redislua+sentinel://127.0.0.1:1/0", transport_options=options).transport  # noqa: B018


@pytest.mark.parametrize(("url", "message"), [
    ("redislua+sentinel://127.0.0.1:1/x", r"the database of a sentinel URL must be a number, got 'x'"),
    ("redislua+sentinel://127.0.0.1:1/1;redislua+sentinel://127.0.0.1:2/2",
     r"the sentinel URLs disagree on the database"),
])
def test_bad_sentinel_urls_name_the_problem(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Connection(url, transport_options=OPTIONS).transport  # noqa: B018


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from celery_redis_lua.tools.cli import main
    with pytest.raises(SystemExit) as done:
        main(list(args))
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_the_cli_follows_the_sentinels(group: SentinelGroup, capsys: pytest.CaptureFixture[str]) -> None:
    url = group.broker_url("sentinel")
    code, out, err = cli(capsys, "publish", "tasks.add", "--queue", "viacli", "--url", url,
                         "--master-name", MASTER)
    assert code == 0, err
    replica = next(s for s in group.servers if s.port != group.primary.port).client()
    # Replication is asynchronous: a failover right after the publish could lose it.
    wait_until(lambda: replica.keys("*{viacli}*"), what="the replica has the message")
    new = group.failover()
    # Every sentinel names the new primary (the old one's own settling, which Sentinel notices
    # by its 10 s INFO round, changes nothing a status read sees).
    wait_until(lambda: {group.primary_port(i) for i in range(len(group.sentinel_servers))} == {new.port},
               what="every sentinel names the new primary")
    code, out, err = cli(capsys, "status", "--queue", "viacli", "--url", url, "--master-name", MASTER)
    assert code == 0, err
    assert out.splitlines()[1].split() == ["viacli", "1", "0", "0", "0", "0", "no", "-"]
    code, out, err = cli(capsys, "status", "--url", url, "--master-name", "nosuch")
    assert code == 1
    assert "no sentinel monitors a master named 'nosuch' (monitored: mymaster)" in err
    code, out, err = cli(capsys, "status", "--url", url)
    assert code == 1
    assert err.strip() == ("celery-redis-lua: error: --master-name is required with a sentinel URL "
                           f"[asked the broker {url} (from --url)]")


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_a_wait_ended_by_a_role_change_is_a_lost_connection(kind: str) -> None:
    """A primary turned replica (REPLICAOF, as a manual switch or a cluster failover does it
    without Sentinel's CLIENT KILL) ends blocked commands with an UNBLOCKED error: kombu
    must see a lost connection to reconnect, not a channel error that stops the consumer."""
    require_kind(kind)
    with Server(kind) as primary, Server(kind) as other, \
            Connection(f"redislua://127.0.0.1:{primary.port}/0", transport_options={"blocking_timeout": 30}) \
            as connection, Consumer(connection, [Queue("blocked")], callbacks=[]):
        with contextlib.suppress(socket.timeout):
            connection.drain_events(timeout=0.5)  # the channel is now blocked in BLPOP
        primary.client().execute_command("REPLICAOF", "127.0.0.1", other.port)
        with pytest.raises(redis.ConnectionError, match="the server ended a blocking wait: UNBLOCKED"):
            connection.drain_events(timeout=10)
