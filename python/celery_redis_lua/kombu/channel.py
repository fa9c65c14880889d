"""kombu glue: a virtual Channel whose every operation is a script call.

The channel holds no protocol logic: publish, consume, ack, reject, declare, bind, purge and
delete each map to one script (lua/). Here is the bookkeeping kombu needs (which queues are
consumed, with or without ack) and what the keeper (keeper.py) keeps alive. The consuming
round and the sweep are in consuming.py, fanout streams in fanout.py, acks and prefetch
accounting in qos.py, the queue arguments' checks in arguments.py, later publishes in routes.py.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import deque
from typing import Any

import redis
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from redis.cluster import RedisCluster

from ..protocol import together
from ..protocol.envelope import dumps, publish_arguments
from ..protocol.fence import redeclare, wait_out
from ..protocol.group import publish_confirmed
from ..protocol.library import ScriptLibrary
from ..protocol.ops import Delivery, StaleRoute
from ..protocol.retry import DelayedRetry
from ..protocol.shards import shard_count
from ..protocol.unconfirmed import Send
from ..protocol.waits import BlockingRead
from .arguments import MAX_PRIORITY, ms_argument
from .consuming import ConsumingMixin
from .exchange import EXCHANGE_TYPES
from .fanout import FanoutMixin
from .keeper import KEEPER
from .qos import QoS
from .routes import Publishing, RouteCache, close_unconfirmed, put_later
from .sharding import ShardingMixin

logger = logging.getLogger(__name__)

# The pattern field of a fanout binding (kombu leaves it empty; fanout lookups ignore it).
FANOUT_PATTERN = "fanout"


class Channel(ShardingMixin, ConsumingMixin, FanoutMixin, virtual.Channel):
    """A kombu channel on the celery-redis-lua scripts."""

    QoS = QoS
    supports_fanout = True
    # kombu's exchange types, but a topic '*' matches one word on every kombu (exchange.py).
    exchange_types = dict(EXCHANGE_TYPES)  # noqa: RUF012 (kombu instantiates it per channel)
    min_priority = 0
    max_priority = MAX_PRIORITY
    default_priority = 0
    connection: Any  # the Transport (typed loosely: the transport module imports this one)

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.options = options = connection.options
        self.keys = self.options.keyspace(connection.db)
        self.client = connection.new_client()
        self.lib = ScriptLibrary(self.client, self.keys, self.options.policy, hold_connection=True)
        # What has not landed: acks, failed rejects, unconfirmed publishes (outbox.py).
        unconfirmed = None if options.confirm_publish else (options.publish_pipeline,
                                                            options.publish_flush_delay)
        self.outbox = KEEPER.outbox(self.lib, options.ack_flush_delay, unconfirmed)
        self.unconfirmed = self.outbox.publishes  # None with confirm_publish (the default)
        self.routes = RouteCache(self.lib, connection.shards.members)
        self.init_sharding()
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
        self._undelivered: deque[tuple[Delivery, bool]] = deque()  # consuming.py _deliver_all
        connection.check_server(self.client)  # connection errors surface now, as kombu expects
        connection.poller.channels.add(self)

    @property
    def state(self) -> Any:
        """kombu's binding state, of the connection. A closed channel has none: an entity still
        bound to it after a reconnect meets a lost connection here, which kombu's ensure()
        answers by reviving it on a new channel (an AttributeError no retry handles)."""
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
        if self.unconfirmed is not None or together.current() is not None:
            self._send = Send(message, exchange, routing_key, kwargs)
        try:
            if not exchange:
                return super().basic_publish(message, exchange, routing_key, **kwargs)
            self._inplace_augment_message(message, exchange, routing_key)
            return self._deliver(message, exchange, routing_key, Publishing(), **kwargs)
        finally:
            self._send = None

    def _inplace_augment_message(self, message: dict[str, Any], exchange: str, routing_key: str) -> None:
        """kombu's, without a delivery tag: delivery sets it (queue and message id, envelope.py),
        so kombu's uuid4 would only cost a urandom call and ~55 unread bytes per message. A
        text body (JSON, Celery's default) goes in as it is: base64 would store a third more
        bytes and hide the task's arguments from redis-cli. A binary one is base64 as in stock
        kombu; every kombu consumer decodes both (no ``body_encoding`` means none)."""
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

    def settle_unconfirmed(self, *, flush: bool = True, timeout: float | None = None) -> None:
        """Unconfirmed publishes: send what is pending (``flush``; its sockets give up after ``timeout``),
        publish again what a stale route refused (not where stored), raise the refused (unconfirmed.py)."""
        if self.unconfirmed is None:
            return
        if flush:
            self.unconfirmed.flush(timeout)
        for send in self.unconfirmed.take_stale():
            self._deliver(send.message, send.exchange, send.routing_key,
                          Publishing(fresh=True, stored=send.stored), **send.kwargs)
        self.unconfirmed.check()

    def _lookup(self, exchange: str, routing_key: str, default: str | None = None) -> list[str]:
        """kombu's, but a cached table that routes the key nowhere is looked up again before the
        message is called undeliverable (a bind elsewhere since)."""
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
        logical, queue = queue, self.shard_to_publish_to(queue, message)  # itself if not sharded
        if publishing is not None and self.stored_in(logical, publishing.stored):
            return  # stored before a refused route sent us round again (a shard of it may have)
        args = publish_arguments(message, self.options.message_ttl_ms)
        exchange = message["properties"]["delivery_info"].get("exchange")
        looked_up = publishing.looked_up_ms if publishing is not None and not publishing.fresh else None
        route = (exchange, looked_up) if exchange and looked_up is not None else None  # a cached route
        outgoing = args.outgoing(dumps(message), route)
        if put_later(self, queue, outgoing):  # unconfirmed, or in a confirm_together() block
            return
        # Waits out a fence and, for a task (sent again, stored once), a cluster slot's failover (fence.py).
        failover = self.options.reconnect_window if self.is_cluster and outgoing.task_id else 0
        wait_out(lambda: publish_confirmed(self.lib, queue, outgoing, grouped=self.options.group_commit),
                 self.options.fence_timeout, failover=failover)
        if publishing is not None:
            publishing.stored.add(logical)

    # -- queues and bindings ----------------------------------------------------------------

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        """Declare through the script (it keeps stored arguments when none are given, refuses
        different ones); the expiry in force decides how often the queue is kept alive."""
        arguments = kwargs.get("arguments") or {}
        expires = ms_argument(queue, arguments, "x-expires")
        if expires is None:
            expires = self.options.queue_expires_ms
        try:
            retry = DelayedRetry.from_arguments(arguments) or self.options.delayed_retry
        except ValueError as error:
            raise ValueError(f"queue {queue!r}: {error}") from None
        declare = {"expires_ms": expires, "message_ttl_ms": ms_argument(queue, arguments, "x-message-ttl"),
                   "max_priority": ms_argument(queue, arguments, "x-max-priority"), "retry": retry,
                   "consumer_timeout_ms": ms_argument(queue, arguments, "x-consumer-timeout")}
        # A sharded queue is itself and its shards, declared alike (protocol/shards.py).
        for member in [queue, *self.connection.shards.declare(queue, shard_count(queue, arguments))]:
            self._declare(member, **declare)

    def _declare(self, queue: str, **kwargs: Any) -> None:
        """Declare ``queue``; stored arguments out of range (an older version's, or set by
        hand) do not stop it: the scripts apply them as their bound, and the log names them."""
        declared = redeclare(self.lib, queue, kwargs, self.options.fence_timeout,
                             self.connection.client.as_uri() if self.is_cluster else None)
        self.connection.declared[queue] = declared
        if declared.consumer_timeout_ms:  # stored by whoever declared it first
            self.connection.consumer_timeouts[queue] = declared.consumer_timeout_ms
        else:
            self.connection.consumer_timeouts.pop(queue, None)
        if declared.out_of_range:
            logger.warning("celery-redis-lua: queue %r has stored arguments out of range: %s; past its "
                           "bound one is applied as the bound (10 years, priority 255), one that is no "
                           "number as not set (delete the queue and declare it again to set them)",
                           queue, ", ".join(declared.out_of_range))

    def _expires_ms(self, queue: str) -> int | None:
        declared = self.connection.declared.get(queue)
        return declared.expires_ms if declared else None

    def binding_lifetime_ms(self, queue: str) -> int | None:
        """An expiring queue's bindings go stale max(x-expires, the floor) after their refresh."""
        expires = self._expires_ms(queue)
        return None if expires is None else max(expires, self.options.binding_lifetime_floor_ms)

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> dict[str, Any]:
        """kombu's Queue(max_priority=, message_ttl=, expires=) as RabbitMQ's x- arguments."""
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        """Delete the queue's keys whether or not this process knows its bindings (those it
        knows are removed too)."""
        if if_empty and self._size(queue):
            return
        for exchange, routing_key, arguments in self.state.queue_bindings(queue):
            meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
            self._unbind(exchange, queue, self._binding_member(exchange, *meta))
        self.state.queue_bindings_delete(queue)
        self.forget_logical(queue)

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
        """Unbind; if something was removed, cached tables (any process) are refused for ``queue``."""
        if self.lib.unbind(exchange, [member]):
            self.routes.changed(exchange, [queue])

    def _forget_queue(self, queue: str) -> None:
        """Delete the queue's keys, then its groups on the fanout exchanges its record names
        (whichever connection bound it); a group is in its stream's slot: a call each."""
        exchanges = dict.fromkeys(self.lib.delete(queue).fanout_exchanges)
        KEEPER.withdraw(self, queue)
        fanout = self.connection.fanout_queues.pop(queue, None)
        if fanout is not None:
            exchanges[fanout[0]] = None
        if exchanges:
            self.lib.run_many([self.lib.calls.fanout_unbind(exchange, queue) for exchange in exchanges])
        self.connection.declared.pop(queue, None)
        self.connection.consumer_timeouts.pop(queue, None)

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
            self.refuse_sharded_fanout(queue, exchange)
            self.connection.fanout_queues[queue] = (exchange, (routing_key or "").replace("#", "*"))
            # Recorded with the queue before the group is made: a delete from anywhere finds it.
            self._declare(queue, fanout_exchange=exchange)
            wait_out(lambda: self.lib.run(self.fanout_bind_call(queue)), self.options.fence_timeout)
        member = self._binding_member(exchange, routing_key, pattern, queue)
        lifetime = self.binding_lifetime_ms(queue)
        added = wait_out(lambda: self.lib.bind(exchange, [member], lifetime_ms=lifetime),
                         self.options.fence_timeout)
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

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str,
                *args: Any, **kwargs: Any) -> None:
        self._unbind(exchange, queue, self._binding_member(exchange, routing_key, pattern, queue))
        self.forget_logical(queue)

    # -- consuming --------------------------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        self.settle_unconfirmed()
        if no_ack:
            self._no_ack_queues.update(self.connection.shards.members(queue))
        result = super().basic_consume(queue, no_ack, *args, **kwargs)
        self._keep_alive(queue)
        self._restart_waits()
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            for member in self.connection.shards.members(queue):
                self._no_ack_queues.discard(member)
                KEEPER.withdraw(self, member)
            self._leave_fanout([queue])
        self._restart_waits()
        return result

    def basic_recover(self, requeue: bool = False) -> None:
        """Redeliver every unacked message now (a closing channel adopts them instead)."""
        if not requeue:
            raise NotImplementedError("celery-redis-lua does not support recover(requeue=False)")
        self.qos.hand_back_all()

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        self.settle_unconfirmed()
        for delivery in self.lib.consume(self.members_turned(queue), 1, no_ack=no_ack).deliveries:
            payload = self._decode_or_reject(delivery, no_ack)
            if payload is not None:
                message = self.Message(payload, channel=self)
                if not no_ack:
                    KEEPER.take(self, self.lib, [delivery], self.connection.consumer_timeouts)
                    self.qos.append(message, message.delivery_tag)
                return message
        return None

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        raise NotImplementedError("celery-redis-lua consumes through Transport.drain_events")

    # -- periodic work ----------------------------------------------------------------------

    def _keep_alive(self, queue: str) -> None:
        """Register with the keeper what keeps ``queue`` alive while this channel consumes it:
        with an x-expires, refresh its keys, this connection's bindings and its fanout group
        three times per x-expires (a consumed queue never expires, nor its routes)."""
        expires, calls = self._expires_ms(queue), []
        if expires and queue in self._active_queues:
            # A fanout queue's too (meta records its bindings); a sharded queue's shards too.
            calls = [self.lib.calls.extend(member, []) for member in self.connection.shards.members(queue)]
            if queue in self.connection.fanout_queues:
                calls.append(self.fanout_bind_call(queue))
            for exchange, routing_key, arguments in self.state.queue_bindings(queue):
                meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
                calls.append(self.lib.calls.bind(exchange, [self._binding_member(exchange, *meta)],
                                                 lifetime_ms=self.binding_lifetime_ms(queue)))
        KEEPER.keep_alive(self, queue, self.lib, calls, (expires or 0) / 3000)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        # Its publishes and acks go before it does (acks after a batch on the wire), the
        # waits and the calls within the exit budget: a broker that hangs must not hang a close.
        deadline = KEEPER.deadline()
        refused = close_unconfirmed(self, deadline)
        self.connection.poller.channels.discard(self)
        for wait in self.waits():
            wait.bound(deadline)
        self._restart_waits(closing=True)
        self._leave_fanout(list(self._fanout_read))
        KEEPER.withdraw(self)
        self.outbox.send(deadline=deadline)
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
