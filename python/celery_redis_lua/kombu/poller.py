"""The consuming round, and the blocking waits it is made of.

Per channel, a round delivers what is ready now, then waits: one BLPOP across its queues'
wake lists, one XREAD across its fanout streams (consuming.py, fanout.py); a readable wait
means consume again. In Celery's hub the waits are sockets registered with it (and a
consume can go out on a wait's connection, :meth:`BlockingRead.send_batch`); without it
(plain kombu, gevent, eventlet) :meth:`Poller.drain_events` select()s on them. Either way
the sweep runs from here.

The waits and those consumes are the only commands sent outside redis-py's client (Lua cannot
block), without waiting for the reply so the loop can watch the socket. ``cancel()`` ends a
wait at once with CLIENT UNBLOCK from another connection, so shutting down never waits out
``blocking_timeout``; where that is refused (it is in ``@admin``; some managed services lack
it) the connection is closed instead: a BLPOP that had just popped loses a wake token, never
a message (the other consumers then wait out one ``blocking_timeout`` at most).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import redis

from ..protocol.runner import dedicated_connection, read_replies

logger = logging.getLogger(__name__)

# A blocking wait whose reply is this late (beyond its own timeout) sits on a dead socket.
OVERDUE_GRACE_SECONDS = 5.0
# How long a wait CLIENT UNBLOCK did not find (it answered 0) may take to reply before it is closed.
UNBLOCK_GRACE_SECONDS = 0.5
# A cluster node's answers to a blocking wait that mean "not here, not now": nothing popped.
REDIRECTED = (redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.TryAgainError,
              redis.exceptions.ClusterDownError)
# drain_events wakes at least this often for the periodic work; in Celery's hub a timer does.
TICK_SECONDS = 1.0


class BlockingRead:
    """One dedicated connection for blocking waits, made with ``pool``'s settings but kept
    outside it: a wait holds its connection for up to ``blocking_timeout``, and counted in the
    pool, a few channels' waits would leave too few connections for the acks of many
    greenlets or threads."""

    def __init__(self, pool: redis.ConnectionPool | Callable[[], redis.ConnectionPool], *,
                 on_redirect: Callable[[], None] = lambda: None,
                 on_lost: Callable[[Any], None] = lambda batch: None) -> None:
        # On a cluster, the pool of the node that owns the wait's slot, asked again at every
        # reconnect (a failover or a slot migration moves it).
        self._pool_of = pool if callable(pool) else (lambda: pool)
        self._on_redirect = on_redirect  # the slot moved (MOVED, ASK...): refresh the slot map
        # A pending batch's replies will never be read: its owner settles what it carried.
        self._on_lost = on_lost
        self.connection: Any = None
        self.pending: tuple[Any, ...] | None = None  # the command waiting for its reply
        self.batch: Any = None  # what a pending batch (send_batch) stands for, its owner's
        self._replies = 0  # how many replies the pending batch has
        self.sent_at = 0.0
        self.timeout = 0.0
        self._client_id: int | None = None
        self.can_unblock = True  # until the server refuses CLIENT ID or CLIENT UNBLOCK

    def _connect(self) -> Any:
        if self.connection is None or self.connection._sock is None:
            self.connection = dedicated_connection(self._pool_of())
            self.connection.connect()
            self._client_id = None
        return self.connection

    def fileno(self) -> int | None:
        sock = getattr(self.connection, "_sock", None)
        return sock.fileno() if sock is not None else None

    def send(self, *command: Any, timeout: float) -> None:
        """Send a blocking command whose server-side timeout is ``timeout`` seconds."""
        connection = self._connect()
        if self._client_id is None and self.can_unblock:
            connection.send_command("CLIENT", "ID")
            try:
                self._client_id = int(connection.read_response())
            except redis.ResponseError:  # not allowed (ACL): cancel() closes the connection
                self.can_unblock = False
        connection.send_command(*command)
        self.pending = command
        self.sent_at = time.monotonic()
        self.timeout = timeout

    def send_batch(self, wire: Callable[[Any], bytes], replies: int, batch: Any, *, timeout: float) -> None:
        """Write the ``replies`` commands ``wire(connection)`` packs without waiting for their
        replies (:meth:`read_batch` reads them). ``batch`` is the owner's record of what was
        sent; a write that fails hands it to ``on_lost`` before the error is raised."""
        try:
            connection = self._connect()
            connection.send_packed_command([wire(connection)], check_health=False)
        except BaseException:
            self.batch = batch
            self.disconnect()
            raise
        self.pending, self.batch, self._replies = ("batch",), batch, replies
        self.sent_at = time.monotonic()
        self.timeout = timeout

    def read_batch(self) -> tuple[list[Any], Any]:
        """The pending batch's replies (an error reply in its place, :func:`read_replies`)
        and its record. A read that fails disconnects, which hands the record to ``on_lost``."""
        batch, replies = self.batch, self._replies
        try:
            return read_replies(self.connection, replies), batch
        except BaseException:
            self.disconnect()
            raise
        finally:
            self.pending, self.batch = None, None

    def overdue(self, grace: float) -> bool:
        """The server should have answered by now (a half-open socket never says so); a block
        without timeout (blocking_timeout 0) never is."""
        return (self.pending is not None and self.timeout > 0
                and time.monotonic() - self.sent_at > self.timeout + grace)

    def read(self, timeout: float | None = None) -> Any:
        """The reply of the pending command (None when it timed out on the server). A wait
        the server ended with an UNBLOCKED error (its role changed: a primary demoted by a
        failover) is a lost connection: kombu reconnects, and finds the new primary."""
        try:
            if timeout is not None:
                return self.connection.read_response(timeout=timeout)
            return self.connection.read_response()
        except REDIRECTED:
            # A node that no longer (or not yet) serves the slot: nothing was popped.
            self.disconnect()
            self._on_redirect()
            return None
        except redis.ResponseError as error:
            if not str(error).startswith("UNBLOCKED"):
                raise
            self.disconnect()
            raise redis.ConnectionError(f"the server ended a blocking wait: {error}") from None
        finally:
            self.pending = None

    def cancel(self) -> Any:
        """End a pending wait now; returns whatever the server had already popped (or None).
        CLIENT UNBLOCK goes to the wait's own server (on a cluster, the node of its slot).
        Without CLIENT UNBLOCK the connection is closed (see the module's docstring)."""
        if self.pending is None or self.batch is not None:  # a batch: its owner reads it
            return None
        if self._client_id is None or not self.can_unblock:
            self.disconnect()
            return None
        try:
            unblocked = redis.Redis(connection_pool=self._pool_of()).execute_command(
                "CLIENT", "UNBLOCK", self._client_id)
        except redis.ResponseError:  # NOPERM, or a service without it: close from now on
            self.can_unblock = False
            self.disconnect()
            return None
        except (redis.RedisError, OSError):
            self.disconnect()
            return None
        try:
            # 0: the wait had just ended (its reply is on the way), or the server does not
            # know the id (a proxy in front of several servers): do not wait out its block.
            return self.read(None if unblocked else UNBLOCK_GRACE_SECONDS)
        except (redis.RedisError, OSError):
            self.disconnect()
            return None

    def disconnect(self) -> None:
        self.pending = None
        lost, self.batch = self.batch, None
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.disconnect()
        if lost is not None:
            self._on_lost(lost)

    def close(self) -> None:
        if self.connection is not None:
            self.disconnect()
            self.connection = None


class Consuming(Protocol):
    """What the poller needs of a channel: its waits, and the steps of a round."""

    def waits(self) -> list[BlockingRead]: ...
    def poll_queues(self) -> int: ...
    def refill_due(self) -> float | None: ...
    def poll_streams(self) -> int: ...
    def on_wait_readable(self, wait: BlockingRead) -> int: ...
    def sweep(self) -> None: ...


class Poller:
    """Owns the rounds of one connection's channels and the sweep, every ``sweep_interval``
    seconds."""

    def __init__(self, *, sweep_interval: float, overdue_grace: float) -> None:
        self.channels: set[Consuming] = set()
        self.sweep_interval = sweep_interval
        self.overdue_grace = overdue_grace
        self._next_sweep = time.monotonic()
        self._unregister: Callable[[], None] = lambda: None
        self.in_hub = False  # registered with Celery's event loop, which reads the waits' replies

    # -- a round --------------------------------------------------------------------------

    def poll_round(self, channel: Consuming) -> int:
        """Deliver what is ready now and start the waits that are not pending (one for queues,
        one for fanout streams; on a cluster, one of each per slot)."""
        delivered = channel.poll_queues() + channel.poll_streams()
        for wait in channel.waits():
            if wait.overdue(self.overdue_grace):
                logger.warning("celery-redis-lua: a blocking wait got no reply in time; reconnecting")
                wait.disconnect()
        return delivered

    @staticmethod
    def on_readable(channel: Consuming, wait: BlockingRead) -> int:
        if wait.pending is None:
            wait.disconnect()  # nothing expected: the server closed the connection
            return 0
        return channel.on_wait_readable(wait)

    def refill_due(self) -> float | None:
        """The earliest refill a channel held back (monotonic): the loop must not sleep past it."""
        return min((due for channel in list(self.channels) if (due := channel.refill_due()) is not None),
                   default=None)

    # -- periodic work ----------------------------------------------------------------------

    def run_periodic(self, force: bool = False) -> None:
        """The sweep, every ``sweep_interval`` (keeping things alive is the keeper's)."""
        now = time.monotonic()
        if force or now >= self._next_sweep:
            self._next_sweep = now + self.sweep_interval
            for channel in list(self.channels):
                channel.sweep()

    # -- without an event loop --------------------------------------------------------------

    def drain_events(self, timeout: float | None = None) -> None:
        start = time.monotonic()
        while True:
            self.run_periodic()
            if sum(self.poll_round(channel) for channel in list(self.channels)):
                return
            waits = {
                fd: (channel, wait)
                for channel in list(self.channels)
                for wait in channel.waits()
                if wait.pending is not None and (fd := wait.fileno()) is not None
            }
            remaining = None if timeout is None else timeout - (time.monotonic() - start)
            if remaining is not None and remaining <= 0:
                raise TimeoutError()
            step = TICK_SECONDS if remaining is None else min(remaining, TICK_SECONDS)
            refill = self.refill_due()
            if refill is not None:
                step = min(step, max(0.0, refill - time.monotonic()))
            if not waits:
                time.sleep(min(step, 0.05))
                continue
            readable, _, _ = select.select(list(waits), [], [], step)
            if sum(self.on_readable(*waits[fd]) for fd in readable):
                return

    # -- with Celery's event loop -----------------------------------------------------------

    def register(self, loop: Any) -> None:
        """Poll in the hub's ticks, read waits when their sockets are readable (:class:`HubRegistration`)."""
        self._unregister = HubRegistration(self, loop).unregister

    def unregister(self) -> None:
        self._unregister()
        self._unregister = lambda: None


class HubRegistration:
    """A poller registered with Celery's hub. After a reconnect Celery registers the new
    connection too: this one unregisters when it closes, and never removes a reader it does
    not own (fds get reused)."""

    def __init__(self, poller: Poller, loop: Any) -> None:
        self.poller, self.loop = poller, loop
        self.registered: dict[int, BlockingRead] = {}
        # Deliveries made during a tick schedule Celery's work (early acks) with call_soon,
        # which the hub runs only after its next poll returns: a byte on this pipe makes that
        # poll return at once (the solo pool would wait out a timer between batches).
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        # A warm shutdown (SIGTERM) only sets a flag the hub reads after its poll returns, and
        # Python resumes an interrupted poll; worker_shutting_down is sent from the signal
        # handler, so a byte then makes the poll return at once.
        self.shutting_down = _celery_signal("worker_shutting_down")
        if self.shutting_down is not None:
            self.shutting_down.connect(self.wake, weak=False)
        self.armed: float | None = None  # the due time of the last refill timer set
        loop.add_reader(self.wake_read, self.on_wake)
        loop.on_tick.add(self.on_tick)
        poller.in_hub = True
        # A weak reference: the hub's timer must not keep a closed connection's poller alive.
        periodic = weakref.WeakMethod(poller.run_periodic)
        self.timer = loop.call_repeatedly(TICK_SECONDS, lambda: (run := periodic()) and run())
        loop.call_soon(lambda: (run := periodic()) and run(force=False))

    def on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_read, 4096)

    def wake(self, **_: Any) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.wake_write, b"!")

    def owned(self, fd: int, wait: BlockingRead) -> bool:
        reader = self.loop.readers.get(fd)
        return reader is not None and reader[1][1:] == (wait,)

    def on_tick(self) -> None:
        for channel in list(self.poller.channels):
            if self.poller.poll_round(channel):
                self.wake()
            for wait in channel.waits():
                fd = wait.fileno()
                if wait.pending is not None and fd is not None and not (
                        self.registered.get(fd) is wait and self.owned(fd, wait)):
                    self.loop.add_reader(fd, self.poller.on_readable, channel, wait)
                    self.registered[fd] = wait
        for fd, wait in list(self.registered.items()):
            if wait.fileno() != fd:
                if self.owned(fd, wait):
                    self.loop.remove_reader(fd)
                del self.registered[fd]
        self.wake_for_refill()

    def wake_for_refill(self) -> None:
        """A refill held back sets a timer (one per due time), or the hub would sleep until the
        next tick; it reckons its poll's timeout before on_tick, so the byte on the pipe makes
        this poll return and the next one count the new timer."""
        due = self.poller.refill_due()
        if due is not None and due != self.armed:
            self.armed = due
            self.loop.call_later(max(0.0, due - time.monotonic()), lambda: None)
            self.wake()

    def unregister(self) -> None:
        self.poller.in_hub = False
        if self.shutting_down is not None:
            self.shutting_down.disconnect(self.wake)
        self.loop.on_tick.discard(self.on_tick)
        self.timer.cancel()
        for fd, wait in list(self.registered.items()):
            if self.owned(fd, wait):
                self.loop.remove_reader(fd)
        self.registered.clear()
        self.loop.remove_reader(self.wake_read)
        for fd in (self.wake_read, self.wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)


def _celery_signal(name: str) -> Any:
    """One of Celery's signals, or None where kombu's hub runs without Celery."""
    try:
        from celery import signals
    except ImportError:
        return None
    return getattr(signals, name, None)
