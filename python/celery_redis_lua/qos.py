"""QoS for the channel: kombu's prefetch accounting, with ack and reject through the scripts."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from kombu.transport import virtual

from . import calls
from .envelope import split_tag

if TYPE_CHECKING:
    from .channel import Channel

# Delivery tags of fanout entries (read at most once per queue; nothing to ack).
FANOUT_TAG = "fanout:"


def is_fanout_tag(tag: str) -> bool:
    return str(tag).startswith(FANOUT_TAG)


class QoS(virtual.QoS):
    """Prefetch accounting plus ack/reject through the scripts."""

    channel: Channel

    def ack(self, delivery_tag: str) -> None:
        if not is_fanout_tag(delivery_tag):
            queue, message_id = split_tag(delivery_tag)
            self.channel.lib.ack(queue, [message_id])
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if not is_fanout_tag(delivery_tag):
            queue, message_id = split_tag(delivery_tag)
            self.channel.reject_ids(queue, [message_id], requeue=requeue)
        super().ack(delivery_tag)  # forget it locally; the script already requeued or dropped it

    def in_flight(self) -> dict[str, list[str]]:
        """Unacked message ids by queue (prefetched or running)."""
        self._flush()
        by_queue: dict[str, list[str]] = defaultdict(list)
        for tag in list(self._delivered):
            if is_fanout_tag(tag):
                continue
            queue, message_id = split_tag(tag)
            by_queue[queue].append(message_id)
        return by_queue

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Hand every unacked message back at once, counted as a redelivery."""
        errors: list[tuple[BaseException, Any]] = []
        in_flight = self.in_flight()
        batch = [
            calls.reject(self.channel.keys, queue, ids, requeue=True,
                         delivery_limit=self.channel.options.delivery_limit,
                         dead_letter_maxlen=self.channel.options.dead_letter_maxlen,
                         visibility_ms=self.channel.options.visibility_ms)
            for queue, ids in in_flight.items()
        ]
        for (queue, ids), result in zip(in_flight.items(), self.channel.lib.run_many(
                batch, raise_on_error=False), strict=True):
            if isinstance(result, BaseException):
                errors.append((result, (queue, ids)))
        self._delivered.clear()
        return errors
