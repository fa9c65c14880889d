"""x-consumer-timeout (issue 39 §4): a delivery is kept alive (its deadline extended by the
keeper) at most that long, RabbitMQ's consumer timeout. A hung task's message then lapses at
exactly that time, the sweep takes it back, counted as a delivery, and the worker logs the
queue and the message id; the holder stays connected and alive all along."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kombu import Consumer, Exchange, Queue
from kombu.message import Message

from helpers import server_now_ms, wait_until
from kombu_support import Broker, drain

TIMEOUT_MS = 1500
OPTIONS = {"visibility_timeout": 3, "sweep_interval": 0.3}  # keeper ticks every second


def hung_queue(name: str, **arguments: Any) -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name, queue_arguments=arguments)


def test_a_delivery_is_kept_alive_up_to_the_consumer_timeout_then_goes_back(
        kind_broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="celery_redis_lua")
    queue = hung_queue("hung", **{"x-consumer-timeout": TIMEOUT_MS})
    lib, client = kind_broker.lib, kind_broker.client
    with kind_broker.connection(**OPTIONS) as holder, kind_broker.connection(**OPTIONS) as other:
        holder.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="hung", declare=[queue])
        held: list[Message] = []
        with Consumer(holder, [queue], callbacks=[lambda body, message: held.append(message)]):
            t0 = server_now_ms(client)
            drain(holder, held, 1)
            t1 = server_now_ms(client)
            # The keeper cuts the visibility deadline consume gave it (3 s) to the timeout.
            index = kind_broker.keys.index("hung")
            wait_until(lambda: [s for _, s in client.zrange(index, 0, -1, withscores=True)
                                if s <= t1 + TIMEOUT_MS], timeout=5, what="the deadline cut to the timeout")
            ((member, deadline),) = client.zrange(index, 0, -1, withscores=True)
            message_id = member.decode()
            assert t0 + TIMEOUT_MS <= deadline <= t1 + TIMEOUT_MS + 50
            # The holder never acks; another consumer gets it again, as a second delivery.
            again: list[Message] = []
            with Consumer(other, [queue], callbacks=[lambda body, message: (again.append(message),
                                                                             message.ack())]):
                drain(other, again, 1, timeout=15)
            redelivered_at = server_now_ms(client)
            assert redelivered_at >= t0 + TIMEOUT_MS
            assert again[0].headers.get("x-delivery-count") == 1 and again[0].delivery_info["redelivered"]
            warned = wait_until(lambda: [r.getMessage() for r in caplog.records
                                         if "x-consumer-timeout" in r.getMessage()],
                                timeout=5, what="the keeper's warning")
            assert f"message {message_id} of queue 'hung'" in warned[0]
            assert len(warned) == 1  # once per delivery, not once per tick
    assert lib.stats(["hung"])[0].in_flight == 0


def test_without_a_consumer_timeout_a_held_delivery_is_extended_as_before(kind_broker: Broker) -> None:
    """The control: the same hold, on a queue without the argument, keeps its deadline a
    visibility timeout ahead."""
    queue = hung_queue("kept")
    client = kind_broker.client
    with kind_broker.connection(**OPTIONS) as holder:
        holder.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="kept", declare=[queue])
        held: list[Message] = []
        with Consumer(holder, [queue], callbacks=[lambda body, message: held.append(message)]):
            drain(holder, held, 1)
            start = server_now_ms(client)
            index = kind_broker.keys.index("kept")
            wait_until(lambda: server_now_ms(client) > start + 2 * TIMEOUT_MS, timeout=10, interval=0.1,
                       what="two timeouts to pass")
            (deadline,) = [s for _, s in client.zrange(index, 0, -1, withscores=True)]
            assert deadline > start + 2 * TIMEOUT_MS
            held[0].ack()
