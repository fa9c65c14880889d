"""Refilling the prefetch window (channel.py ``_gathering``): a slot freed while most of the
window is still held waits a moment for others, so that one consume call refills many (the
prefork pool frees its slots one task at a time), but never longer than
REFILL_GATHER_SECONDS, in plain kombu's drain_events and in Celery's event loop alike."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from kombu.message import Message

from celery_redis_lua.kombu.consuming import REFILL_GATHER_SECONDS
from helpers import hub_readable, hub_wake_fd, wait_until
from scripts.servers import Server

QUEUE = Queue("refill", Exchange("refill", "direct"), routing_key="refill")


@pytest.fixture
def got() -> list[Message]:
    """What a test's consumer was given."""
    return []


@pytest.fixture
def conn(valkey_server: Server, got: list[Message]) -> Iterator[Connection]:
    with Connection(f"redislua://127.0.0.1:{valkey_server.port}/0") as connection:
        producer = Producer(connection, exchange=QUEUE.exchange, routing_key="refill")
        for i in range(30):
            producer.publish(i, declare=[QUEUE])
        yield connection
        for message in got:  # settled before the close, or they stay held by their Messages after it
            if not message.acknowledged:
                message.ack()


def take(conn: Connection, got: list[Message], n: int) -> None:
    deadline = time.monotonic() + 10
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} delivered"
        with contextlib.suppress(socket.timeout):
            conn.drain_events(timeout=1)


def test_a_freed_slot_waits_for_company_and_one_call_refills_them_all(
        conn: Connection, got: list[Message]) -> None:
    with Consumer(conn, [QUEUE], callbacks=[lambda _, m: got.append(m)], prefetch_count=8):
        take(conn, got, 8)
        channel = conn.default_channel
        got[0].ack()
        # 7 of 8 still held: held back, and the loop is told when to come back.
        assert channel.poll_queues() == 0
        due = channel.refill_due()
        assert due is not None and due <= time.monotonic() + REFILL_GATHER_SECONDS
        for message in got[1:4]:
            message.ack()
        # Half the window free: the four go in one call, at once.
        assert channel.poll_queues() == 4
        assert channel.refill_due() is None
        assert [m.payload for m in got] == list(range(12))


def test_a_held_back_refill_goes_once_its_time_is_up(conn: Connection, got: list[Message]) -> None:
    with Consumer(conn, [QUEUE], callbacks=[lambda _, m: got.append(m)], prefetch_count=8):
        take(conn, got, 8)
        channel = conn.default_channel
        got[0].ack()
        held_at = time.monotonic()
        assert channel.poll_queues() == 0
        wait_until(lambda: channel.poll_queues() == 1, timeout=5, interval=0.0005,
                   what="the held-back refill")
        assert time.monotonic() - held_at >= REFILL_GATHER_SECONDS
        assert channel.refill_due() is None
        assert len(got) == 9


def test_drain_events_comes_back_for_a_held_back_refill(conn: Connection, got: list[Message]) -> None:
    """Nothing else wakes it (the window was full, so no blocking wait is pending): the
    refill must still come within drain_events's own time."""
    with Consumer(conn, [QUEUE], callbacks=[lambda _, m: got.append(m)], prefetch_count=8):
        take(conn, got, 8)
        got[0].ack()
        conn.drain_events(timeout=5)
        assert len(got) == 9


@pytest.mark.parametrize("window", [1, 2])
def test_a_window_of_one_or_two_is_refilled_at_once(
        conn: Connection, got: list[Message], window: int) -> None:
    with Consumer(conn, [QUEUE], callbacks=[lambda _, m: got.append(m)], prefetch_count=window):
        take(conn, got, window)
        got[0].ack()
        assert conn.default_channel.poll_queues() == 1
        assert conn.default_channel.refill_due() is None


def test_the_event_loop_sets_a_timer_for_a_held_back_refill(conn: Connection, got: list[Message]) -> None:
    """In Celery's hub the poll sleeps until the next timer or event; a held-back refill must
    be one of those timers, or an idle pool child waits for the next 1 s tick."""
    hub = Hub()
    try:
        with Consumer(conn, [QUEUE], callbacks=[lambda _, m: got.append(m)], prefetch_count=8):
            take(conn, got, 8)
            conn.transport.register_with_event_loop(conn.connection, hub)
            got[0].ack()
            for tick in list(hub.on_tick):
                tick()
            due = conn.default_channel.refill_due()
            assert due is not None

            def timers_at_due() -> int:
                return sum(abs(entry.eta - due) < 0.001 for entry in hub.timer.queue)

            assert timers_at_due() == 1
            # The hub reckoned this poll's timeout before the tick set the timer: the poll
            # must return now, for the next one to count it.
            assert hub_wake_fd(hub) in hub_readable(hub)
            for tick in list(hub.on_tick):  # the same due time: no second timer
                tick()
            assert timers_at_due() == 1
            conn.transport.poller.unregister()
    finally:
        hub.close()


def test_a_full_take_consumes_again_without_a_wait_in_between(valkey_server: Server) -> None:
    """A consume that took all the room it asked for leaves the wake token behind (more is
    ready): the next round consumes at once instead of first popping that token with a
    BLPOP on the wait's connection (one more round trip per batch: 7 % of kombu consume+ack)."""
    queue = Queue("fulltake", Exchange("fulltake", "direct"), routing_key="fulltake")
    client = valkey_server.client()
    with Connection(f"redislua://127.0.0.1:{valkey_server.port}/0") as connection:
        producer = Producer(connection, exchange=queue.exchange, routing_key="fulltake")
        for i in range(1000):
            producer.publish(i, declare=[queue])
        blpops = int(client.info("commandstats").get("cmdstat_blpop", {}).get("calls", 0))
        acked: list[int] = []
        with Consumer(connection, [queue], prefetch_count=100,
                      callbacks=[lambda body, message: (message.ack(), acked.append(body))]):
            while len(acked) < 1000:
                connection.drain_events(timeout=5)
        after = int(client.info("commandstats").get("cmdstat_blpop", {}).get("calls", 0))
    assert sorted(acked) == list(range(1000))
    assert after - blpops <= 2  # the wait after the last batch; one per batch of 100 was 10
