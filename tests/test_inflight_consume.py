"""Consumes in flight (channel.py): in Celery's event loop a refill's consume, with the acks
gathered meanwhile in front of it, goes out on the queue wait's connection without waiting
for its reply, and the hub delivers when the socket is readable. What must hold: the acks
it carries land, a lost reply loses no ack and no message, a channel that closes (or stops
consuming) with one in flight gives its messages back at once, and a script cache flushed
under it is reloaded. Real servers and kombu's real Hub, turned one iteration at a time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from kombu.message import Message

from kombu_support import Broker

QUEUE = Queue("flight", Exchange("flight", "direct"), routing_key="flight")


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop = Hub()
    yield loop
    loop.close()


def publish(conn: Connection, count: int) -> None:
    producer = Producer(conn, exchange=QUEUE.exchange, routing_key="flight")
    for i in range(count):
        producer.publish({"i": i}, declare=[QUEUE])


def turn_until(hub: Hub, predicate: Callable[[], Any], timeout: float = 10.0, what: str = "it") -> None:
    """Run the hub's loop one iteration at a time until ``predicate()`` holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        hub.run_once()


def tick(hub: Hub) -> None:
    """What the hub runs before it polls: the transport's round (its consume is sent here)."""
    for callback in list(hub.on_tick):
        callback()


def ids_in(broker: Broker, key: str) -> set[bytes]:
    return set(broker.client.hkeys(key))


def consuming(broker: Broker, hub: Hub, conn: Connection, got: list[Message], prefetch: int) -> Consumer:
    consumer = Consumer(conn, [QUEUE], callbacks=[lambda _, m: got.append(m)], prefetch_count=prefetch)
    consumer.consume()
    conn.transport.register_with_event_loop(conn.connection, hub)
    return consumer


def two_taken_and_acked(broker: Broker, hub: Hub, conn: Connection, got: list[Message]) -> Consumer:
    """Four messages queued, a consumer with a window of two in the hub, the first two
    delivered and acked (gathered: the next refill carries them)."""
    publish(conn, 4)
    consumer = consuming(broker, hub, conn, got, prefetch=2)
    turn_until(hub, lambda: len(got) == 2, what="the first two deliveries")
    for message in got:
        message.ack()
    return consumer


def test_a_refill_goes_out_without_waiting_and_carries_the_gathered_acks(
        kind_broker: Broker, hub: Hub) -> None:
    got: list[Message] = []
    with kind_broker.connection(ack_flush_delay=1) as conn:  # the ack thread stays out of it
        two_taken_and_acked(kind_broker, hub, conn, got)
        channel = conn.default_channel
        first = {m.properties["delivery_tag"] for m in got}
        assert len(channel.outbox) == 2
        tick(hub)  # the refill is written; its reply is not read here
        wait = channel.queue_wait
        assert wait.batch is not None and wait.batch.acks is not None
        assert len(got) == 2 and len(channel.outbox) == 0  # the acks left with it
        turn_until(hub, lambda: len(got) == 4, what="the refill's deliveries")
        assert wait.batch is None
        assert len(ids_in(kind_broker, kind_broker.keys.message("flight"))) == 2  # the two acked are gone
        assert not first & {m.properties["delivery_tag"] for m in got[2:]}
        for message in got[2:]:
            message.ack()
        conn.transport.poller.unregister()


def test_an_in_flight_consume_whose_reply_is_lost_loses_no_ack_and_no_message(
        kind_broker: Broker, hub: Hub) -> None:
    """The wait's connection goes (here: its reply overdue, so the loop drops it) before the
    reply is read. Whether or not the server ran the batch, the acks it carried are sent
    again through the keeper, and what it consumed comes back after the
    visibility timeout, counted, and is delivered again."""
    got: list[Message] = []
    with kind_broker.connection(ack_flush_delay=1, visibility_timeout=1, sweep_interval=0.2) as conn:
        two_taken_and_acked(kind_broker, hub, conn, got)
        channel = conn.default_channel
        acked = {m.payload["i"] for m in got}
        tick(hub)
        wait = channel.queue_wait
        assert wait.batch is not None
        assert len(channel.outbox) == 0
        wait.sent_at -= 3600  # overdue: the next round drops the connection unread
        tick(hub)
        assert wait.batch is None and len(got) == 2
        assert len(channel.outbox) == 2  # the two acks, to be sent again
        turn_until(hub, lambda: len(channel.outbox) == 0, what="the acks sent again")
        turn_until(hub, lambda: {m.payload["i"] for m in got[2:]} == {0, 1, 2, 3} - acked, timeout=15,
                   what="the lost consume's messages delivered again")
        assert not acked & {m.payload["i"] for m in got[2:]}
        for message in got[2:]:
            message.ack()
        turn_until(hub, lambda: not ids_in(kind_broker, kind_broker.keys.message("flight")), timeout=15,
                   what="every message acked")
        conn.transport.poller.unregister()


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_a_consume_in_flight_when_its_consumer_goes_gives_its_messages_back_at_once(
        kind_broker: Broker, hub: Hub, how: str) -> None:
    got: list[Message] = []
    with kind_broker.connection(ack_flush_delay=1) as conn:  # visibility 300 s: nothing lapses
        consumer = two_taken_and_acked(kind_broker, hub, conn, got)
        tick(hub)
        assert conn.default_channel.queue_wait.batch is not None
        if how == "cancel":
            consumer.cancel()
            assert len(got) == 2  # not delivered to a consumer that left
            stats = kind_broker.lib.stats(["flight"])[0]
            assert (stats.ready, stats.in_flight) == (2, 0)
        conn.transport.poller.unregister()
    stats = kind_broker.lib.stats(["flight"])[0]
    assert (stats.ready, stats.in_flight) == (2, 0)  # ready now, not after the visibility timeout
    assert len(ids_in(kind_broker, kind_broker.keys.message("flight"))) == 2  # the acks landed


def test_an_in_flight_consume_meets_a_flushed_script_cache_and_delivers(
        kind_broker: Broker, hub: Hub) -> None:
    got: list[Message] = []
    with kind_broker.connection(ack_flush_delay=1) as conn:
        two_taken_and_acked(kind_broker, hub, conn, got)
        kind_broker.client.script_flush()
        turn_until(hub, lambda: len(got) == 4, what="the refill's deliveries after SCRIPT FLUSH")
        assert len(ids_in(kind_broker, kind_broker.keys.message("flight"))) == 2
        for message in got[2:]:
            message.ack()
        conn.transport.poller.unregister()
