"""QoS for the channel: kombu's prefetch accounting, with ack and reject through the scripts.

What is unacked when the channel closes stays held by its Message (an orphan of the keeper,
:mod:`.keeper`) rather than handed back at once: Celery may still run it and ack it after
reconnecting.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kombu.transport import virtual

from ..protocol.envelope import DeliveryTag
from ..protocol.settle import hand_back
from .keeper import KEEPER


class QoS(virtual.QoS):
    """Prefetch accounting plus ack/reject through the scripts."""

    channel: Any  # the Channel (typed loosely: the channel module imports this one)

    def ack(self, delivery_tag: str) -> None:
        """Ack through the channel's outbox, batched: one that fails is kept and sent again
        (outbox.py) instead of failing: the task is done, it must not run again."""
        tag = DeliveryTag.parse(delivery_tag)
        if not tag.fanout:
            self.channel.outbox.add_ack(tag.queue, tag.id, self._settling(delivery_tag, tag))
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        """Reject now through the channel's outbox, fenced by the delivery's count; one that
        fails is kept and sent again until its lease would lapse (outbox.py)."""
        tag = DeliveryTag.parse(delivery_tag)
        if not tag.fanout:
            self.channel.outbox.reject(tag.queue, tag.id, requeue=requeue,
                                       count=self._settling(delivery_tag, tag))
        super().ack(delivery_tag)  # forget it locally: the script requeued or dropped it (or will)

    def _settling(self, delivery_tag: str, tag: DeliveryTag) -> int | None:
        """Its ack or reject is asked for: settling from now (the caller may drop its Message
        before the call is sent, and a keeper tick would take it for dropped unacked and
        hand it back). Returns the count the delivery carried, which fences the call."""
        count = KEEPER.settling(self.channel.lib, tag.queue, tag.id)
        return _count_of(self._delivered.get(delivery_tag)) if count is None else count

    def _take_unacked(self) -> list[tuple[str, str, Any]]:
        """(queue, id, Message) of every unacked delivery; forgets them here."""
        self._flush()
        tags = [(DeliveryTag.parse(tag), message) for tag, message in list(self._delivered.items())]
        self._delivered.clear()
        return [(tag.queue, tag.id, message) for tag, message in tags if not tag.fanout]

    def hand_back_all(self) -> None:
        """basic_recover(requeue=True): every unacked delivery goes back now, counted."""
        by_queue: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
        for queue, message_id, message in self._take_unacked():
            count = KEEPER.settling(self.channel.lib, queue, message_id)
            by_queue[queue].append((message_id, _count_of(message) if count is None else count))
        for queue, entries in by_queue.items():
            ids, counts = zip(*entries, strict=True)
            try:
                hand_back(self.channel.lib, queue, list(ids), list(counts))
            finally:  # landed, or back after the visibility timeout: no longer extended
                KEEPER.release(self.channel.lib, queue, ids)

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """The channel closes: its unacked deliveries stay held by their Messages (orphans);
        those nobody holds are handed back now, counted, the others when dropped or at exit."""
        KEEPER.orphan(self.channel.lib, self._take_unacked())
        return []


def _count_of(message: Any) -> int | None:
    """The x-delivery-count the delivery carried (its fencing token), if it says."""
    count = (getattr(message, "headers", None) or {}).get("x-delivery-count")
    return count if isinstance(count, int) and not isinstance(count, bool) else None
