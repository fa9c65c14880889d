"""The consuming round, and the blocking waits it is made of.

Per channel, a round delivers what is ready now, then waits: one BLPOP across its queues'
wake lists, one XREAD across its fanout streams (consuming.py, fanout.py); a readable wait
means consume again. In Celery's hub the waits are sockets registered with it (and a
consume can go out on a wait's connection, :meth:`BlockingRead.send_batch`); without it
(plain kombu, gevent, eventlet) :meth:`Poller.drain_events` select()s on them. Either way
the sweep runs from here.

The waits themselves (and the consumes sent on their connections) are
:class:`~celery_redis_lua.protocol.waits.BlockingRead`.
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

from ..protocol.waits import BlockingRead

logger = logging.getLogger(__name__)

# A blocking wait whose reply is this late (beyond its own timeout) sits on a dead socket, or
# one a partition cut (a silent drop: no reset, and TCP's retransmissions back off).
OVERDUE_GRACE_SECONDS = 5.0
# drain_events wakes at least this often for the periodic work; in Celery's hub a timer does.
TICK_SECONDS = 1.0


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
