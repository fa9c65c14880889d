"""Fanout exchanges on Streams: the channel methods that publish to and consume from them.

Each queue bound to a fanout exchange has a consumer group on the exchange's
stream (created when it is bound, see lua/fanout_bind.lua). A channel reads its
groups with the fanout_consume script and waits for new entries with XREAD.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatchcase
from typing import Any

from kombu.utils.objects import cached_property

from .calls import Delivery
from .envelope import BadEnvelope, delivered_envelope, delivery_tag, dumps
from .qos import FANOUT_TAG

logger = logging.getLogger(__name__)


class FanoutMixin:
    """Mixed into :class:`~celery_redis_lua.channel.Channel`."""

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        self.lib.fanout_publish(self.fanout_key(exchange), dumps(message),
                                maxlen=self.options.stream_maxlen,
                                expires_ms=self.options.queue_expires_ms, routing_key=routing_key)

    @cached_property
    def fanout_prefix(self) -> str:
        prefix = self.options.fanout_prefix
        if prefix is True:
            return f"/{self.connection.db}."
        return prefix or ""

    def fanout_key(self, exchange: str) -> str:
        return self.keys.fanout(exchange, self.fanout_prefix)

    @property
    def fanout_polled(self) -> list[str]:
        return [q for q in dict.fromkeys(self._active_queues) if q in self._fanout_queues]

    def consume_fanout_now(self) -> int:
        delivered = 0
        for queue in self.fanout_polled:
            exchange, pattern = self._fanout_queues[queue]
            stream = self.fanout_key(exchange)
            batch = self.lib.fanout_consume(stream, queue, self.consumer_name,
                                            count=self.options.consume_batch)
            self._fanout_last_id[stream] = batch.last_id
            for entry_id, routing_key, payload in batch.entries:
                if not self._fanout_matches(pattern, routing_key):
                    continue
                delivery = Delivery(queue, entry_id, 0, payload)
                delivered += self._deliver_fanout(delivery)
        return delivered

    def start_stream_wait(self) -> bool:
        streams = [self.fanout_key(self._fanout_queues[q][0]) for q in self.fanout_polled]
        streams = list(dict.fromkeys(streams))
        if not streams:
            return False
        timeout = self.options.blocking_timeout
        ids = [self._fanout_last_id.get(s, "$") for s in streams]
        self.stream_wait.send("XREAD", "COUNT", 1, "BLOCK", int(timeout * 1000), "STREAMS",
                              *streams, *ids, timeout=timeout)
        return True

    def on_stream_wait_readable(self) -> int:
        self.stream_wait.read()
        return self.consume_fanout_now()

    def _fanout_matches(self, pattern: str, routing_key: str) -> bool:
        """A fanout exchange ignores routing keys (AMQP), unless fanout_patterns is on and
        the binding key is a pattern ('*' or '#'): then it filters what the queue gets."""
        if not self.options.fanout_patterns or "*" not in pattern or pattern == "*":
            return True
        return fnmatchcase(routing_key, pattern)

    def _deliver_fanout(self, delivery: Delivery) -> int:
        try:
            payload = delivered_envelope(delivery)
        except BadEnvelope as error:
            logger.error("celery-redis-lua: dropped a fanout entry: %s", error)
            return 0
        # Fanout entries were acknowledged when read: nothing to ack or restore later.
        payload["properties"]["delivery_tag"] = FANOUT_TAG + delivery_tag(delivery.queue, delivery.id)
        self.connection._deliver(payload, delivery.queue)
        return 1
