"""kombu glue: a virtual Channel whose every operation is a script call.

The channel holds no protocol logic of its own: publish, consume, ack, reject,
declare, bind, purge and delete each map to one script (see lua/). What lives
here is bookkeeping kombu needs (which queues are consumed, with or without
ack) and the blocking wait on queues (BZMPOP, then claim). Fanout streams are
in fanout.py, acks and prefetch accounting in qos.py.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

from . import calls
from .blocking import BlockingRead
from .calls import Delivery
from .envelope import (
    BadEnvelope,
    delivered_envelope,
    dumps,
    publish_arguments,
)
from .fanout import FanoutMixin
from .keys import Keyspace
from .library import ScriptLibrary
from .qos import QoS

if TYPE_CHECKING:
    from .transport import Transport

logger = logging.getLogger(__name__)

# Server-side floor for a BZMPOP/XREAD block, so a due-now hint never spins.
MIN_BLOCK_SECONDS = 0.005
# The claim script takes at most this many ids per call.
MAX_CLAIM = 1000
# The pattern field of a fanout binding (kombu leaves it empty; fanout lookups ignore it).
FANOUT_PATTERN = "fanout"


class Channel(FanoutMixin, virtual.Channel):
    """A kombu channel on the celery-redis-lua scripts."""

    QoS = QoS
    supports_fanout = True
    min_priority = 0
    max_priority = 255
    default_priority = 0
    connection: Transport

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.options = connection.options
        self.keys = Keyspace(self.options.global_keyprefix, self.options.message_key_prefix)
        self.client = connection.new_client()
        self.lib = ScriptLibrary(self.client, self.keys, visibility_ms=self.options.visibility_ms)
        self.consumer_name = f"{socket.gethostname()}:{os.getpid()}:{self.channel_id}"
        self._queue_expires: dict[str, int | None] = {}
        self._fanout_queues: dict[str, tuple[str, str]] = {}  # queue -> (exchange, routing key)
        self._no_ack_queues: set[str] = set()
        self._fanout_last_id: dict[str, str] = {}
        self.queue_wait = BlockingRead(self.client.connection_pool)
        self.stream_wait = BlockingRead(self.client.connection_pool)
        self.client.ping()  # connection errors surface now, as kombu expects
        connection.channels_polled.add(self)

    # -- publishing -------------------------------------------------------------------------

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        args = publish_arguments(message, self.options.message_ttl_ms)
        self.lib.publish(queue, dumps(message), priority=args.priority,
                         eta_ms=args.eta_ms, ttl_ms=args.ttl_ms)

    # -- queues and bindings ----------------------------------------------------------------

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        arguments = kwargs.get("arguments") or {}
        expires = _ms_argument(queue, arguments, "x-expires")
        if expires is None:
            expires = self.options.queue_expires_ms
        self._queue_expires[queue] = expires
        self.lib.declare(queue, expires_ms=expires,
                         message_ttl_ms=_ms_argument(queue, arguments, "x-message-ttl"),
                         max_priority=_ms_argument(queue, arguments, "x-max-priority"))

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> dict[str, Any]:
        """kombu's Queue(max_priority=, message_ttl=, expires=) as RabbitMQ's x- arguments."""
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        """Delete the queue's keys whether or not this process knows its bindings; the
        bindings it knows are removed too."""
        if if_empty and self._size(queue):
            return
        for exchange, routing_key, arguments in self.state.queue_bindings(queue):
            meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
            self.lib.unbind(exchange, [self._binding_member(exchange, *meta)])
        self.state.queue_bindings_delete(queue)
        self.lib.delete(queue)
        self._fanout_queues.pop(queue, None)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.lib.exists(queue)

    def _binding_member(self, exchange: str, routing_key: str, pattern: str, queue: str) -> str:
        if self.typeof(exchange).type == "fanout":
            pattern = FANOUT_PATTERN  # lets producers that never declared the exchange route it
        return calls.binding_member(routing_key, pattern, queue, self.options.sep)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        if self.typeof(exchange).type == "fanout":
            self._fanout_queues[queue] = (exchange, (routing_key or "").replace("#", "*"))
            self.lib.fanout_bind(self.fanout_key(exchange), queue,
                                 expires_ms=self.options.queue_expires_ms)
        member = self._binding_member(exchange, routing_key, pattern, queue)
        self.lib.bind(exchange, [member], lifetime_ms=self._queue_expires.get(queue))

    def get_table(self, exchange: str) -> list[tuple[str, ...]]:
        return self.lib.lookup(exchange, self.options.sep)

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        """An exchange this process never declared is a fanout exchange when its bindings
        say so (Celery does not declare Broadcast queues before publishing to them)."""
        if (exchange and exchange not in self.state.exchanges
                and any(pattern == FANOUT_PATTERN for _, pattern, _ in self.get_table(exchange))):
            self.state.exchanges[exchange] = {"type": "fanout", "durable": True,
                                              "auto_delete": False, "arguments": {}, "table": []}
        return super().typeof(exchange, default)

    def _size(self, queue: str) -> int:
        return self.lib.size(queue)

    def _purge(self, queue: str) -> int:
        return self.lib.purge(queue)

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str,
                *args: Any, **kwargs: Any) -> None:
        self.lib.unbind(exchange, [self._binding_member(exchange, routing_key, pattern, queue)])
        self.lib.delete(queue)
        self._fanout_queues.pop(queue, None)

    # -- consuming --------------------------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        result = super().basic_consume(queue, no_ack, *args, **kwargs)
        self.connection.watchdog.start()
        self._restart_waits()
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._no_ack_queues.discard(queue)
        self._restart_waits()
        return result

    def _restart_waits(self) -> None:
        """The consumed queues changed: end pending waits (they name the old keys), so the
        next round blocks on the new set at once instead of after blocking_timeout."""
        if self.closed:
            return
        popped = self.queue_wait.cancel(self.client)
        if popped:
            self._claim_popped(popped, deliver=True)
        self.stream_wait.cancel(self.client)

    def basic_recover(self, requeue: bool = False) -> None:
        """Redeliver every unacked message now (a closing channel adopts them instead)."""
        if not requeue:
            raise NotImplementedError("celery-redis-lua does not support recover(requeue=False)")
        self.qos.hand_back_all()

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        for delivery in self.lib.consume([queue], 1, no_ack=no_ack).deliveries:
            payload = self._decode_or_reject(delivery, no_ack)
            if payload is not None:
                message = self.Message(payload, channel=self)
                if not no_ack:
                    self.qos.append(message, message.delivery_tag)
                return message
        return None

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        raise NotImplementedError("celery-redis-lua consumes through Transport.drain_events")

    @property
    def queues_polled(self) -> list[str]:
        """Consumed queues that hold messages in ZSETs (fanout-bound ones read streams)."""
        return [q for q in dict.fromkeys(self._active_queues) if q not in self._fanout_queues]

    def headroom(self) -> int:
        """How many messages QoS lets this channel take now."""
        room = self.qos.can_consume_max_estimate()
        return self.options.consume_batch if room is None else min(room, self.options.consume_batch)

    def consume_now(self) -> tuple[int, int | None]:
        """Deliver what is ready in the consumed queues; returns (delivered, wake_in_ms)."""
        queues = self.queues_polled
        delivered, wake = 0, None
        for no_ack, group in ((True, [q for q in queues if q in self._no_ack_queues]),
                              (False, [q for q in queues if q not in self._no_ack_queues])):
            room = self.headroom()
            if not group or room <= 0:
                continue
            consumed = self.lib.consume(group, room, no_ack=no_ack)
            delivered += self._deliver_all(consumed.deliveries, no_ack)
            if consumed.wake_in_ms is not None:
                wake = consumed.wake_in_ms if wake is None else min(wake, consumed.wake_in_ms)
        return delivered, wake

    def start_queue_wait(self, wake_in_ms: int | None) -> bool:
        """Block on BZMPOP across the consumed queues (bounded by blocking_timeout and by
        the next ETA). Returns whether a wait is now pending."""
        queues = self.queues_polled
        room = self.headroom()
        if not queues or room <= 0:
            return False
        timeout = self.options.blocking_timeout
        if wake_in_ms is not None:
            timeout = min(timeout, wake_in_ms / 1000) if timeout else wake_in_ms / 1000
            timeout = max(timeout, MIN_BLOCK_SECONDS)
        keys = [self.keys.queue(q) for q in queues]
        count = min(room, MAX_CLAIM)
        self.queue_wait.send("BZMPOP", f"{timeout:.3f}", len(keys), *keys, "MIN", "COUNT", count,
                             timeout=timeout)
        return True

    def on_queue_wait_readable(self) -> int:
        """Claim what BZMPOP popped and deliver it; returns how many were delivered."""
        reply = self.queue_wait.read()
        return self._claim_and_deliver(reply)

    def _claim_and_deliver(self, reply: Any) -> int:
        return self._claim_popped(reply, deliver=True) if reply else 0

    def _claim_popped(self, reply: Any, *, deliver: bool) -> int:
        """Claim what BZMPOP popped; deliver it if its queue is still consumed here,
        else hand it straight back (counted, as for a consumer that went away)."""
        key, members = reply
        key = key.decode() if isinstance(key, bytes) else key
        queue = self._queue_of_key(key)
        ids = [m[0].decode() if isinstance(m[0], bytes) else m[0] for m in members]
        no_ack = queue in self._no_ack_queues
        consumed = deliver and queue in self.queues_polled
        deliveries = self.lib.claim(queue, ids, no_ack=no_ack and consumed)
        if consumed:
            return self._deliver_all(deliveries, no_ack)
        if deliveries:
            self.reject_ids(queue, [d.id for d in deliveries], requeue=True,
                            counts=[d.delivery_count for d in deliveries])
        return 0

    def _queue_of_key(self, key: str) -> str:
        """The queue name inside a ``P queue:{Q}`` key."""
        prefix = self.keys.queue("x")[:-3]  # 'P queue:'
        return key[len(prefix) + 1:-1]

    def _deliver_all(self, deliveries: Iterable[Delivery], no_ack: bool) -> int:
        delivered = 0
        for delivery in deliveries:
            payload = self._decode_or_reject(delivery, no_ack)
            if payload is not None:
                self.connection._deliver(payload, delivery.queue)
                delivered += 1
        return delivered

    def _decode_or_reject(self, delivery: Delivery, no_ack: bool) -> dict[str, Any] | None:
        """A payload that is not a kombu envelope is rejected (dead-lettered) with a log
        line naming it; the consumer and every other message go on."""
        try:
            return delivered_envelope(delivery)
        except BadEnvelope as error:
            logger.error("celery-redis-lua: rejected a message: %s", error)
            if not no_ack:
                self.reject_ids(delivery.queue, [delivery.id], requeue=False,
                                counts=[delivery.delivery_count])
            return None

    def reject_ids(self, queue: str, ids: list[str], *, requeue: bool,
                   counts: list[int | None] | None = None) -> None:
        """Reject through the script; with ``counts`` (the x-delivery-count each was
        delivered with) a message delivered again since is left alone."""
        result = self.lib.reject(queue, ids, requeue=requeue,
                                 delivery_limit=self.options.delivery_limit,
                                 dead_letter_maxlen=self.options.dead_letter_maxlen, counts=counts)
        if result.dead_lettered and requeue:
            logger.error("celery-redis-lua: message %s of queue %r reached delivery_limit=%s and "
                         "was dead-lettered", ", ".join(ids), queue, self.options.delivery_limit)

    # -- periodic work ----------------------------------------------------------------------

    def heartbeat(self, *, from_loop: bool = True) -> None:
        """Push the deadlines of everything in flight forward; refresh queue expiry.
        From another thread than the loop's (the watchdog) kombu's QoS is only read."""
        in_flight = self.qos.in_flight(flush=from_loop)
        queues = set(in_flight) | {q for q in self.queues_polled if self._queue_expires.get(q)}
        if not queues:
            return
        self.lib.run_many([
            calls.extend(self.keys, queue, in_flight.get(queue, []),
                         visibility_ms=self.options.visibility_ms)
            for queue in sorted(queues)
        ])

    def sweep(self) -> None:
        queues = self.queues_polled
        if not queues:
            return
        report = self.lib.sweep(queues, delivery_limit=self.options.delivery_limit,
                                dead_letter_maxlen=self.options.dead_letter_maxlen)
        for dropped in report.dropped_messages:
            logger.error("celery-redis-lua: message %s of queue %r reached delivery_limit=%s "
                         "(x-delivery-count %s) and was dead-lettered", dropped.id, dropped.queue,
                         self.options.delivery_limit, dropped.delivery_count)
        if report.requeued or report.unclaimed:
            logger.info("celery-redis-lua: sweep restored %d timed-out and %d unclaimed messages",
                        report.requeued, report.unclaimed)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.connection.channels_polled.discard(self)
        popped = self.queue_wait.cancel(self.client)
        if popped:  # BZMPOP popped messages just as we cancelled: hand them back
            self._claim_popped(popped, deliver=False)
        self.stream_wait.cancel(self.client)
        try:
            super().close()
        finally:
            self.queue_wait.close()
            self.stream_wait.close()
            self.client.close()


def _ms_argument(queue: str, arguments: dict[str, Any], name: str) -> int | None:
    """A RabbitMQ queue argument (ms, or a priority), checked so a bad one names itself."""
    value = arguments.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"queue {queue!r}: argument {name!r} must be a non-negative number, "
                         f"got {value!r}")
    return int(value)
