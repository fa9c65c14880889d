"""Fanout exchanges on Streams: the channel methods that publish to and consume from them.

Each queue bound to a fanout exchange has a consumer group on the exchange's stream
(lua/fanout_bind.lua) with the queue's x-expires and x-message-ttl: a group unread for
x-expires is gone as its queue would be; older entries are not delivered. A channel reads
its groups with fanout_consume and waits with XREAD, which returns at once after a full
batch, so a backlog drains without waiting out ``blocking_timeout``. The bindings are the
connection's (``fanout_queues``): any of its channels consumes a queue bound on another.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

import redis
from redis.crc import key_slot

from ..protocol.envelope import BadEnvelope, delivered_envelope, dumps
from ..protocol.ops import Delivery
from ..protocol.revoke import revoke_waiting, revoked_task_ids
from ..protocol.runner import Call

logger = logging.getLogger(__name__)


def _stream_position(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class FanoutMixin:
    """Mixed into :class:`~celery_redis_lua.kombu.channel.Channel`."""

    connection: Any
    lib: Any
    keys: Any
    options: Any
    consumer_name: str
    is_cluster: bool
    stream_waits: dict[int | None, Any]
    _wait: Any
    _active_queues: list[str]
    _fanout_next_id: dict[str, str]
    _fanout_read: set[str]

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        self.lib.fanout_publish(exchange, dumps(message), maxlen=self.options.stream_maxlen,
                                expires_ms=self.options.queue_expires_ms, routing_key=routing_key)
        revoked = revoked_task_ids(exchange, message)
        if revoked:  # Celery's revoke(): the waiting ones never run, whichever worker is up
            try:
                revoke_waiting(self.lib, revoked)
            except redis.RedisError as error:  # the broadcast went: the workers up still revoke
                logger.warning("celery-redis-lua: revoke of %d task(s) did not reach the queues (%s)",
                               len(revoked), error)

    def fanout_bind_call(self, queue: str) -> Call[Any]:
        """Create (or keep alive) the queue's group, with the queue's expiry and message TTL."""
        exchange, _ = self.connection.fanout_queues[queue]
        declared = self.connection.declared.get(queue)
        return self.lib.calls.fanout_bind(
            exchange, queue, expires_ms=declared.expires_ms if declared else None,
            message_ttl_ms=declared.message_ttl_ms if declared else None,
            stream_expires_ms=self.options.queue_expires_ms)

    @property
    def fanout_polled(self) -> list[str]:
        fanout = self.connection.fanout_queues
        return [q for q in dict.fromkeys(self._active_queues) if q in fanout]

    def consume_fanout_now(self) -> int:
        delivered = 0
        self._fanout_next_id = {}
        for queue in self.fanout_polled:
            exchange, pattern = self.connection.fanout_queues[queue]
            stream = self.keys.fanout(exchange)
            batch = self.lib.fanout_consume(exchange, queue, self.consumer_name,
                                            count=self.options.consume_batch,
                                            stream_expires_ms=self.options.queue_expires_ms)
            self._fanout_read.add(queue)
            known = self._fanout_next_id.get(stream)
            if known is None or _stream_position(batch.next_id) < _stream_position(known):
                self._fanout_next_id[stream] = batch.next_id  # the least advanced group decides
            if batch.skipped:
                logger.info("celery-redis-lua: %d broadcast(s) to queue %r were older than its "
                            "x-message-ttl and were not delivered", batch.skipped, queue)
            for entry_id, routing_key, payload in batch.entries:
                if self._fanout_matches(pattern, routing_key):
                    delivered += self._deliver_fanout(Delivery(queue, entry_id, 0, payload))
        return delivered

    def poll_streams(self) -> int:
        """Read the consumed fanout queues' groups, then XREAD on the streams whose wait is not
        pending (one wait per slot on a cluster)."""
        groups: dict[int | None, list[str]] = {}
        for queue in self.fanout_polled:
            stream = self.keys.fanout(self.connection.fanout_queues[queue][0])
            slot = key_slot(stream.encode()) if self.is_cluster else None
            if stream not in groups.setdefault(slot, []):
                groups[slot].append(stream)
        idle = [streams for streams in groups.values()
                if self._wait(self.stream_waits, streams[0]).pending is None]
        if not idle:
            return 0
        delivered = self.consume_fanout_now()
        for streams in idle:
            self.start_stream_wait(streams)
        return delivered

    def start_stream_wait(self, streams: list[str]) -> None:
        """XREAD on ``streams`` (of one slot) from where the least advanced group stands."""
        timeout = self.options.blocking_timeout
        ids = [self._fanout_next_id.get(s, "$") for s in streams]
        self._wait(self.stream_waits, streams[0]).send(
            "XREAD", "COUNT", 1, "BLOCK", int(timeout * 1000), "STREAMS", *streams, *ids, timeout=timeout)

    def on_stream_wait_readable(self, wait: Any) -> int:
        wait.read()
        return self.consume_fanout_now()

    def _leave_fanout(self, queues: Iterable[str]) -> None:
        """This channel's consumer leaves the groups of ``queues`` it read; best effort (the
        next bind clears what is left)."""
        for queue in queues:
            if queue not in self._fanout_read:
                continue
            self._fanout_read.discard(queue)
            fanout = self.connection.fanout_queues.get(queue)
            if fanout is None:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                self.lib.fanout_leave(fanout[0], queue, self.consumer_name)

    def _fanout_matches(self, pattern: str, routing_key: str) -> bool:
        """A fanout exchange ignores routing keys (AMQP), unless fanout_patterns is on and
        the binding key is a pattern ('*' or '#'): then it filters what the queue gets."""
        if not self.options.fanout_patterns or "*" not in pattern or pattern == "*":
            return True
        return fnmatchcase(routing_key, pattern)

    def _deliver_fanout(self, delivery: Delivery) -> int:
        try:
            # Fanout entries were acknowledged when read: their tags say there is nothing to ack.
            payload = delivered_envelope(delivery, fanout=True)
        except BadEnvelope as error:
            logger.error("celery-redis-lua: dropped a fanout entry: %s", error)
            return 0
        self.connection._deliver(payload, delivery.queue)
        return 1
