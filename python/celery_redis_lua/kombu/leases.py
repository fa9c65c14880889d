"""The one keeper of in-flight deadlines while no event loop keeps them.

Deadlines (and the expiry of queues with x-expires) are normally kept alive by the
consumer's event loop: each connection's :class:`~.poller.Poller` runs the upkeep on its
own schedule (Celery's hub, or ``drain_events``). That loop stops at times while tasks
still run: during a warm shutdown (the pool drains, the hub is gone), while the worker
reconnects, and for the whole run of a task on ``--pool=solo``. And deliveries adopted
after their connection closed (:mod:`.orphans`) have no loop at all. The first long chaos
run showed the cost: a warm shutdown let the deadlines of running tasks lapse, another
worker's sweep restored them, and they ran twice.

So one daemon thread per process tends every *source* once a second, or four times per
the shortest interval of any source if that is shorter (a short visibility): a poller
whose loop's last upkeep is more than 1.5 intervals old runs the upkeep itself, so a
deadline ``3 * interval`` away is pushed forward at most ``1.75 * interval`` after the
loop's last one (``1.5 * interval`` plus one tick of 1 s, where that is less). With the
default visibility (300 s, an interval of 100 s) that leaves 149 s; a visibility of 3 s
leaves 1.25 s against a stall of the process (0.5 s while the tick was always 1 s). The
orphans registry sends its pending acks, hands back what was dropped and extends what is
held. Extending is idempotent, so an overlap
with the loop does no harm. Sources are held weakly (a connection dropped without
``close()`` is not kept alive, nor are its deliveries extended); the thread runs only
while there are any, and a forked child starts with none (the parent's are the parent's).
A SIGKILLed process takes the thread with it, so the visibility timeout still returns a
dead worker's messages.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)

TICK_SECONDS = 1.0  # the longest the thread sleeps between two tends
MIN_TICK_SECONDS = 0.05  # and the shortest, however short an interval
TICKS_PER_INTERVAL = 4  # tends per upkeep interval of the source that needs them most often


class Source(Protocol):
    def tend(self, now: float) -> None: ...

    def interval(self) -> float:
        """How often the source's upkeep comes due (seconds)."""
        ...


class Registry(Source, Protocol):
    """A source kept for the life of the process, tended while it holds anything."""

    def __len__(self) -> int: ...


class LeaseKeeper:
    def __init__(self) -> None:
        self._sources: weakref.WeakSet[Source] = weakref.WeakSet()
        self._permanent: list[Registry] = []  # the orphans registry
        self._lock = threading.Lock()
        # Set when a source arrives or asks for tending: the thread, maybe asleep for a whole
        # tick computed before that source (1 s), works out its period again at once. Without
        # it a consumer with a visibility of 0.9 s that joined a process already tending
        # others waited up to 1 s for its first stand-in: past its deadline.
        self._rethink = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._fork_hook = False

    def watch(self, source: Source) -> None:
        """Tend ``source`` from the thread (weakly held) while it lives."""
        with self._lock:
            self._sources.add(source)
            self._start()
        self._rethink.set()

    def forget(self, source: Source) -> None:
        with self._lock:
            self._sources.discard(source)

    def watch_always(self, source: Registry) -> None:
        with self._lock:
            if source not in self._permanent:
                self._permanent.append(source)

    def wake(self) -> None:
        """Something needs tending (a delivery was adopted): make sure the thread runs."""
        with self._lock:
            self._start()
        self._rethink.set()

    def _start(self) -> None:
        if not self._fork_hook:  # installed on first use, not on import
            self._fork_hook = True
            os.register_at_fork(after_in_child=self._after_fork_in_child)
        if (self._thread is None or not self._thread.is_alive()) and os.getpid() == self._pid:
            self._thread = threading.Thread(target=self._run, name="celery-redis-lua-leases", daemon=True)
            self._thread.start()

    def tick_seconds(self) -> float:
        """The sleep between two tends: a quarter of the shortest interval of any source,
        between MIN_TICK_SECONDS and TICK_SECONDS."""
        intervals = [source.interval() / TICKS_PER_INTERVAL
                     for source in [*list(self._sources), *self._permanent]]
        return max(MIN_TICK_SECONDS, min([TICK_SECONDS, *intervals]))

    def _run(self) -> None:
        while True:
            self._rethink.wait(self.tick_seconds())  # the tending period, cut short by a newcomer
            self._rethink.clear()
            now = time.monotonic()
            for source in [*list(self._sources), *self._permanent]:
                try:
                    source.tend(now)
                except Exception as error:  # the broker may be down: the next tick tries again
                    logger.warning("celery-redis-lua: keeping deliveries alive failed: %s", error)
            with self._lock:
                if not self._sources and not any(len(registry) for registry in self._permanent):
                    self._thread = None
                    return

    def _after_fork_in_child(self) -> None:
        self._sources = weakref.WeakSet()
        self._lock, self._rethink = threading.Lock(), threading.Event()
        self._thread, self._pid = None, os.getpid()


KEEPER = LeaseKeeper()
