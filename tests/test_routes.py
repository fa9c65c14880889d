"""Cached routes (kombu/routes.py), through plain kombu on real servers: a publish to a named
exchange is one round trip; a bind, an unbind or a queue delete in another process is never
followed by a publish along the old route once it returns; kombu's queue_unbind reaches the
broker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from kombu import Connection, Exchange, Queue

from celery_redis_lua import Keyspace, ScriptLibrary
from conftest import require_kind
from helpers import ScriptCalls, wait_until
from scripts.servers import Server

EXCHANGE = Exchange("routed", "direct")
FIRST = Queue("routed-1", EXCHANGE, routing_key="rk")
SECOND = Queue("routed-2", EXCHANGE, routing_key="rk")  # the same key: both receive

# What another process does to the bindings, with kombu, before it prints "done".
OTHER_PROCESS = """
import sys
from kombu import Connection, Exchange, Queue
action, url = sys.argv[1], sys.argv[2]
queue = Queue("routed-2", Exchange("routed", "direct"), routing_key="rk")
with Connection(url) as conn:
    bound = queue(conn.default_channel)
    if action == "bind":
        bound.declare()
    elif action == "unbind":
        bound.unbind_from(exchange=queue.exchange, routing_key="rk")
    elif action == "delete":  # as a consumer that declared it would: its bindings go too
        bound.declare()
        bound.delete()
print("done", flush=True)
"""


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    require_kind(request.param)
    with Server(request.param) as srv:
        yield srv


def server_ms(server: Server) -> int:
    seconds, micros = server.client().time()
    return seconds * 1000 + micros // 1000


def url(server: Server) -> str:
    return f"redislua://127.0.0.1:{server.port}/0"


def in_another_process(server: Server, action: str) -> None:
    done = subprocess.run([sys.executable, "-c", OTHER_PROCESS, action, url(server)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr


def ready(server: Server) -> dict[str, int]:
    lib = ScriptLibrary(server.client(), Keyspace())
    return {s.queue: s.ready for s in lib.stats([FIRST.name, SECOND.name])}


def bindings(server: Server) -> list[str]:
    return sorted(b.queue for b in ScriptLibrary(server.client(), Keyspace()).lookup(EXCHANGE.name))


def test_a_publish_to_a_named_exchange_is_one_round_trip(server: Server) -> None:
    with Connection(url(server)) as conn:
        producer = conn.Producer()
        producer.publish("first", exchange=EXCHANGE, routing_key="rk", declare=[FIRST])
        # The declare's bind recorded a change; a table looked up in that same millisecond
        # is not kept. Once the server's clock has moved on, one more publish caches it.
        recorded = server_ms(server)
        wait_until(lambda: server_ms(server) > recorded + 1, timeout=5, what="the server clock moved")
        producer.publish("second", exchange=EXCHANGE, routing_key="rk")
        counted = ScriptCalls(server.client())
        for i in range(50):
            producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="rk")
        calls = counted.stop()
    assert calls.get("publish") == 50 and "lookup" not in calls, calls
    assert ready(server)[FIRST.name] == 52


def test_an_unbind_elsewhere_is_never_followed_by_the_old_route(server: Server) -> None:
    with Connection(url(server)) as conn:
        producer = conn.Producer()
        producer.publish("both", exchange=EXCHANGE, routing_key="rk", declare=[FIRST, SECOND])
        assert ready(server) == {FIRST.name: 1, SECOND.name: 1}
        for round_ in range(3):
            in_another_process(server, "unbind")  # the cached table still routes to both
            assert bindings(server) == [FIRST.name]
            producer.publish(f"first only {round_}", exchange=EXCHANGE, routing_key="rk")
            assert ready(server) == {FIRST.name: 2 + 2 * round_, SECOND.name: 1 + round_}, round_
            in_another_process(server, "bind")  # the cached table routes to the first only
            producer.publish(f"both again {round_}", exchange=EXCHANGE, routing_key="rk")
            assert ready(server) == {FIRST.name: 3 + 2 * round_, SECOND.name: 2 + round_}, round_


def test_a_queue_deleted_elsewhere_is_not_published_back_into_being(server: Server) -> None:
    with Connection(url(server)) as conn:
        producer = conn.Producer()
        producer.publish("both", exchange=EXCHANGE, routing_key="rk", declare=[FIRST, SECOND])
        in_another_process(server, "delete")
        producer.publish("after the delete", exchange=EXCHANGE, routing_key="rk")
    assert ready(server) == {FIRST.name: 2, SECOND.name: 0}
    assert not ScriptLibrary(server.client(), Keyspace()).exists(SECOND.name)


def test_queue_unbind_removes_the_binding_from_the_broker(server: Server) -> None:
    with Connection(url(server)) as conn:
        FIRST(conn.default_channel).declare()
        SECOND(conn.default_channel).declare()
        assert bindings(server) == [FIRST.name, SECOND.name]
        SECOND(conn.default_channel).unbind_from(exchange=EXCHANGE, routing_key="rk")
        assert bindings(server) == [FIRST.name]
        conn.Producer().publish("one", exchange=EXCHANGE, routing_key="rk")
    assert ready(server) == {FIRST.name: 1, SECOND.name: 0}


def test_lookup_says_how_long_its_table_holds(server: Server) -> None:
    lib = ScriptLibrary(server.client(), Keyspace())
    lib.bind("lived", ["rk\x06\x16\x06\x16a"], lifetime_ms=60_000)
    lib.bind("lived", ["rk\x06\x16\x06\x16b"])
    routes = lib.lookup("lived")
    assert [b.queue for b in routes] == ["a", "b"]
    assert 59_000 <= routes.stale_in_ms <= 60_000
    assert abs(routes.looked_up_ms - int(server.client().time()[0]) * 1000) < 5_000
    assert lib.lookup("forever-less").stale_in_ms is None
