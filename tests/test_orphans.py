"""Deliveries that outlive their channel (the keeper's orphans), through plain kombu on real servers.

A connection closes while the application still holds a delivered Message (Celery keeps
running a task across a reconnect): the message stays in flight, its deadline keeps being
pushed forward, and its late ack lands. A Message dropped unacked is handed back, counted.
An ack that meets a dead broker is sent again once the broker is back.
"""

from __future__ import annotations

import contextlib
import gc
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Queue
from kombu.message import Message

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.kombu.keeper import KEEPER
from conftest import require_kind
from helpers import wait_until
from scripts.servers import Server

VISIBILITY = 1.0
QUEUE = Queue("work", Exchange("work", "direct"), routing_key="work")


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    require_kind(request.param)
    # Connections earlier tests of the session left to the garbage collector close (and have
    # their deliveries adopted) now, not in the middle of a test that counts the registry.
    gc.collect()
    KEEPER.clear()
    with Server(request.param, args=["--appendonly", "yes", "--appendfsync", "always"]) as srv:
        yield srv
    # The registry is per process: what a failed test left (its server is gone) must not
    # be retried by the next tests.
    KEEPER.clear()


def connect(server: Server) -> Connection:
    return Connection(f"redislua://127.0.0.1:{server.port}/0",
                      transport_options={"visibility_timeout": VISIBILITY, "sweep_interval": 0.2,
                                         "socket_timeout": 2, "socket_connect_timeout": 1})


def stats(server: Server) -> tuple[int, int, int]:
    [s] = ScriptLibrary(server.client(), Keyspace()).stats(["work"])
    return s.ready, s.in_flight, s.dead


def publish_and_take_one(conn: Connection, body: str) -> Message:
    conn.Producer().publish(body, exchange=QUEUE.exchange, routing_key="work", declare=[QUEUE])
    got: list[Message] = []
    with Consumer(conn, [QUEUE], callbacks=[lambda _, message: got.append(message)]):
        deadline = time.monotonic() + 10
        while not got:
            assert time.monotonic() < deadline, "no delivery"
            with contextlib.suppress(socket.timeout):
                conn.drain_events(timeout=1)
    return got[0]


def tend_for(conn: Connection, seconds: float, observe: Any) -> None:
    """Run another connection's event loop (it tends the orphans) and sample the broker."""
    deadline = time.monotonic() + seconds
    with Consumer(conn, [Queue("elsewhere")], callbacks=[]):
        while time.monotonic() < deadline:
            with contextlib.suppress(socket.timeout):
                conn.drain_events(timeout=0.2)
            observe()


def test_a_message_held_across_a_closed_connection_stays_in_flight_and_its_late_ack_lands(
        server: Server) -> None:
    with connect(server) as first:
        message = publish_and_take_one(first, "held")
    # The connection closed; the application still holds the message (a task still running).
    assert stats(server) == (0, 1, 0)
    observed: set[tuple[int, int, int]] = set()
    with connect(server) as second:
        # Three visibility timeouts: without the orphans' heartbeat the sweep restores it.
        tend_for(second, 3 * VISIBILITY, lambda: observed.add(stats(server)))
        assert observed == {(0, 1, 0)}
        message.ack()
        # Acks leave from the batching thread (acks.py), not from this call: poll.
        wait_until(lambda: stats(server) == (0, 0, 0), timeout=10, what="the late ack landed")
        assert server.client().keys("message:*") == []
    assert len(KEEPER) == 0


def test_a_message_dropped_unacked_after_close_is_handed_back_counted(server: Server) -> None:
    with connect(server) as first:
        message = publish_and_take_one(first, "dropped")
        holder = [message]
        holder.append(holder)  # a reference cycle: only the cycle collector frees it
        del message
    assert stats(server) == (0, 1, 0), "still held at close: adopted, not handed back"
    del holder
    with connect(server) as second:
        wait_until(lambda: (gc.collect() or True) and (KEEPER.tick() or True)
                   and stats(server) == (1, 0, 0), timeout=10)
        again = publish_and_take_one(second, "another")  # takes the handed-back one first
        assert again.payload == "dropped"
        assert again.headers["x-delivery-count"] == 1
        assert again.delivery_info["redelivered"] is True
        again.ack()
    assert len(KEEPER) == 0


def test_an_adopted_message_acked_then_dropped_before_its_ack_is_sent_is_not_handed_back(
        server: Server) -> None:
    """Found by CI (tests/celery_e2e/test_connection_loss.py, both pools): Celery acks a task
    that finished after a reconnect through its old Message and then drops the Message at
    once. The ack waits in the batch (acks.py) for up to ack_flush_delay; a tick of the
    orphans registry (now the keeper) in that window saw the Message gone, took it for dropped unacked,
    and handed it back, so the finished task ran again."""
    url = f"redislua://127.0.0.1:{server.port}/0"
    options = {"visibility_timeout": VISIBILITY, "sweep_interval": 0.2, "ack_flush_delay": 0.5}
    with Connection(url, transport_options=options) as first:
        message = publish_and_take_one(first, "finished")
    assert stats(server) == (0, 1, 0), "held at close: adopted"
    message.ack()  # gathered: the batch is sent up to 0.5 s from now
    del message
    gc.collect()
    KEEPER.tick()  # the keeper's tick, in the window before the batch is sent
    assert stats(server) == (0, 1, 0), "acked by the application: never handed back"
    wait_until(lambda: stats(server) == (0, 0, 0), timeout=10, what="the ack landed")
    assert len(KEEPER) == 0


def test_an_ack_that_meets_a_dead_broker_is_sent_once_it_is_back(server: Server) -> None:
    with connect(server) as conn:
        message = publish_and_take_one(conn, "finished-while-down")
        server.kill()
        message.ack()  # the task is done: no error to Celery, the ack is kept
        assert message.acknowledged
        wait_until(lambda: len(KEEPER) == 1, timeout=10, what="the failed batch kept its ack")
        KEEPER.tick()  # broker still down: kept for the next tick
        assert len(KEEPER) == 1
        server.start()  # same port, same AOF: the message was still in flight there
        # ... unless the keeper's thread already sent the kept ack (it ticks every second).
        assert stats(server) in {(0, 1, 0), (0, 0, 0)}
        wait_until(lambda: (KEEPER.tick() or True) and stats(server) == (0, 0, 0), timeout=10)
    assert len(KEEPER) == 0
    assert server.client().keys("message:*") == []


def restore_as_the_sweep_would(server: Server, message: Message) -> None:
    """What the sweep does to a delivery whose deadline lapsed: back to ready, counted."""
    lib = ScriptLibrary(server.client(), Keyspace())
    message_id = message.delivery_tag.split("@")[0]
    assert lib.reject("work", [message_id], requeue=True).requeued == 1


@pytest.mark.parametrize("how", ["reject", "reject after close", "dropped after close"])
def test_a_stale_hand_back_leaves_the_new_holders_delivery_alone(server: Server, how: str) -> None:
    """Worker A's deadline lapsed (its loop stalled), the message went to worker B; A's late
    reject or hand-back must not requeue it under B (the chaos run saw it run three times)."""
    with connect(server) as a, connect(server) as b:
        held_by_a = publish_and_take_one(a, "contested")
        restore_as_the_sweep_would(server, held_by_a)
        held_by_b = publish_and_take_one(b, "other")
        assert (held_by_a.headers["x-delivery-count"], held_by_b.headers["x-delivery-count"]) == (0, 1)
        assert held_by_b.payload == "contested"
        if how == "reject":
            held_by_a.reject(requeue=True)
        elif how == "reject after close":  # Celery rejecting a failed task after a reconnect
            a.close()
            held_by_a.reject(requeue=True)
            assert not KEEPER.holds(held_by_a.channel.lib, "work", held_by_a.delivery_tag.split("@")[0])
        else:
            a.close()
            del held_by_a
            gc.collect()
            # The keeper's thread may be ticking (a tick then returns at once): poll.
            wait_until(lambda: (KEEPER.tick() or True) and len(KEEPER) == 2, timeout=10,
                       what="the hand-back was sent (and found the delivery stale); B holds two")
        # B took both ('other' too, no prefetch limit): nothing went back to ready.
        assert stats(server) == (0, 2, 0)
        message_id = held_by_b.delivery_tag.split("@")[0]
        assert server.client().hget("state:{work}", message_id).split()[:2] == [b"unacked", b"1"]
        held_by_b.ack()
        wait_until(lambda: stats(server) == (0, 1, 0), timeout=10, what="B's ack sent")


def test_basic_recover_hands_back_what_the_caller_still_holds(server: Server) -> None:
    """basic_recover(requeue=True) means "redeliver now", not "adopt" (that is for close)."""
    with connect(server) as conn:
        message = publish_and_take_one(conn, "recover me")
        assert stats(server) == (0, 1, 0)
        message.channel.basic_recover(requeue=True)
        assert stats(server) == (1, 0, 0)
        again = publish_and_take_one(conn, "second")
        assert (again.payload, again.headers["x-delivery-count"]) == ("recover me", 1)
        again.ack()
    assert len(KEEPER) == 0
