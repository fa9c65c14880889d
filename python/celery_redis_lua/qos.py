"""QoS for the channel: kombu's prefetch accounting, with ack and reject through the scripts.

What is unacked when the channel closes is adopted by :mod:`.orphans` rather than handed
back at once: Celery may still be running it and ack it after reconnecting.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from kombu.transport import virtual

from .envelope import split_tag
from .orphans import ORPHANS, RETRYABLE, Settings

if TYPE_CHECKING:
    from .channel import Channel

logger = logging.getLogger(__name__)

# Delivery tags of fanout entries (read at most once per queue; nothing to ack).
FANOUT_TAG = "fanout:"


def is_fanout_tag(tag: str) -> bool:
    return str(tag).startswith(FANOUT_TAG)


class QoS(virtual.QoS):
    """Prefetch accounting plus ack/reject through the scripts."""

    channel: Channel

    @property
    def settings(self) -> Settings:
        options = self.channel.options
        return Settings(visibility_ms=options.visibility_ms, delivery_limit=options.delivery_limit,
                        dead_letter_maxlen=options.dead_letter_maxlen)

    def ack(self, delivery_tag: str) -> None:
        """Ack through the script. An ack that meets a lost connection is kept and sent again
        (orphans.py) instead of failing: the task is done, it must not run again."""
        if not is_fanout_tag(delivery_tag):
            queue, message_id = split_tag(delivery_tag)
            lib = self.channel.lib
            try:
                lib.ack(queue, [message_id])
            except RETRYABLE as error:
                logger.warning("celery-redis-lua: ack of %s failed (%s); sending it again once "
                               "the broker is reachable", delivery_tag, error)
                ORPHANS.ack_later(lib, self.settings, queue, message_id)
            else:
                ORPHANS.settle(lib, queue, message_id)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        """Reject through the script. If the broker is unreachable the message is forgotten
        here and the sweep restores it after the visibility timeout (counted)."""
        if not is_fanout_tag(delivery_tag):
            queue, message_id = split_tag(delivery_tag)
            # Fenced by the count this delivery carried (adopted ones: the count at close).
            adopted = ORPHANS.settle(self.channel.lib, queue, message_id)
            count = self.delivery_count(delivery_tag)
            if count is None and adopted is not None:
                count = adopted.delivery_count
            try:
                self.channel.reject_ids(queue, [message_id], requeue=requeue, counts=[count])
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
        snapshot without touching kombu's bookkeeping (for the watchdog's thread: only the
        consuming thread may change it)."""
        if flush:
            self._flush()
        acked = set(self._dirty)
        by_queue: dict[str, list[str]] = defaultdict(list)
        for tag in list(self._delivered):
            if is_fanout_tag(tag) or tag in acked:
                continue
            queue, message_id = split_tag(tag)
            by_queue[queue].append(message_id)
        return by_queue

    def _take_unacked(self) -> list[tuple[str, str, int | None, Any]]:
        """(queue, id, delivery count, Message) of every unacked delivery; forgets them here."""
        self._flush()
        unacked = [(*split_tag(tag), _count_of(message), message)
                   for tag, message in list(self._delivered.items()) if not is_fanout_tag(tag)]
        self._delivered.clear()
        return unacked

    def hand_back_all(self) -> None:
        """basic_recover(requeue=True): every unacked delivery goes back now, counted."""
        by_queue: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
        for queue, message_id, count, _ in self._take_unacked():
            by_queue[queue].append((message_id, count))
        for queue, entries in by_queue.items():
            ids, counts = zip(*entries, strict=True)
            self.channel.reject_ids(queue, list(ids), requeue=True, counts=list(counts))

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """The channel closes: its unacked deliveries are adopted (orphans.py). Those whose
        Message nobody holds any more are handed back at once, counted as a delivery; the
        others when they are dropped unacked, or at exit."""
        deliveries = self._take_unacked()
        if deliveries:
            ORPHANS.adopt(self.channel.lib, self.settings, deliveries)
            del deliveries  # our own references must not keep the Messages alive
            ORPHANS.tick()
        return []


def _count_of(message: Any) -> int | None:
    count = (getattr(message, "headers", None) or {}).get("x-delivery-count")
    return count if isinstance(count, int) and not isinstance(count, bool) else None
