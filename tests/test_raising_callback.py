"""A consumer callback that raises mid-batch (issue 38), through plain kombu on real servers.

A consume takes up to the prefetch window at once and hands kombu the messages one at a
time; the exception leaves that loop. The rest of the batch must not be held by nobody
(taken, extended by the keeper for as long as the channel lives, in no QoS): it is
delivered first by the next drain, in the order taken, and handed back at once, unstarted,
when the channel closes or stops consuming its queue before that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from kombu.message import Message

from celery_redis_lua.kombu.keeper import KEEPER
from celery_redis_lua.protocol.envelope import DeliveryTag
from helpers import wait_until
from kombu_support import Broker, drain

QUEUE = Queue("strand", Exchange("strand", "direct"), routing_key="strand")
PREFETCH = 10
DEADLINE_SECONDS = 8.0  # four visibility timeouts of 2 s: the reproduction waited as long


class Boom(Exception):
    """What the callback raises on the batch's first message."""


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop = Hub()
    yield loop
    loop.close()


def publish(conn: Connection) -> None:
    producer = Producer(conn, exchange=QUEUE.exchange, routing_key="strand")
    for i in range(PREFETCH):
        producer.publish({"i": i}, declare=[QUEUE])


def raising_on_the_first(got: list[Message], *, ack_first: bool = False) -> Callable[[Any, Message], None]:
    """A callback that records every message and raises on the first (acked first if told)."""
    def on_message(body: Any, message: Message) -> None:
        got.append(message)
        if len(got) == 1:
            if ack_first:
                message.ack()
            raise Boom(body)
    return on_message


def turn(conn: Connection, hub: Hub | None) -> None:
    """One step of the caller's loop: drain_events, or one iteration of the hub."""
    if hub is None:
        with contextlib.suppress(socket.timeout):
            conn.drain_events(timeout=0.5)
    else:
        hub.run_once()


def go_on_until(conn: Connection, hub: Hub | None, done: Callable[[], bool], what: str,
                explain: Callable[[], object] = lambda: "") -> int:
    """The caller's loop, catching what the callback raised; returns how many times it did."""
    raised = 0
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not done():
        assert time.monotonic() < deadline, f"{what} not within {DEADLINE_SECONDS} s {explain()}"
        try:
            turn(conn, hub)
        except Boom:
            raised += 1
    return raised


def stats(broker: Broker) -> tuple[int, int]:
    [s] = broker.lib.stats(["strand"])
    return s.ready, s.in_flight


def held_outside_qos(broker: Broker, channel: Any) -> set[str]:
    """Messages of the queue the keeper holds for ``channel`` that its QoS does not know."""
    in_qos = {DeliveryTag.parse(tag).id for tag in channel.qos._delivered}
    stored = {i.decode() for i in broker.client.hkeys(broker.keys.message("strand"))}
    return {i for i in stored if KEEPER.holds(channel.lib, "strand", i) and i not in in_qos}


@pytest.mark.parametrize("loop", ["drain_events", "hub"])
def test_the_rest_of_a_batch_whose_callback_raised_is_delivered_by_the_next_drain(
        kind_broker: Broker, hub: Hub, loop: str) -> None:
    got: list[Message] = []
    with kind_broker.connection(visibility_timeout=2) as conn:
        publish(conn)
        with Consumer(conn, [QUEUE], callbacks=[raising_on_the_first(got)], prefetch_count=PREFETCH):
            in_hub = hub if loop == "hub" else None
            if in_hub is not None:
                conn.transport.register_with_event_loop(conn.connection, hub)
            channel = conn.default_channel
            raised = go_on_until(
                conn, in_hub, lambda: len(got) == PREFETCH, what="the other nine delivered",
                explain=lambda: f"(delivered {len(got)}; ready, in flight: {stats(kind_broker)}; held by the "
                                f"keeper in no QoS: {len(held_outside_qos(kind_broker, channel))})")
            assert raised == 1
            assert [m.payload["i"] for m in got] == list(range(PREFETCH))  # in the order taken
            # From the one batch, not delivered again after their visibility timeout lapsed.
            assert [m.headers["x-delivery-count"] for m in got] == [0] * PREFETCH
            assert stats(kind_broker) == (0, PREFETCH)
            assert held_outside_qos(kind_broker, channel) == set()
            for message in got:
                message.ack()
            go_on_until(conn, in_hub, lambda: stats(kind_broker) == (0, 0), what="every ack landed")
            if in_hub is not None:
                conn.transport.poller.unregister()


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_the_rest_of_a_batch_whose_callback_raised_goes_back_at_once_when_its_consumer_goes(
        kind_broker: Broker, how: str) -> None:
    """The first message acked before the raise: QoS is empty, so kombu's close never asks
    for the unacked to be restored; the rest goes back anyway, as the channel closes or stops
    consuming the queue, counted as returned unstarted (visibility 300 s: nothing lapses)."""
    got: list[Message] = []
    with kind_broker.connection() as conn:
        publish(conn)
        consumer = Consumer(conn, [QUEUE], callbacks=[raising_on_the_first(got, ack_first=True)],
                            prefetch_count=PREFETCH)
        consumer.consume()
        channel = conn.default_channel  # alive to the end: what it holds is not dropped
        with pytest.raises(Boom):
            conn.drain_events(timeout=5)
        assert len(got) == 1
        if how == "cancel":
            consumer.cancel()
        else:
            conn.release()
        # At once: the first's ack went before, the other nine were handed back.
        wait_until(lambda: stats(kind_broker) == (PREFETCH - 1, 0), timeout=2,
                   what="the nine ready again, nothing in flight")
        assert not any(KEEPER.holds(channel.lib, "strand", i.decode())
                       for i in kind_broker.client.hkeys(kind_broker.keys.message("strand")))
    assert len(got) == 1  # never delivered to a consumer that left


def test_a_delivery_kombu_cannot_read_is_dead_lettered_and_the_batch_goes_on(
        kind_broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    """An envelope whose body kombu cannot decode (bad base64) fails in kombu's Message,
    before its QoS takes it: nobody would hold it. It is dead-lettered, logged, like a
    payload that is no envelope, and the rest of its batch is delivered."""
    got: list[Message] = []
    unreadable = {"body": "abc", "content-type": "application/json", "content-encoding": "utf-8",
                  "headers": {}, "properties": {"body_encoding": "base64", "delivery_info": {}}}
    with (kind_broker.connection() as conn, caplog.at_level(logging.ERROR, "celery_redis_lua"),
          Consumer(conn, [QUEUE], callbacks=[lambda _, m: got.append(m)], prefetch_count=PREFETCH)):
        kind_broker.lib.publish("strand", json.dumps(unreadable))
        publish(conn)
        drain(conn, got, PREFETCH, timeout=DEADLINE_SECONDS)
        assert [m.payload["i"] for m in got] == list(range(PREFETCH))
        [s] = kind_broker.lib.stats(["strand"])
        assert (s.ready, s.in_flight, s.dead) == (0, PREFETCH, 1)
        assert held_outside_qos(kind_broker, conn.default_channel) == set()
        assert "kombu could not read it (Error('Incorrect padding'))" in caplog.text
        for message in got:
            message.ack()
