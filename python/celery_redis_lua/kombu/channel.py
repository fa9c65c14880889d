"""kombu glue: a virtual Channel whose every operation is a script call.

The channel holds no protocol logic of its own: publish, consume, ack, reject,
declare, bind, purge and delete each map to one script (see lua/). What lives
here is bookkeeping kombu needs (which queues are consumed, with or without
ack), the queue-side steps of a consuming round (consume now, block on the queues'
wake lists, consume again when woken) that the poller runs, and what it asks the keeper
(keeper.py) to keep alive. Fanout streams are in fanout.py, acks and prefetch accounting in qos.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import redis
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from redis.cluster import RedisCluster
from redis.crc import key_slot

from ..protocol.envelope import BadEnvelope, delivered_envelope, dumps, publish_arguments
from ..protocol.library import ScriptLibrary
from ..protocol.ops import Consumed, Delivery, StaleRoute
from ..protocol.runner import Call
from .fanout import FanoutMixin
from .keeper import KEEPER
from .outbox import Batch
from .poller import BlockingRead
from .qos import QoS
from .routes import Publishing, RouteCache
from .settle import hand_back, reject
from .unconfirmed import Send, UnconfirmedPublishError

logger = logging.getLogger(__name__)

# Server-side floor for a BLPOP/XREAD block, so a due-now hint never spins.
MIN_BLOCK_SECONDS = 0.005
# A prefetch slot freed while the channel still holds more than half its window waits up to
# this long for others before the consume call that refills it: the prefork pool frees its
# slots one task at a time, and refilling each alone cost the hub a round trip per task
# (0.82 consume calls per task against 0.08 on threads). Bounded, so a pool child left idle
# by a long task elsewhere waits no longer than this for its next message.
REFILL_GATHER_SECONDS = 0.002
# A closing channel waits at most this long for a batch of its acks already on the wire.
CLOSE_ACK_TIMEOUT_SECONDS = 10.0
# The pattern field of a fanout binding (kombu leaves it empty; fanout lookups ignore it).
FANOUT_PATTERN = "fanout"


@dataclass(frozen=True)
class InFlight:
    """A consume sent without waiting for its reply: the acks it carries in front of it (one
    call per queue), the queues and the room it asked for, the calls as they were written."""

    acks: Batch | None
    group: list[str]
    room: int
    calls: list[Call[Any]]


class Channel(FanoutMixin, virtual.Channel):
    """A kombu channel on the celery-redis-lua scripts."""

    QoS = QoS
    supports_fanout = True
    min_priority = 0
    max_priority = 255
    default_priority = 0
    connection: Any  # the Transport (typed loosely: the transport module imports this one)

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.options = connection.options
        self.keys = self.options.keyspace(connection.db)
        self.client = connection.new_client()
        self.lib = ScriptLibrary(self.client, self.keys, self.options.policy, hold_connection=True)
        # What has not landed: acks, failed rejects, unconfirmed publishes (outbox.py).
        unconfirmed = None if self.options.confirm_publish else (self.options.publish_pipeline,
                                                                 self.options.publish_flush_delay)
        self.outbox = KEEPER.outbox(self.lib, self.options.ack_flush_delay, unconfirmed)
        self.unconfirmed = self.outbox.publishes  # None with confirm_publish (the default)
        self.routes = RouteCache(self.lib)
        self._publishing: Publishing | None = None
        self._send: Send | None = None
        self.consumer_name = f"{socket.gethostname()}:{os.getpid()}:{self.channel_id}"
        self._no_ack_queues: set[str] = set()
        self._fanout_next_id: dict[str, str] = {}
        self._fanout_read: set[str] = set()  # fanout queues this channel read as its consumer
        self.is_cluster = isinstance(self.client, RedisCluster)
        # The blocking waits, by the cluster slot of their keys (None: not a cluster, one each).
        self.queue_waits: dict[int | None, BlockingRead] = {}
        self.stream_waits: dict[int | None, BlockingRead] = {}
        self._refill_due: float | None = None  # a refill held back until then (monotonic)
        connection.check_server(self.client)  # connection errors surface now, as kombu expects
        connection.poller.channels.add(self)

    @property
    def state(self) -> Any:
        """kombu's binding state, of the connection. A closed channel has none: a kombu entity
        still bound to it after a reconnect (an exchange declared before it) meets a lost
        connection here, which kombu's ensure() answers by reviving the entity on a new
        channel, instead of an AttributeError no retry handles (a chaos run met one)."""
        connection = self.connection
        if connection is None:
            raise redis.ConnectionError("celery-redis-lua: this channel was closed (by a reconnect?)")
        return connection.state

    # -- publishing -------------------------------------------------------------------------

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any) -> Any:
        """Route through the cached binding table (routes.py); when publish refuses a cached
        route, look the table up again and publish to the queues that did not store it yet."""
        if self.unconfirmed is not None:
            self.settle_unconfirmed(flush=False)  # what the last write's replies said
            self._send = Send(message, exchange, routing_key, kwargs)
        try:
            if not exchange:
                return super().basic_publish(message, exchange, routing_key, **kwargs)
            self._inplace_augment_message(message, exchange, routing_key)
            return self._deliver(message, exchange, routing_key, Publishing(), **kwargs)
        finally:
            self._send = None

    def _inplace_augment_message(self, message: dict[str, Any], exchange: str, routing_key: str) -> None:
        """kombu's, without a delivery tag: delivery sets the tag (the queue and the message id,
        envelope.py), so kombu's uuid4 here would only cost a urandom call and ~55 bytes of
        every stored message that nobody reads (the script-level producers leave it out too).
        A text body (what kombu's JSON serializer and Celery's default produce) goes into the
        envelope as it is, without ``body_encoding``: base64 would store a third more bytes of
        it in Redis and hide the task's arguments from whoever reads the message with
        redis-cli. A binary one (pickle, msgpack, compressed) is base64 as in stock kombu.
        Every kombu consumer decodes both (an absent ``body_encoding`` means none)."""
        properties, body = message["properties"], message["body"]
        if not isinstance(body, str):
            message["body"], properties["body_encoding"] = self.encode_body(body, self.body_encoding)
        properties["delivery_info"].update(exchange=exchange, routing_key=routing_key)

    def _deliver(self, message: dict[str, Any], exchange: str, routing_key: str, publishing: Publishing,
                 **kwargs: Any) -> Any:
        self._publishing = publishing
        try:
            while True:
                try:
                    return self.typeof(exchange).deliver(message, exchange, routing_key, **kwargs)
                except StaleRoute:
                    publishing.fresh = True
        finally:
            self._publishing = None

    def settle_unconfirmed(self, *, flush: bool = True) -> None:
        """Unconfirmed publishes (confirm_publish=False): send what is pending (``flush``),
        publish again those a stale route refused (fresh lookup, synchronously, skipping the
        queues that stored them), and raise what the server refused (unconfirmed.py)."""
        if self.unconfirmed is None:
            return
        if flush:
            self.unconfirmed.flush()
        for send in self.unconfirmed.take_stale():
            self._deliver(send.message, send.exchange, send.routing_key,
                          Publishing(fresh=True, stored=send.stored), **send.kwargs)
        self.unconfirmed.check()

    def _lookup(self, exchange: str, routing_key: str, default: str | None = None) -> list[str]:
        """kombu's, except that a cached table that routes the key nowhere is looked up
        again before the message is called undeliverable (a bind elsewhere since)."""
        publishing = self._publishing
        if exchange and publishing is not None and not publishing.fresh:
            try:
                found = self.typeof(exchange).lookup(self.get_table(exchange), exchange, routing_key, default)
            except KeyError:
                found = []
            if found or publishing.looked_up_ms is None:
                return found or super()._lookup(exchange, routing_key, default)
            publishing.fresh = True
        return super()._lookup(exchange, routing_key, default)

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        publishing = self._publishing
        if publishing is not None and queue in publishing.stored:
            return  # stored before a refused route sent us round again
        args = publish_arguments(message, self.options.message_ttl_ms)
        exchange = message["properties"]["delivery_info"].get("exchange")
        cached = publishing is not None and not publishing.fresh and publishing.looked_up_ms is not None
        route = (exchange, publishing.looked_up_ms) if cached and exchange and publishing else None
        call = self.lib.calls.publish(queue, dumps(message), priority=args.priority, eta_ms=args.eta_ms,
                                      ttl_ms=args.ttl_ms, task_id=args.task_id, route=route)
        if self.unconfirmed is not None and self._send is not None:
            self.unconfirmed.add(self._send, queue, call)  # stored (or refused) when it goes
            return
        self.lib.run(call)
        if publishing is not None:
            publishing.stored.add(queue)

    # -- queues and bindings ----------------------------------------------------------------

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        """Declare through the script, which keeps the queue's stored arguments when none are
        given and refuses different ones; remember the arguments in force (their expiry
        decides how often this connection keeps the queue and its bindings alive)."""
        arguments = kwargs.get("arguments") or {}
        expires = _ms_argument(queue, arguments, "x-expires")
        if expires is None:
            expires = self.options.queue_expires_ms
        self.connection.declared[queue] = self.lib.declare(
            queue, expires_ms=expires, message_ttl_ms=_ms_argument(queue, arguments, "x-message-ttl"),
            max_priority=_ms_argument(queue, arguments, "x-max-priority"))

    def _expires_ms(self, queue: str) -> int | None:
        declared = self.connection.declared.get(queue)
        return declared.expires_ms if declared else None

    def binding_lifetime_ms(self, queue: str) -> int | None:
        """Bindings of an expiring queue go stale max(x-expires, binding_lifetime_floor) after
        their last refresh; the others never."""
        expires = self._expires_ms(queue)
        return None if expires is None else max(expires, self.options.binding_lifetime_floor_ms)

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
            self._unbind(exchange, queue, self._binding_member(exchange, *meta))
        self.state.queue_bindings_delete(queue)
        self._forget_queue(queue)

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: Any = None, **kwargs: Any) -> None:
        """Remove the binding from the broker's table (kombu's virtual channel only edits the
        list get_table returned, which for this transport is a copy)."""
        self.state.binding_delete(queue, exchange, routing_key)
        if exchange:
            meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
            self._unbind(exchange, queue, self._binding_member(exchange, *meta))
        self._keep_alive(queue)

    def _unbind(self, exchange: str, queue: str, member: str) -> None:
        """Unbind; when something was removed, cached copies of the table (in any process)
        are refused from now on for ``queue``."""
        if self.lib.unbind(exchange, [member]):
            self.routes.changed(exchange, [queue])

    def _forget_queue(self, queue: str) -> None:
        """Delete the queue's keys, then its groups on the fanout exchanges it is bound to:
        delete names those the queue's record holds, whichever connection bound it. A group
        is in its stream's slot, so each goes in a call of its own (idempotent)."""
        exchanges = dict.fromkeys(self.lib.delete(queue).fanout_exchanges)
        KEEPER.withdraw(self, queue)
        fanout = self.connection.fanout_queues.pop(queue, None)
        if fanout is not None:
            exchanges[fanout[0]] = None
        if exchanges:
            self.lib.run_many([self.lib.calls.fanout_unbind(exchange, queue) for exchange in exchanges])
        self.connection.declared.pop(queue, None)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.lib.exists(queue)

    def _binding_member(self, exchange: str, routing_key: str, pattern: str, queue: str) -> str:
        if self.typeof(exchange).type == "fanout":
            pattern = FANOUT_PATTERN  # lets producers that never declared the exchange route it
        return self.keys.binding_member(routing_key, pattern, queue)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        """The fanout table is the connection's, like kombu's binding state: a queue bound on
        one channel is served on any other channel of the connection."""
        if self.typeof(exchange).type == "fanout":
            self.connection.fanout_queues[queue] = (exchange, (routing_key or "").replace("#", "*"))
            # Recorded with the queue (its slot) before the group is made: deleting the
            # queue from any connection then finds the group (lua/delete.lua).
            self.connection.declared[queue] = self.lib.declare(queue, fanout_exchange=exchange)
            self.lib.run(self.fanout_bind_call(queue))
        member = self._binding_member(exchange, routing_key, pattern, queue)
        added = self.lib.bind(exchange, [member], lifetime_ms=self.binding_lifetime_ms(queue))
        if added and self.typeof(exchange).type != "fanout":  # fanout publishes never route by table
            self.routes.changed(exchange)
        self._keep_alive(queue)

    def get_table(self, exchange: str) -> list[tuple[str, ...]]:
        return list(self.routes.get(exchange, self._publishing))

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        """An exchange this process never declared is a fanout exchange when its bindings
        say so (Celery does not declare Broadcast queues before publishing to them)."""
        if (exchange and exchange not in self.state.exchanges
                and any(pattern == FANOUT_PATTERN for _, pattern, _ in self.get_table(exchange))):
            self.state.exchanges[exchange] = {"type": "fanout", "durable": True,
                                              "auto_delete": False, "arguments": {}, "table": []}
        return super().typeof(exchange, default)

    def _size(self, queue: str) -> int:
        self.settle_unconfirmed()  # what this channel published counts (unconfirmed.py)
        return self.lib.size(queue)

    def _purge(self, queue: str) -> int:
        self.settle_unconfirmed()  # what this channel published counts (unconfirmed.py)
        return self.lib.purge(queue)

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str,
                *args: Any, **kwargs: Any) -> None:
        self._unbind(exchange, queue, self._binding_member(exchange, routing_key, pattern, queue))
        self._forget_queue(queue)

    # -- consuming --------------------------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        self.settle_unconfirmed()
        if no_ack:
            self._no_ack_queues.add(queue)
        result = super().basic_consume(queue, no_ack, *args, **kwargs)
        self._keep_alive(queue)
        self._restart_waits()
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._no_ack_queues.discard(queue)
            KEEPER.withdraw(self, queue)
            self._leave_fanout([queue])
        self._restart_waits()
        return result

    def _restart_waits(self) -> None:
        """The consumed queues changed: end pending waits (they name the old keys), so the
        next round blocks on the new set at once instead of after blocking_timeout."""
        if self.closed:
            return
        for wait in list(self.queue_waits.values()):
            if wait.batch is not None:  # an in-flight consume: its replies come within ms
                self._consume_arrived(wait, then_wait=False)
                continue
            self._give_back_wake(wait.cancel())
        for wait in list(self.stream_waits.values()):
            wait.cancel()

    def _give_back_wake(self, woken: Any) -> None:
        """A wait cancelled just as its BLPOP took a wake token: the token goes back for
        another consumer (this one consumes in its next round anyway, or is closing). Lost
        with the connection, it would cost the other consumers one blocking_timeout."""
        if woken:
            with contextlib.suppress(redis.RedisError, OSError):
                self.lib.unpop(self.keys.queue_of(woken[0]))

    # -- the blocking waits -----------------------------------------------------------------

    def _wait(self, waits: dict[int | None, BlockingRead], key: str) -> BlockingRead:
        """The wait for ``key``'s slot: on a cluster, on a connection to the node that owns
        the slot (asked again at every reconnect); else the channel's one wait of its kind."""
        slot = key_slot(key.encode()) if self.is_cluster else None
        wait = waits.get(slot)
        if wait is None:
            if self.is_cluster:
                client: RedisCluster = self.client
                wait = BlockingRead(
                    lambda: client.get_redis_connection(client.get_node_from_key(key)).connection_pool,
                    on_redirect=client.nodes_manager.initialize)
            else:
                wait = BlockingRead(self.client.connection_pool, on_lost=self._consume_lost)
            waits[slot] = wait
        return wait

    @property
    def queue_wait(self) -> BlockingRead:
        """The wait of the first queue group (the only one when not on a cluster)."""
        groups = self.lib.slot_groups(self.queues_polled)
        return self._wait(self.queue_waits, self.keys.queue(groups[0][0]) if groups else "")

    def waits(self) -> list[BlockingRead]:
        return [*self.queue_waits.values(), *self.stream_waits.values()]

    def on_wait_readable(self, wait: BlockingRead) -> int:
        if any(wait is w for w in self.queue_waits.values()):
            return self.on_queue_wait_readable(wait)
        return self.on_stream_wait_readable(wait)

    def basic_recover(self, requeue: bool = False) -> None:
        """Redeliver every unacked message now (a closing channel adopts them instead)."""
        if not requeue:
            raise NotImplementedError("celery-redis-lua does not support recover(requeue=False)")
        self.qos.hand_back_all()

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        self.settle_unconfirmed()
        for delivery in self.lib.consume([queue], 1, no_ack=no_ack).deliveries:
            payload = self._decode_or_reject(delivery, no_ack)
            if payload is not None:
                message = self.Message(payload, channel=self)
                if not no_ack:
                    KEEPER.take(self, self.lib, [delivery])
                    self.qos.append(message, message.delivery_tag)
                return message
        return None

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        raise NotImplementedError("celery-redis-lua consumes through Transport.drain_events")

    def can_consume(self) -> bool:
        return bool(self.qos.can_consume())

    @property
    def queues_polled(self) -> list[str]:
        """Consumed queues that hold messages in ZSETs (fanout-bound ones read streams)."""
        fanout = self.connection.fanout_queues
        return [q for q in dict.fromkeys(self._active_queues) if q not in fanout]

    def headroom(self) -> int:
        """How many messages QoS lets this channel take now."""
        room = self.qos.can_consume_max_estimate()
        return self.options.consume_batch if room is None else min(room, self.options.consume_batch)

    def poll_queues(self) -> int:
        """Deliver what is ready in the consumed queues whose wait is not pending, then start
        their waits (one per slot group on a cluster, so a message on any node wakes us)."""
        if not self.queues_polled or not self.can_consume():
            return 0
        idle = [group for group in self.lib.slot_groups(self.queues_polled)
                if self._wait(self.queue_waits, self.keys.queue(group[0])).pending is None]
        if not idle:
            self._refill_due = None  # the pending waits refill the window
            return 0
        if self._gathering():
            return 0
        if self._consumes_in_flight(idle):
            self._send_consume(idle[0])
            return 0
        delivered, wake_in_ms = self.consume_now([queue for group in idle for queue in group])
        if self.can_consume():
            for group in idle:
                self.start_queue_wait(group, wake_in_ms)
        return delivered

    def refill_due(self) -> float | None:
        """When a refill :meth:`poll_queues` held back is due (monotonic), else None: the
        event loop must come back by then even if nothing else happens."""
        return self._refill_due

    def _gathering(self) -> bool:
        """Whether to hold the refill back: more than half the prefetch window is still
        held, and the first slot freed since the last refill has waited less than
        REFILL_GATHER_SECONDS. A window of one or two, or none, is refilled at once."""
        window, room = self.qos.prefetch_count, self.qos.can_consume_max_estimate()
        if not window or room is None or 2 * room >= window:
            self._refill_due = None
            return False
        now = time.monotonic()
        if self._refill_due is None:
            self._refill_due = now + REFILL_GATHER_SECONDS
        if now < self._refill_due:
            return True
        self._refill_due = None
        return False

    def consume_now(self, queues: list[str] | None = None) -> tuple[int, int | None]:
        """Deliver what is ready in ``queues`` (default: every consumed one); returns
        (delivered, wake_in_ms)."""
        queues = self.queues_polled if queues is None else queues
        delivered, wake = 0, None
        for no_ack, group in ((True, [q for q in queues if q in self._no_ack_queues]),
                              (False, [q for q in queues if q not in self._no_ack_queues])):
            room = self.headroom()
            if not group or room <= 0:
                continue
            consumed = self.lib.consume(group, room, no_ack=no_ack, run=self._run_with_acks)
            _log_expired(consumed.expired, group)
            delivered += self._deliver_all(consumed.deliveries, no_ack)
            if consumed.wake_in_ms is not None:
                wake = consumed.wake_in_ms if wake is None else min(wake, consumed.wake_in_ms)
        return delivered, wake

    # -- consumes in flight (Celery's event loop) ------------------------------------------

    def _consumes_in_flight(self, idle: list[list[str]]) -> bool:
        """Whether this round's consume goes out without waiting for its reply: in Celery's
        hub, which reads the reply when the wait's socket is readable and meanwhile feeds the
        pool, instead of the loop standing still for a round trip per refill (a prefork
        worker drains a prefilled queue 22-26% faster, docs/decisions.md). Where the
        consume and the acks it carries are one write (a standalone server or a Sentinel
        primary, no durability wait), and for queues consumed with acks (a no_ack message
        is gone once consumed: one that a closing channel never read would be lost)."""
        return (self.connection.poller.in_hub and len(idle) == 1 and self.lib.runner.batches_in_one_write
                and not any(queue in self._no_ack_queues for queue in idle[0]))

    def _send_consume(self, group: list[str]) -> None:
        """Send a consume for ``group`` (and the acks gathered meanwhile, in front of it) on
        the group's wait connection; :meth:`_consume_arrived` takes the replies."""
        room = self.headroom()
        acks = self.outbox.take()
        calls = [*(self.outbox.calls(acks) if acks else []), self.lib.calls.consume(group, room)]
        sent = InFlight(acks, group, room, calls)
        self._wait(self.queue_waits, self.keys.queue(group[0])).send_batch(
            lambda connection: self.lib.runner.wire(connection, calls), len(calls), sent,
            timeout=max(self.options.blocking_timeout, 1.0))

    def _consume_arrived(self, wait: BlockingRead, *, closing: bool = False, then_wait: bool = True) -> int:
        """Settle the acks an in-flight consume carried and deliver what it consumed (give
        it back instead when the channel closes, or its queue is no longer consumed here:
        nobody saw it); then, if it found fewer than it asked for, wait on the queues."""
        replies, sent = wait.read_batch()  # a lost connection: the acks went to the registry
        try:  # the calls that met NOSCRIPT (a flush, a failover) never ran: load, run them now
            results = self.lib.runner.rerun_noscript(sent.calls, replies, raise_on_error=False)
        except Exception as error:  # that run met a lost connection: the acks are sent again
            results = [error] * len(sent.calls)
        if sent.acks is not None:
            self.outbox.settle(sent.acks, results[:-1])
        consumed = results[-1]
        if isinstance(consumed, Exception):
            raise consumed
        _log_expired(consumed.expired, sent.group)
        polled = [] if closing else self.queues_polled
        unwanted = [d for d in consumed.deliveries if d.queue not in polled]
        for queue in dict.fromkeys(d.queue for d in unwanted):
            back = [d for d in unwanted if d.queue == queue]
            hand_back(self.lib, queue, [d.id for d in back], [d.delivery_count for d in back])
        delivered = self._deliver_all([d for d in consumed.deliveries if d.queue in polled], False)
        if then_wait and not closing and len(consumed.deliveries) < sent.room and self.can_consume():
            self.start_queue_wait([q for q in sent.group if q in polled], consumed.wake_in_ms)
        return delivered

    def _consume_lost(self, sent: InFlight) -> None:
        """An in-flight consume's replies will never be read: its acks go back to the outbox,
        to be sent again; what it consumed comes back after the
        visibility timeout, counted, as after a synchronous consume whose reply was lost."""
        if sent.acks is not None:
            lost = redis.ConnectionError("celery-redis-lua: the connection of an in-flight consume was lost")
            self.outbox.settle(sent.acks, [lost] * len(sent.acks.groups))

    def start_queue_wait(self, queues: list[str], wake_in_ms: int | None) -> bool:
        """Block on the wake lists of ``queues`` (consumed ones of one slot; bounded by
        blocking_timeout and by the next ETA) with BLPOP: it pops a token, never a message,
        so nothing is in limbo if this consumer dies while it waits. Returns whether a wait
        is now pending."""
        if not queues or self.headroom() <= 0:
            return False
        timeout = self.options.blocking_timeout
        if wake_in_ms is not None:
            timeout = min(timeout, wake_in_ms / 1000) if timeout else wake_in_ms / 1000
            timeout = max(timeout, MIN_BLOCK_SECONDS)
        keys = [self.keys.wake(q) for q in queues]
        self._wait(self.queue_waits, self.keys.queue(queues[0])).send("BLPOP", *keys, f"{timeout:.3f}",
                                                                      timeout=timeout)
        return True

    def on_queue_wait_readable(self, wait: BlockingRead) -> int:
        """Take an in-flight consume's replies, or a woken (or timed-out) wait: either way
        the queues are consumed now (the wait is no longer pending, so its group is polled)
        and the wait starts again; returns how many were delivered."""
        if wait.batch is not None:
            return self._consume_arrived(wait)
        wait.read()  # the token (or None: the block timed out); consume decides what is there
        return self.poll_queues()

    def _run_with_acks(self, call: Call[Consumed]) -> Consumed:
        """A consume of the loop, carrying this channel's gathered acks (outbox.py): a
        consumer's own round trip sends them, and the keeper makes no call of its own."""
        batch = self.outbox.take()
        if batch is None:
            return self.lib.run(call)
        (result,) = self.outbox.run(batch, [call])
        if isinstance(result, Exception):
            raise result
        return result

    def _deliver_all(self, deliveries: list[Delivery], no_ack: bool) -> int:
        """Hand kombu each delivery, held by this channel (keeper.py) from now: kombu takes
        them one at a time, and a solo task blocks inside the first."""
        if not no_ack:
            KEEPER.take(self, self.lib, deliveries)
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
                KEEPER.release(self.lib, delivery.queue, [delivery.id])
                reject(self.lib, delivery.queue, [delivery.id], requeue=False,
                       counts=[delivery.delivery_count])
            return None

    # -- periodic work ----------------------------------------------------------------------

    def _keep_alive(self, queue: str) -> None:
        """Register with the keeper what keeps ``queue`` alive while this channel consumes
        it: with an x-expires, the refresh of its keys, of the bindings this connection
        declared for it and of its fanout group, three times per x-expires, so that a queue
        with a live consumer never expires (nor its routes). Asked again when they change."""
        expires, calls = self._expires_ms(queue), []
        if expires and queue in self._active_queues:
            calls = [self.lib.calls.extend(queue, [])]  # a fanout queue's too: meta records its bindings
            if queue in self.connection.fanout_queues:
                calls.append(self.fanout_bind_call(queue))
            for exchange, routing_key, arguments in self.state.queue_bindings(queue):
                meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
                calls.append(self.lib.calls.bind(exchange, [self._binding_member(exchange, *meta)],
                                                 lifetime_ms=self.binding_lifetime_ms(queue)))
        KEEPER.keep_alive(self, queue, self.lib, calls, (expires or 0) / 3000)

    def sweep(self) -> None:
        queues = self.queues_polled
        if not queues:
            return
        report = self.lib.sweep(queues)
        where = "dead-lettered" if self.lib.policy.dead_letter_maxlen else "deleted"
        for dropped in report.dropped_messages:
            if dropped.reason == "expired":
                logger.warning("celery-redis-lua: message %s of queue %r expired (message TTL) "
                               "while it waited and was %s", dropped.id, dropped.queue, where)
            else:
                logger.error("celery-redis-lua: message %s of queue %r reached delivery_limit=%s "
                             "(x-delivery-count %s) and was %s", dropped.id, dropped.queue,
                             self.lib.policy.delivery_limit, dropped.delivery_count, where)
        unreported = report.limit_reached + report.expired - len(report.dropped_messages)
        if unreported > 0:
            logger.warning("celery-redis-lua: the sweep also %s %d more message(s) (TTL or "
                           "delivery limit) of queues %s", where, unreported, ", ".join(queues))
        if report.requeued or report.unclaimed:
            logger.info("celery-redis-lua: sweep restored %d timed-out and %d unclaimed messages",
                        report.requeued, report.unclaimed)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        refused = self._close_unconfirmed()
        self.connection.poller.channels.discard(self)
        for wait in list(self.queue_waits.values()):
            if wait.batch is not None:  # an in-flight consume: what it took goes back, counted
                with contextlib.suppress(redis.RedisError, OSError):  # lost: see _consume_lost
                    self._consume_arrived(wait, closing=True)
                continue
            self._give_back_wake(wait.cancel())
        for wait in list(self.stream_waits.values()):
            wait.cancel()
        self._leave_fanout(list(self._fanout_read))
        KEEPER.withdraw(self)
        self.outbox.send(timeout=CLOSE_ACK_TIMEOUT_SECONDS)  # its acks go before it does
        try:
            super().close()
        finally:
            for wait in self.waits():
                wait.close()
            self.lib.close()
            if not self.is_cluster:  # a cluster client is the connection's, shared by its channels
                self.client.close()
        if refused is not None:
            raise refused

    def _close_unconfirmed(self) -> UnconfirmedPublishError | None:
        """Send the unconfirmed publishes before the channel goes; what the server refused
        (or a lost connection took) is raised once the channel is closed."""
        if self.unconfirmed is None:
            return None
        try:
            self.settle_unconfirmed()
        except UnconfirmedPublishError as error:
            return error
        except Exception as error:  # a lost connection: the flush recorded what it took
            logger.warning("celery-redis-lua: unconfirmed publishes at close: %s", error)
            try:
                self.unconfirmed.check()
            except UnconfirmedPublishError as refused:
                return refused
        finally:
            self.unconfirmed.close()
        return None


def _log_expired(expired: int, queues: list[str]) -> None:
    if expired:
        logger.warning("celery-redis-lua: %d message(s) of queue(s) %s had expired (message TTL) "
                       "while they waited and were dead-lettered instead of delivered",
                       expired, ", ".join(queues))


def _ms_argument(queue: str, arguments: dict[str, Any], name: str) -> int | None:
    """A RabbitMQ queue argument (ms, or a priority), checked so a bad one names itself."""
    value = arguments.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"queue {queue!r}: argument {name!r} must be a non-negative number, "
                         f"got {value!r}")
    return int(value)
