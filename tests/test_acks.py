"""Acks in batches (kombu/acks.py), through plain kombu on real servers: the acks of many
deliveries share one ack call per queue; a closing channel sends its acks before it goes;
a batch that meets a dead broker is sent again once it is back, and nothing it acked is
delivered again."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue
from kombu.message import Message

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.kombu.keeper import KEEPER
from conftest import require_kind
from helpers import ScriptCalls, wait_until
from scripts.servers import Server

EXCHANGE = Exchange("acked", "direct")
QUEUES = [Queue(name, EXCHANGE, routing_key=name) for name in ("acked-a", "acked-b")]


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    require_kind(request.param)
    gc.collect()  # connections earlier tests left close now, not while this one counts
    KEEPER.clear()
    with Server(request.param, args=["--appendonly", "yes", "--appendfsync", "always"]) as srv:
        yield srv
    KEEPER.clear()


def connect(server: Server, **options: Any) -> Connection:
    return Connection(f"redislua://127.0.0.1:{server.port}/0",
                      transport_options={"visibility_timeout": 2, "sweep_interval": 0.2,
                                         "socket_timeout": 2, "socket_connect_timeout": 1, **options})


def counts(server: Server) -> dict[str, tuple[int, int, int]]:
    lib = ScriptLibrary(server.client(), Keyspace())
    return {s.queue: (s.ready, s.in_flight, s.dead) for s in lib.stats([q.name for q in QUEUES])}


def publish(conn: Connection, per_queue: int) -> None:
    producer = conn.Producer()
    for i in range(per_queue):
        for queue in QUEUES:
            producer.publish(f"{queue.name}-{i}", exchange=EXCHANGE, routing_key=queue.name,
                             declare=QUEUES)


def take(conn: Connection, count: int) -> list[Message]:
    got: list[Message] = []
    with Consumer(conn, QUEUES, callbacks=[lambda body, message: got.append(message)]):
        while len(got) < count:
            conn.drain_events(timeout=10)
    return got


def test_the_acks_of_a_drain_share_one_call_per_queue(server: Server) -> None:
    with connect(server, ack_flush_delay=0.3) as conn:
        publish(conn, 100)
        messages = take(conn, 200)
        counted = ScriptCalls(server.client())
        for message in messages:
            message.ack()
        wait_until(lambda: counts(server) == {"acked-a": (0, 0, 0), "acked-b": (0, 0, 0)},
                   timeout=10, what="every ack sent")
        calls = counted.stop().get("ack", 0)
    # 200 acks gathered within 0.3 s: one call per queue (a batch split by the thread's
    # timing at most once more each), where a synchronous ack made 200.
    assert 2 <= calls <= 4, calls


def test_acks_from_many_threads_gather_while_a_batch_is_on_the_wire(server: Server) -> None:
    with connect(server) as conn:
        publish(conn, 250)
        messages = take(conn, 500)
        counted = ScriptCalls(server.client())
        threads = [threading.Thread(target=lambda part=messages[i::8]: [m.ack() for m in part])
                   for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        wait_until(lambda: counts(server) == {"acked-a": (0, 0, 0), "acked-b": (0, 0, 0)},
                   timeout=10, what="every ack sent")
        calls = counted.stop().get("ack", 0)
    assert calls < 250, f"{calls} ack calls for 500 acks: they did not gather"


def test_a_closing_channel_sends_its_acks_before_it_goes(server: Server) -> None:
    conn = connect(server, ack_flush_delay=1.0)  # the thread would wait a whole second
    publish(conn, 5)
    messages = take(conn, 10)
    for message in messages:
        message.ack()
    conn.close()
    assert counts(server) == {"acked-a": (0, 0, 0), "acked-b": (0, 0, 0)}
    assert len(messages[0].channel.outbox) == 0


def test_a_batch_that_meets_a_dead_broker_is_sent_again_and_nothing_runs_twice(server: Server) -> None:
    with connect(server, ack_flush_delay=0.5) as conn:
        publish(conn, 10)
        messages = take(conn, 20)
        for message in messages:
            message.ack()  # gathered: the batch leaves in 0.5 s, to a broker that is gone
        server.kill()
        assert all(m.acknowledged for m in messages)  # no error reaches the application
        wait_until(lambda: len(KEEPER) == 20, timeout=10, what="the failed batch kept its 20 acks")
        # The keeper retries failed acks once a second and would send the kept acks as
        # soon as the broker answers; holding its tick lock keeps them kept while we look.
        with KEEPER._ticking:
            server.start()  # same port, same AOF: the 20 are still in flight there
            assert counts(server) == {"acked-a": (0, 10, 0), "acked-b": (0, 10, 0)}
            assert len(KEEPER) == 20
        wait_until(lambda: (KEEPER.tick() or True) and len(KEEPER) == 0, timeout=10,
                   what="the kept acks sent")
        assert counts(server) == {"acked-a": (0, 0, 0), "acked-b": (0, 0, 0)}
    # Past the visibility timeout and several sweeps, nothing comes back.
    got: list[Message] = []
    with (connect(server) as fresh,
          Consumer(fresh, QUEUES, callbacks=[lambda body, message: got.append(message)]),
          pytest.raises(TimeoutError)):
        fresh.drain_events(timeout=3)
    assert got == []
    assert server.client().hlen("message:{acked-a}") == 0


def take_one_at_a_time(conn: Connection, queue: Queue, got: list[Message]) -> Consumer:
    """A consumer of ``queue`` with a prefetch window of one: each delivery after the first
    waits for the ack of the one before."""
    return Consumer(conn, [queue], prefetch_count=1, callbacks=[lambda body, message: got.append(message)])


def test_an_ack_rides_the_consumers_next_consume_and_the_thread_sends_nothing(server: Server) -> None:
    queue = QUEUES[0]
    with connect(server, ack_flush_delay=1.0) as conn:  # the thread would hold it a whole second
        publish(conn, 2)
        got: list[Message] = []
        with take_one_at_a_time(conn, queue, got):
            conn.drain_events(timeout=10)
            lib = got[0].channel.lib
            lib.runner.load(["ack"])  # not loaded yet on this server: a NOSCRIPT would count twice
            counted = ScriptCalls(server.client())
            got[0].ack()
            assert len(got[0].channel.outbox) == 1
            conn.drain_events(timeout=10)  # the window has room again: consume, with the ack
            assert len(got) == 2
            assert len(got[0].channel.outbox) == 0  # gone with the consume, long before the thread's 1 s
            assert counts(server)["acked-a"] == (0, 1, 0)  # the first acked, the second in flight
            calls = counted.stop()
            got[1].ack()
    assert calls.get("ack") == 1 and calls.get("consume") == 1, calls


def test_acks_riding_a_consume_that_meets_a_lost_connection_are_sent_again(server: Server) -> None:
    queue = QUEUES[0]
    with connect(server, ack_flush_delay=1.0) as conn:
        publish(conn, 2)
        got: list[Message] = []
        with take_one_at_a_time(conn, queue, got):
            conn.drain_events(timeout=10)
            held = got[0].channel.lib.runner.held
            admin = server.client()
            (port,) = {held._connection._sock.getsockname()[1]}
            admin.client_kill(f"127.0.0.1:{port}")  # the connection the consume (and acks) go on
            got[0].ack()
            with pytest.raises(redis.ConnectionError):
                conn.drain_events(timeout=10)
            assert len(got[0].channel.outbox) == 1  # kept, not lost
            wait_until(lambda: (KEEPER.tick() or True) and len(KEEPER) == 0, timeout=10,
                       what="the kept ack sent")
    assert sum(counts(server)["acked-a"]) == 1  # only the second is left
    got_again: list[Message] = []
    with (connect(server) as fresh,
          Consumer(fresh, [queue], callbacks=[lambda body, message: got_again.append(message)])):
        fresh.drain_events(timeout=10)  # the second: never delivered, the consume was lost
        with pytest.raises(TimeoutError):  # past the visibility timeout: the acked one stays gone
            fresh.drain_events(timeout=3)
    assert [m.body for m in got_again] == [b"acked-a-1"]


def test_acks_stay_with_the_thread_when_a_durability_wait_would_stall_the_consumer(server: Server) -> None:
    queue = QUEUES[0]
    with connect(server) as plain:
        publish(plain, 2)
    # replicas:1 on a server without replicas: every wait runs out its timeout (the ack is
    # applied, only not confirmed), which a consume carrying the ack would sit out too.
    with connect(server, ack_flush_delay=0.5, durability="replicas:1", durability_timeout=0.05) as conn:
        got: list[Message] = []
        with take_one_at_a_time(conn, queue, got):
            conn.drain_events(timeout=10)
            got[0].ack()
            conn.drain_events(timeout=10)
            assert len(got[0].channel.outbox) == 1  # the consume went alone
            wait_until(lambda: counts(server)["acked-a"] == (0, 1, 0), timeout=10,
                       what="the thread sent the ack")
            got[1].ack()
