"""Unconfirmed publishes (confirm_publish=False, kombu/unconfirmed.py), through plain kombu on
real servers: many publishes per write, in order, none left behind at close or after the
flush delay; NOSCRIPT recovered without a duplicate; a publish the server refuses (out of
memory, a key of the wrong type) raised at the next publish or at close, never dropped
silently; a cached route that went stale meanwhile never used."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.kombu.unconfirmed import UnconfirmedPublishError
from conftest import require_kind
from helpers import ScriptCalls, wait_until
from tools.servers import Server

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
        assert ready(server) == 202  # two full pipelines went; 50 wait for the flush delay
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


def test_a_refused_publish_is_raised_at_the_next_publish(server: Server) -> None:
    keys = Keyspace()
    with connection(server, publish_pipeline=5) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("ok", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
        conn.default_channel.settle_unconfirmed()
        server.client().set(keys.index(QUEUE.name), "not a sorted set")  # someone else's bad write
        for i in range(5):  # the fifth sends the pipeline: all five are refused
            producer.publish(f"w{i}", exchange=EXCHANGE, routing_key="u")
        with pytest.raises(UnconfirmedPublishError, match=r"5 unconfirmed publish\(es\) to 'unconfirmed'.*"
                                                          r"WRONGTYPE"):
            producer.publish("next", exchange=EXCHANGE, routing_key="u")


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
