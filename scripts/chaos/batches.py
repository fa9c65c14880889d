"""Which consume batch delivered each message: the chaos workers' record of our transport's
consume replies, for the verdict's order check (jepsen.py).

The transport takes messages a batch at a time (the consume script, up to the QoS headroom)
and hands a reply's deliveries to kombu in the order taken. For each reply that took
anything, a worker records in the ledger (kind ``batch``) when that consume went out
(``after``: the script ran later), when its reply was read (``t``: the script ran before),
and what it took, in order, as (queue, task id, delivery count). The harness's instrument,
not a transport feature: it wraps three methods of the kombu channel, ``consume_now`` (a
consume waited for), ``_send_consume`` (one sent ahead in Celery's hub, its reply read by
``_consume_arrived``) and ``_deliver_all`` (a reply's deliveries). For kombu's stock Redis
transport, its BRPOP read: one message a batch (:func:`install_stock`).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from collections.abc import Callable
from typing import Any

from celery_redis_lua.kombu.consuming import ConsumingMixin
from celery_redis_lua.protocol.ops import Delivery
from scripts.chaos import ledger

# Attributes the wrappers keep on a channel: when the consume whose reply is being handled
# went out, and when each slot group's consume sent ahead went out.
GOING = "_chaos_consume_sent_at"
SENT_AHEAD = "_chaos_sent_ahead"
SERIAL = "_chaos_serial"
_serials = itertools.count(1)


def task_id(delivery: Delivery) -> str | None:
    """The Celery task id of a delivery (its envelope's ``headers.id``)."""
    try:
        headers = json.loads(delivery.payload).get("headers") or {}
    except (ValueError, AttributeError):
        return None
    return headers.get("id") if isinstance(headers, dict) else None


def record(channel: Any, deliveries: list[Delivery]) -> None:
    if not hasattr(channel, SERIAL):
        setattr(channel, SERIAL, next(_serials))
    ledger.record("batch", t=time.time(), after=getattr(channel, GOING, None), pid=os.getpid(),
                  channel=getattr(channel, SERIAL),
                  deliveries=[[d.queue, task_id(d), d.delivery_count] for d in deliveries])


def consuming(original: Callable[..., Any], sent_at: Callable[[Any, tuple[Any, ...]], float | None]
              ) -> Callable[..., Any]:
    """``original`` with GOING set, while it runs, to what ``sent_at`` says of its call."""
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        setattr(self, GOING, sent_at(self, args))
        try:
            return original(self, *args, **kwargs)
        finally:
            setattr(self, GOING, None)
    return wrapper


def sent_ahead(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, group: list[str]) -> Any:
        ahead = vars(self).setdefault(SENT_AHEAD, {})
        ahead[tuple(group)] = time.time()
        return original(self, group)
    return wrapper


def delivering(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, deliveries: list[Delivery], no_ack: bool) -> Any:
        if deliveries:
            record(self, deliveries)
        return original(self, deliveries, no_ack)
    return wrapper


def _now(channel: Any, args: tuple[Any, ...]) -> float:
    return time.time()


def _when_sent_ahead(channel: Any, args: tuple[Any, ...]) -> float | None:
    """The in-flight consume on the wait ``args[0]``: when its group's consume went out."""
    sent = getattr(args[0], "batch", None)
    group = tuple(sent.group) if sent is not None else None
    when: float | None = vars(channel).get(SENT_AHEAD, {}).pop(group, None)
    return when


def stock_reading(original: Callable[..., Any]) -> Callable[..., Any]:
    """kombu's stock Redis channel: a BRPOP reply is a batch of one, read in ``_brpop_read``
    (sent by ``_brpop_start``, which stamps ``_brpop_sent_at``, monotonic). What it delivers is
    seen through the transport's ``_deliver`` for the time of the call; a message restored
    after its visibility timeout carries ``redelivered`` (its count, 1 here)."""
    @functools.wraps(original)
    def wrapper(self: Any, **options: Any) -> Any:
        sent = getattr(self, "_brpop_sent_at", None)
        after = None if sent is None else time.time() - (time.monotonic() - sent)
        transport, taken = self.connection, []

        def deliver(message: dict[str, Any], queue: str) -> Any:
            headers = message.get("headers") or {}
            taken.append([queue, headers.get("id"), 1 if headers.get("redelivered") else 0])
            return type(transport)._deliver(transport, message, queue)

        transport._deliver = deliver
        try:
            return original(self, **options)
        finally:
            del transport._deliver
            if taken:
                ledger.record("batch", t=time.time(), after=after, pid=os.getpid(), channel=id(self),
                              deliveries=taken)
    return wrapper


def install_stock() -> None:
    """Wrap kombu's stock Redis channel's BRPOP read (once per process)."""
    from kombu.transport.redis import Channel

    if getattr(Channel, "_chaos_batches", False):
        return
    stock: Any = Channel
    stock._brpop_read = stock_reading(Channel._brpop_read)
    stock._chaos_batches = True


def install() -> None:
    """Wrap the channel's consuming methods (once per process)."""
    if getattr(ConsumingMixin, "_chaos_batches", False):
        return
    mixin: Any = ConsumingMixin
    mixin.consume_now = consuming(ConsumingMixin.consume_now, _now)
    mixin._consume_arrived = consuming(ConsumingMixin._consume_arrived, _when_sent_ahead)
    mixin._send_consume = sent_ahead(ConsumingMixin._send_consume)
    mixin._deliver_all = delivering(ConsumingMixin._deliver_all)
    mixin._chaos_batches = True
