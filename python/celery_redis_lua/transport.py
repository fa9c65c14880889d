"""The kombu transport: connections, the event-loop hooks and ``drain_events``.

Consuming, per channel, in rounds: the non-blocking consume script delivers
what is ready (up to the QoS headroom); then, while QoS allows, one BZMPOP
across the channel's queues waits on the server (bounded by
``blocking_timeout`` and by the next ETA) and claim delivers what it popped.
Fanout queues do the same with their streams and XREAD. In Celery's event
loop the waits are sockets registered with the hub; without it (plain kombu,
gevent, eventlet) ``drain_events`` select()s on them. Either way the
upkeep (the visibility heartbeat) runs every ``visibility_timeout / 3`` and the sweep every
``sweep_interval``; while the loop stands still (a warm shutdown draining the pool,
a reconnect, a task on the solo pool) a watchdog thread runs the upkeep in its place
(watchdog.py). The upkeep also keeps expiring queues, their bindings and their fanout
groups alive: it runs three times per x-expires of the shortest-lived queue consumed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import ssl as ssl_module
import time
from typing import Any

import redis
from kombu.transport import virtual
from kombu.utils.objects import cached_property

from .blocking import BlockingRead
from .calls import Declared
from .channel import Channel
from .options import TransportOptions, parse_options
from .watchdog import Watchdog

logger = logging.getLogger(__name__)

# A blocking wait whose reply is this late (beyond its own timeout) sits on a dead socket.
OVERDUE_GRACE_SECONDS = 5.0
# drain_events wakes at least this often to run the upkeep and the sweep; in Celery's
# event loop a timer checks as often whether they are due.
MAX_SELECT_SECONDS = 1.0
# Upkeep refreshes an expiring queue (and its bindings and groups) this many times per x-expires.
UPKEEPS_PER_EXPIRY = 3

SECURE_SCHEMES = frozenset({"redisluas", "rediss"})


def _redis_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    connection_errors = (
        redis.ConnectionError, redis.AuthenticationError, redis.TimeoutError,
        redis.BusyLoadingError, redis.exceptions.TryAgainError, ConnectionError, socket.error,
        IOError, OSError, InterruptedError,
    )
    channel_errors = (redis.DataError, redis.exceptions.InvalidResponse, redis.ResponseError)
    return virtual.Transport.connection_errors + connection_errors, (
        virtual.Transport.channel_errors + channel_errors)


class Transport(virtual.Transport):
    """kombu transport for Redis 7+ and Valkey on the celery-redis-lua scripts."""

    Channel = Channel
    polling_interval = None  # never sleep between polls: the waits block on the server
    default_port = 6379
    driver_type = "redis"
    driver_name = "celery-redis-lua"
    connection_errors, channel_errors = _redis_errors()
    # Only a lost connection is worth a reconnect and retry; a script refusing its input
    # (ScriptError, a channel error) must reach the caller once, as it is.
    recoverable_connection_errors = connection_errors
    recoverable_channel_errors = ()

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options: TransportOptions = parse_options(client.transport_options)
        super().__init__(client, **kwargs)
        self.polling_interval = None
        self.channels_polled: set[Channel] = set()
        # What this connection knows of its queues, shared by its channels as kombu shares
        # its binding state: the arguments in force (from declare) and the fanout bindings.
        self.declared: dict[str, Declared] = {}
        self.fanout_queues: dict[str, tuple[str, str]] = {}  # queue -> (exchange, routing key)
        self._last_upkeep = time.monotonic()
        self._next_sweep = time.monotonic()
        # Runs the upkeep from a thread while the event loop stands still.
        self.watchdog = Watchdog(self.upkeep_interval, self.upkeep_from_watchdog)

    def driver_version(self) -> str:
        return redis.__version__

    # -- connections ------------------------------------------------------------------------

    @cached_property
    def db(self) -> int:
        vhost = self.client.virtual_host or 0
        if isinstance(vhost, str):
            vhost = vhost.strip("/") or 0
        try:
            return int(vhost)
        except ValueError:
            raise ValueError(f"the broker URL's database must be a number, got {vhost!r}") from None

    def connection_params(self) -> dict[str, Any]:
        conninfo, options = self.client, self.options
        params: dict[str, Any] = {
            "host": conninfo.hostname or "127.0.0.1",
            "port": conninfo.port or self.default_port,
            "username": conninfo.userid or None,
            "password": conninfo.password or None,
            "db": self.db,
            "max_connections": options.max_connections,
            "socket_timeout": options.socket_timeout,
            "socket_connect_timeout": options.socket_connect_timeout,
            "socket_keepalive": options.socket_keepalive,
            "socket_keepalive_options": options.socket_keepalive_options,
            "health_check_interval": options.health_check_interval,
            # No retry_on_timeout: redis-py would resend a script whose reply timed out, and a
            # resent publish stores a message twice, a resent consume strands a batch in flight.
            "client_name": options.client_name,
        }
        if options.credential_provider is not None:
            params["credential_provider"] = options.credential_provider
            params.pop("username")
            params.pop("password")
        tls = conninfo.ssl or options.ssl
        if not tls and getattr(conninfo, "transport_cls", None) in SECURE_SCHEMES:
            tls = {"ssl_cert_reqs": ssl_module.CERT_NONE}  # as kombu does for rediss://
        if tls:
            params["connection_class"] = redis.SSLConnection
            if isinstance(tls, dict):
                params.update(tls)
        host = params["host"]
        if "://" in host:  # redislua+socket:///path/to/redis.sock
            scheme, _, path = host.partition("://")
            if scheme != "socket":
                raise ValueError(f"unsupported broker host {host!r}; use socket:///path for a Unix socket")
            for tcp_only in ("host", "port", "socket_connect_timeout", "socket_keepalive",
                             "socket_keepalive_options"):
                params.pop(tcp_only, None)
            params["connection_class"] = redis.UnixDomainSocketConnection
            params["path"] = "/" + path.lstrip("/")
        return params

    @cached_property
    def pool(self) -> redis.ConnectionPool:
        return redis.ConnectionPool(**self.connection_params())

    def new_client(self) -> redis.Redis:
        return redis.Redis(connection_pool=self.pool)

    def close_connection(self, connection: Any) -> None:
        self.watchdog.stop()
        self._unregister_from_loop()
        super().close_connection(connection)
        if "pool" in self.__dict__:
            self.pool.disconnect()

    def _unregister_from_loop(self) -> None:
        """Replaced by register_with_event_loop; nothing to undo without an event loop."""

    # -- consuming rounds -------------------------------------------------------------------

    def poll_round(self, channel: Channel) -> int:
        """Deliver what is ready now and start the waits that are not pending."""
        delivered = 0
        if channel.queue_wait.pending is None and channel.queues_polled and channel.qos.can_consume():
            count, wake_in_ms = channel.consume_now()
            delivered += count
            if channel.qos.can_consume():
                channel.start_queue_wait(wake_in_ms)
        if channel.stream_wait.pending is None and channel.fanout_polled:
            delivered += channel.consume_fanout_now()
            channel.start_stream_wait()
        for wait in (channel.queue_wait, channel.stream_wait):
            if wait.overdue(OVERDUE_GRACE_SECONDS + self.options.health_check_interval):
                logger.warning("celery-redis-lua: a blocking wait got no reply in time; reconnecting")
                wait.disconnect()
        return delivered

    @staticmethod
    def on_wait_readable(channel: Channel, wait: BlockingRead) -> int:
        if wait.pending is None:
            wait.disconnect()  # nothing expected: the server closed the connection
            return 0
        if wait is channel.queue_wait:
            return channel.on_queue_wait_readable()
        return channel.on_stream_wait_readable()

    def run_periodic(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_upkeep >= self.upkeep_interval():
            self.upkeep()
        if force or now >= self._next_sweep:
            self._next_sweep = now + self.options.sweep_interval
            self.sweep()

    def upkeep_interval(self) -> float:
        """How often the upkeep runs: every visibility_timeout / 3 for the deadlines in
        flight, and three times per x-expires of the shortest-lived queue consumed here, so
        that a queue (its bindings and groups) with a live consumer never expires."""
        interval = self.options.heartbeat_interval
        for channel in list(self.channels_polled):
            expires = channel.shortest_expiry_ms()
            if expires:
                interval = min(interval, expires / 1000 / UPKEEPS_PER_EXPIRY)
        return interval

    def upkeep(self) -> None:
        """The event loop's upkeep: keep in flight and alive what the channels hold, and
        tell the watchdog the loop ran it."""
        self._last_upkeep = time.monotonic()
        self.watchdog.loop_beat()
        self.run_upkeep()

    def run_upkeep(self, *, from_loop: bool = True) -> None:
        for channel in list(self.channels_polled):
            channel.upkeep(from_loop=from_loop)

    def upkeep_from_watchdog(self) -> None:
        self.run_upkeep(from_loop=False)

    def sweep(self) -> None:
        for channel in list(self.channels_polled):
            channel.sweep()

    # -- without an event loop --------------------------------------------------------------

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        start = time.monotonic()
        while True:
            self.run_periodic()
            if sum(self.poll_round(channel) for channel in list(self.channels_polled)):
                return
            waits = {
                wait.fileno(): (channel, wait)
                for channel in list(self.channels_polled)
                for wait in (channel.queue_wait, channel.stream_wait)
                if wait.pending is not None and wait.fileno() is not None
            }
            remaining = None if timeout is None else timeout - (time.monotonic() - start)
            if remaining is not None and remaining <= 0:
                raise TimeoutError()
            step = MAX_SELECT_SECONDS if remaining is None else min(remaining, MAX_SELECT_SECONDS)
            if not waits:
                time.sleep(min(step, 0.05))
                continue
            readable, _, _ = select.select(list(waits), [], [], step)
            delivered = sum(self.on_wait_readable(*waits[fd]) for fd in readable)
            if delivered:
                return

    # -- with Celery's event loop -----------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Poll in the hub's ticks, read waits when their sockets are readable. After a
        reconnect Celery registers the new transport too: the old one unregisters when its
        connection closes, and never removes a reader it does not own (fds get reused)."""
        registered: dict[int, BlockingRead] = {}
        # Deliveries made during a tick schedule Celery's work (early acks, for one) with
        # hub.call_soon, which the hub runs only after its next poll returns; the solo pool
        # then waited out the next timer (up to blocking_timeout) between prefetch batches.
        # A byte on this pipe makes that poll return at once.
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)

        def on_wake() -> None:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)

        def wake() -> None:
            with contextlib.suppress(BlockingIOError):
                os.write(wake_write, b"!")

        def on_readable(channel: Channel, wait: BlockingRead) -> None:
            self.on_wait_readable(channel, wait)

        def owned(fd: int, wait: BlockingRead) -> bool:
            reader = loop.readers.get(fd)
            return reader is not None and reader[1][1:] == (wait,)

        def on_tick() -> None:
            for channel in list(self.channels_polled):
                if self.poll_round(channel):
                    wake()
                for wait in (channel.queue_wait, channel.stream_wait):
                    fd = wait.fileno()
                    if wait.pending is not None and fd is not None and not (
                            registered.get(fd) is wait and owned(fd, wait)):
                        loop.add_reader(fd, on_readable, channel, wait)
                        registered[fd] = wait
            for fd, wait in list(registered.items()):
                if wait.fileno() != fd:
                    if owned(fd, wait):
                        loop.remove_reader(fd)
                    del registered[fd]

        def unregister() -> None:
            loop.on_tick.discard(on_tick)
            for timer in timers:
                timer.cancel()
            for fd, wait in list(registered.items()):
                if owned(fd, wait):
                    loop.remove_reader(fd)
            registered.clear()
            loop.remove_reader(wake_read)
            for fd in (wake_read, wake_write):
                with contextlib.suppress(OSError):
                    os.close(fd)

        loop.add_reader(wake_read, on_wake)
        loop.on_tick.add(on_tick)
        timers = [loop.call_repeatedly(MAX_SELECT_SECONDS, self.run_periodic)]
        loop.call_soon(self.sweep)
        self._unregister_from_loop = unregister
