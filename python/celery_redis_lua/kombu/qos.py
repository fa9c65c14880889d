"""QoS for the channel: kombu's prefetch accounting, with ack and reject through the scripts.

What is unacked when the channel closes is adopted by :mod:`.orphans` rather than handed
back at once: Celery may still be running it and ack it after reconnecting.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from kombu.transport import virtual

from ..protocol.envelope import DeliveryTag
from ..protocol.library import ScriptLibrary
from .acks import ACKS
from .orphans import ORPHANS, RETRYABLE
from .settle import hand_back, reject

logger = logging.getLogger(__name__)


class QoS(virtual.QoS):
    """Prefetch accounting plus ack/reject through the scripts."""

    channel: Any  # the Channel (typed loosely: the channel module imports this one)

    @property
    def lib(self) -> ScriptLibrary:
        return self.channel.lib

    def ack(self, delivery_tag: str) -> None:
        """Ack through the script, in a batch with the acks around it (acks.py). An ack that
        meets a lost connection is kept and sent again (orphans.py) instead of failing: the
        task is done, it must not run again."""
        tag = DeliveryTag.parse(delivery_tag)
        if not tag.fanout:
            # An adopted delivery is no longer the orphans' from here: the caller may drop
            # its Message before the batch is sent, and a tick in between would take it for
            # dropped unacked and hand it back (the task would run again). If the batch
            # meets a lost connection, its acks go back to the registry as pending acks.
            ORPHANS.settle(self.lib, tag.queue, tag.id)
            ACKS.add(self.lib, tag.queue, tag.id, wait=self.channel.options.ack_flush_delay)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        """Reject through the script. If the broker is unreachable the message is forgotten
        here and the sweep restores it after the visibility timeout (counted)."""
        tag = DeliveryTag.parse(delivery_tag)
        if not tag.fanout:
            # Fenced by the count this delivery carried (adopted ones: the count at close).
            adopted = ORPHANS.settle(self.lib, tag.queue, tag.id)
            count = self.delivery_count(delivery_tag)
            if count is None and adopted is not None:
                count = adopted.delivery_count
            try:
                reject(self.lib, tag.queue, [tag.id], requeue=requeue, counts=[count])
            except RETRYABLE as error:
                logger.warning("celery-redis-lua: reject of %s failed (%s); the sweep restores it "
                               "after the visibility timeout", delivery_tag, error)
        super().ack(delivery_tag)  # forget it locally; the script already requeued or dropped it

    def delivery_count(self, delivery_tag: str) -> int | None:
        """The x-delivery-count this channel's delivery carried (its fencing token)."""
        message = self._delivered.get(delivery_tag)
        return None if message is None else _count_of(message)

    def in_flight(self, *, flush: bool = True) -> dict[str, list[str]]:
        """Unacked message ids by queue (prefetched or running). ``flush=False`` reads a
        snapshot without touching kombu's bookkeeping (for the lease keeper's thread: only the
        consuming thread may change it)."""
        if flush:
            self._flush()
        acked = set(self._dirty)
        by_queue: dict[str, list[str]] = defaultdict(list)
        for tag in (DeliveryTag.parse(t) for t in list(self._delivered) if t not in acked):
            if not tag.fanout:
                by_queue[tag.queue].append(tag.id)
        return by_queue

    def _take_unacked(self) -> list[tuple[str, str, int | None, Any]]:
        """(queue, id, delivery count, Message) of every unacked delivery; forgets them here."""
        self._flush()
        tags = [(DeliveryTag.parse(tag), message) for tag, message in list(self._delivered.items())]
        self._delivered.clear()
        return [(tag.queue, tag.id, _count_of(message), message) for tag, message in tags if not tag.fanout]

    def hand_back_all(self) -> None:
        """basic_recover(requeue=True): every unacked delivery goes back now, counted."""
        by_queue: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
        for queue, message_id, count, _ in self._take_unacked():
            by_queue[queue].append((message_id, count))
        for queue, entries in by_queue.items():
            ids, counts = zip(*entries, strict=True)
            hand_back(self.lib, queue, list(ids), list(counts))

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """The channel closes: its unacked deliveries are adopted (orphans.py). Those whose
        Message nobody holds any more are handed back at once, counted as a delivery; the
        others when they are dropped unacked, or at exit."""
        deliveries = self._take_unacked()
        if deliveries:
            ORPHANS.adopt(self.lib, deliveries)
            del deliveries  # our own references must not keep the Messages alive
            ORPHANS.tick()
        return []


def _count_of(message: Any) -> int | None:
    count = (getattr(message, "headers", None) or {}).get("x-delivery-count")
    return count if isinstance(count, int) and not isinstance(count, bool) else None
