"""Keeps in-flight deadlines moving while the event loop does not turn.

The visibility heartbeat normally runs on the consumer's event loop (Celery's hub, or
``drain_events``). That loop stops at times while tasks are still running: during a warm
shutdown (the pool drains, the hub is gone), while the worker reconnects, and for the whole
run of a task on ``--pool=solo``. The first long chaos run showed the cost: a warm shutdown
of a threads worker let the deadlines of its running 8-10 s tasks lapse (visibility 6 s),
another worker's sweep restored them, and they ran twice.

So each consuming transport has one daemon thread that wakes every half heartbeat
interval and, when the loop's own heartbeat is overdue by half an interval, extends the
deliveries itself. (Deliveries of closed channels have their own thread, in
:mod:`.orphans`.) Extending
is idempotent, so the rare overlap with the loop does no harm. The thread holds no
Message and changes nothing but deadlines; a SIGKILLed process takes it down with it, so
the visibility timeout still returns the messages of a dead worker.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Watchdog:
    """Calls ``beat`` when the event loop's last beat is older than ``interval() * 1.5``.
    With the loop's beats ``interval`` apart, a deadline ``3 * interval`` away is pushed
    forward at most ``2 * interval`` after the last beat, loop or not. ``interval`` is asked
    each time: it shrinks when a queue with a short x-expires is consumed."""

    def __init__(self, interval: Callable[[], float], beat: Callable[[], None]) -> None:
        # Weak references: a transport dropped without close() must not be kept alive (and
        # its deliveries extended) by its own watchdog; the thread ends when it is gone.
        self._interval = weakref.WeakMethod(interval)  # type: ignore[arg-type]
        self._beat = weakref.WeakMethod(beat)  # type: ignore[arg-type]
        self.last_beat = time.monotonic()
        self.fired = 0  # how often the watchdog stood in for the loop (for tests and logs)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def loop_beat(self) -> None:
        self.last_beat = time.monotonic()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="celery-redis-lua-watchdog",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def interval(self) -> float | None:
        interval = self._interval()
        return None if interval is None else interval()

    def _run(self) -> None:
        while True:
            interval = self.interval()
            if interval is None or self._stopped.wait(min(interval / 2, 1.0)):
                return
            if time.monotonic() - self.last_beat <= 1.5 * interval:
                continue
            beat = self._beat()
            if beat is None:
                return
            self.fired += 1
            try:
                beat()
                self.last_beat = time.monotonic()
            except Exception as error:  # the broker may be down: the next round tries again
                logger.warning("celery-redis-lua: watchdog heartbeat failed: %s", error)
            finally:
                del beat  # hold the transport only while beating
