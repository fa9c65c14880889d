"""Unconfirmed publishes (confirm_publish=False, protocol/unconfirmed.py), through plain kombu on
real servers: many publishes per write, in order, none left behind at close or after the
flush delay; NOSCRIPT recovered without a duplicate; a publish the server refuses (out of
memory, a key of the wrong type) raised at the first publish after its reply was read or at
close, never dropped silently; a cached route that went stale meanwhile never used; the
server storing one batch while the producer fills the next; a forked child never sending
its parent's publishes."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.unconfirmed import UnconfirmedPublishError
from conftest import require_kind
from helpers import ScriptCalls, wait_until
from scripts.servers import Server

EXCHANGE = Exchange("unconfirmed", "direct")
QUEUE = Queue("unconfirmed", EXCHANGE, routing_key="u")


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    require_kind(request.param)
    with Server(request.param) as srv:
        yield srv


def connection(server: Server, **options: Any) -> Connection:
    return Connection(f"redislua://127.0.0.1:{server.port}/0",
                      transport_options={"confirm_publish": False, **options})


def stored(server: Server, queue: str = QUEUE.name) -> list[Any]:
    """The queue's message bodies (raw, so base64 in the envelope), in delivery order (consumed
    with no_ack)."""
    lib = ScriptLibrary(server.client(), Keyspace())
    bodies = []
    while True:
        consumed = lib.consume([queue], 100, no_ack=True)
        if not consumed.deliveries:
            return bodies
        bodies += [base64.b64decode(json.loads(d.payload)["body"]).decode() for d in consumed.deliveries]


def ready(server: Server, queue: str = QUEUE.name) -> int:
    return ScriptLibrary(server.client(), Keyspace()).stats([queue])[0].ready


def cache_the_route(server: Server, conn: Connection, producer: Any) -> None:
    """Two publishes sent: the declare's bind recorded a change, and a table looked up in
    that same millisecond is not kept; once the server's clock moved on, the next is."""
    producer.publish("first", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
    conn.default_channel.settle_unconfirmed()
    recorded = server_ms(server)
    wait_until(lambda: server_ms(server) > recorded + 1, timeout=5, what="the server clock moved")
    producer.publish("second", exchange=EXCHANGE, routing_key="u")
    conn.default_channel.settle_unconfirmed()


def server_ms(server: Server) -> int:
    seconds, micros = server.client().time()
    return seconds * 1000 + micros // 1000


def test_publishes_go_many_per_write_in_order_and_all_by_close(server: Server) -> None:
    with connection(server, publish_pipeline=100, publish_flush_delay=1.0) as conn:
        producer = conn.Producer(serializer="raw")
        cache_the_route(server, conn, producer)
        counted = ScriptCalls(server.client())
        for i in range(250):
            producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="u")
        # Two full pipelines went (the second's replies not read yet); 50 wait for the delay.
        wait_until(lambda: ready(server) == 202, timeout=0.5, what="two pipelines stored")
        assert ready(server) == 202
        conn.release()  # the close sends the rest
    calls = counted.stop()
    assert calls.get("publish") == 250 and "lookup" not in calls, calls
    assert ready(server) == 252


def test_a_lone_publish_goes_within_the_flush_delay(server: Server) -> None:
    with connection(server, publish_flush_delay=0.05) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("declared", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
        producer.publish("alone", exchange=EXCHANGE, routing_key="u")
        wait_until(lambda: ready(server) == 2, timeout=5, what="the sender thread sent it")


def test_noscript_is_recovered_and_nothing_is_stored_twice(server: Server) -> None:
    with connection(server, publish_flush_delay=1.0) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("before", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
        for i in range(10):
            producer.publish(f"a{i}", exchange=EXCHANGE, routing_key="u")
        server.client().script_flush()  # the pending publishes meet NOSCRIPT when they go
        for i in range(10):
            producer.publish(f"b{i}", exchange=EXCHANGE, routing_key="u")
    assert stored(server) == ["before", *(f"a{i}" for i in range(10)), *(f"b{i}" for i in range(10))]


def test_a_refused_publish_is_raised_at_a_publish_once_its_reply_was_read(server: Server) -> None:
    keys = Keyspace()
    with connection(server, publish_pipeline=5) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("ok", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
        conn.default_channel.settle_unconfirmed()
        server.client().set(keys.wake(QUEUE.name), "not a list")  # someone else's bad write
        for i in range(5):  # the fifth sends the pipeline: all five are refused
            producer.publish(f"w{i}", exchange=EXCHANGE, routing_key="u")

        def next_publish_raises() -> UnconfirmedPublishError | None:
            try:
                producer.publish("next", exchange=EXCHANGE, routing_key="u")
            except UnconfirmedPublishError as error:
                return error
            return None

        # The replies are read by the sender within the flush delay, or when the next batch
        # (the fifth "next") goes: one of the publishes after that raises.
        error = wait_until(next_publish_raises, timeout=5, what="a publish raises the refusals")
        found = re.match(r"(\d+) unconfirmed publish\(es\) to 'unconfirmed'.*WRONGTYPE", str(error))
        assert found and int(found[1]) >= 5, error  # the five, and "next"s the sender sent since
        # Refused before anything was written: only the first message is stored.
        assert server.client().hkeys(keys.message(QUEUE.name)) == server.client().zrange(
            keys.queue(QUEUE.name), 0, -1) and server.client().hlen(keys.message(QUEUE.name)) == 1


def test_a_batch_is_stored_while_the_next_one_fills(server: Server) -> None:
    """The replies of a batch are read when the next one goes, not before the caller may go
    on: after a full pipeline, the publish call returns with that batch on the wire."""
    with connection(server, publish_pipeline=10, publish_flush_delay=1.0) as conn:
        producer = conn.Producer(serializer="raw")
        cache_the_route(server, conn, producer)
        counted = ScriptCalls(server.client())
        pipeline = conn.default_channel.unconfirmed
        for i in range(10):
            producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="u")
        assert pipeline.due() is not None  # replies unread, for the sender to collect
        wait_until(lambda: ready(server) == 12, timeout=5, what="the batch stored")
        for i in range(10, 25):
            producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="u")
        conn.release()
    assert counted.stop().get("publish") == 25
    assert stored(server) == ["first", "second", *(f"m{i}" for i in range(25))]


def test_a_forked_child_never_sends_its_parents_publishes(server: Server) -> None:
    with connection(server, publish_flush_delay=1.0) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("declared", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
        conn.default_channel.settle_unconfirmed()
        for i in range(3):
            producer.publish(f"p{i}", exchange=EXCHANGE, routing_key="u")  # pending: delay 1 s
        child = os.fork()
        if child == 0:  # the child closes its copy of the channel, which flushes
            code = 1
            try:
                conn.release()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    assert stored(server) == ["declared", "p0", "p1", "p2"]


def test_out_of_memory_is_raised_at_close(server: Server) -> None:
    client = server.client()
    with connection(server, publish_flush_delay=1.0) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("ok", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
        conn.default_channel.settle_unconfirmed()
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", max(1, int(client.info("memory")["used_memory"]) // 2))
        producer.publish("refused", exchange=EXCHANGE, routing_key="u")
        with pytest.raises(UnconfirmedPublishError, match=r"OutOfMemoryError: .*maxmemory"):
            conn.release()
    client.config_set("maxmemory", 0)
    assert stored(server) == ["ok"]


OTHER = Queue("unconfirmed-2", EXCHANGE, routing_key="u")


def test_a_route_that_went_stale_before_the_write_is_not_followed(server: Server) -> None:
    """The cached table routes to both queues; an unbind in another connection returns before
    the pipeline goes: the publish is refused as stale there and sent again along the fresh
    route, to the first queue only."""
    with connection(server, publish_flush_delay=1.0) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("both", exchange=EXCHANGE, routing_key="u", declare=[QUEUE, OTHER])
        conn.default_channel.settle_unconfirmed()
        producer.publish("both again", exchange=EXCHANGE, routing_key="u")
        conn.default_channel.settle_unconfirmed()  # the table is cached now
        with Connection(f"redislua://127.0.0.1:{server.port}/0") as other:
            OTHER(other.default_channel).unbind_from(exchange=EXCHANGE, routing_key="u")
        producer.publish("first only", exchange=EXCHANGE, routing_key="u")
    assert stored(server, QUEUE.name) == ["both", "both again", "first only"]
    assert stored(server, OTHER.name) == ["both", "both again"]


def test_the_options_are_checked() -> None:
    for options, problem in [({"confirm_publish": "no"}, "confirm_publish"),
                             ({"publish_pipeline": 0}, "publish_pipeline"),
                             ({"publish_flush_delay": 5}, "publish_flush_delay")]:
        with pytest.raises(ValueError, match=problem):
            Connection("redislua://127.0.0.1:1/0", transport_options=options).transport  # noqa: B018


def test_a_lost_connection_with_a_batch_on_the_wire_is_raised_never_silent(server: Server) -> None:
    with connection(server, publish_pipeline=5, publish_flush_delay=1.0) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("declared", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
        conn.default_channel.settle_unconfirmed()
        for i in range(5):  # written; replies unread
            producer.publish(f"a{i}", exchange=EXCHANGE, routing_key="u")
        writer = conn.default_channel.unconfirmed._writer  # its socket, to kill it
        host, port = writer._connection._sock.getsockname()[:2]
        wait_until(lambda: ready(server) == 6, timeout=5, what="the first batch stored")
        server.client().client_kill(f"{host}:{port}")
        # The fifth writes its batch (into a socket the server closed: it may fail there) and
        # reads the first batch's replies (already received before the kill).
        with contextlib.suppress(redis.ConnectionError):
            for i in range(5):
                producer.publish(f"b{i}", exchange=EXCHANGE, routing_key="u")
        # Reading the second batch's replies meets the lost connection (raised as it is), and
        # what was lost with it is named by the next settle (or the close).
        errors: list[Exception] = []
        for _ in range(2):
            try:
                conn.default_channel.settle_unconfirmed()
            except (redis.ConnectionError, UnconfirmedPublishError) as error:
                errors.append(error)
        refused = [e for e in errors if isinstance(e, UnconfirmedPublishError)]
        assert len(refused) == 1, errors
        assert re.match(r"(5|10) unconfirmed publish\(es\).*ConnectionError", str(refused[0])), refused
    # The first batch landed once; the second never reached the server.
    assert stored(server) == ["declared", *(f"a{i}" for i in range(5))]


def test_a_health_check_never_reads_a_reply_of_the_batch_on_the_wire(server: Server) -> None:
    """redis-py PINGs before a command once health_check_interval passed; with a batch's
    replies unread, that PING would read one of them as its PONG."""
    with connection(server, publish_pipeline=5, publish_flush_delay=1.0, health_check_interval=0.01) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("declared", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
        conn.default_channel.settle_unconfirmed()
        for batch in "abc":
            for i in range(5):  # the fifth writes its batch, the one before still unread
                producer.publish(f"{batch}{i}", exchange=EXCHANGE, routing_key="u")
            written = time.monotonic()
            wait_until(lambda written=written: time.monotonic() > written + 0.02,
                       what="the health check interval passed")
        conn.default_channel.settle_unconfirmed()
    assert stored(server) == ["declared", *(f"{b}{i}" for b in "abc" for i in range(5))]
