"""The keeper: all the kombu adapter does off the caller's stack, in one thread per process.

One table holds the deliveries consumes took with acks, from the moment the reply is read
(a consume hands kombu its messages one at a time, and a solo task blocks the loop inside
the first) until their ack, reject or hand-back lands. Each is held by the channel while it
is open, by its kombu ``Message`` once the channel closed (an *orphan*: Celery may still
ack it after reconnecting), and is *settling* once its ack or reject is asked for (never
handed back, still extended, so a call refused during a failover lands in time). On
deadlines, never reading a kombu object, the thread:

- extends every held deadline a third of the visibility before it lapses, whatever the
  consumer's loop is doing (a solo task, a warm shutdown, a reconnect), up to an x-consumer-timeout;
- hands back, counted, what nobody holds any more (a dropped Message or channel, what a
  closed channel never handed kombu), running the cycle collector on a back-off while
  orphans wait (Celery's requests are in reference cycles);
- runs the keep-alive calls channels register for their expiring queues, bindings and
  fanout groups (three times per x-expires), until they withdraw them;
- sends each channel's outbox (outbox.py) when due.

It sleeps until the earliest deadline and ends when there is none. At exit what is held is
handed back and the outboxes sent (one budget, EXIT_BUDGET_SECONDS, which bounds the calls
too, not only the waits), then it ticks no more; a forked child starts empty. A SIGKILLed
process takes it along, so the visibility timeout still returns a dead worker's messages.
What the table holds, the hand-back calls and the exit's report are in held.py.
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..protocol.library import ScriptLibrary
from ..protocol.ops import Delivery
from ..protocol.outbox import Outbox
from ..protocol.runner import Call
from .held import Held, KeepAlive, Key, Taken, hand_back_groups, report_left, run_keep_alives

logger = logging.getLogger(__name__)

ORPHAN_CHECK_SECONDS = 1.0  # a dropped Message is noticed within this long
# The collector runs this long after an orphan arrives, then at doubling intervals up to
# GC_MAX_SECONDS: a long task must not cost a collection every few seconds.
GC_FIRST_SECONDS, GC_MAX_SECONDS = 2.0, 60.0
BUSY_SECONDS = 0.01  # the thread's pause when another thread is ticking
RETRY_SECONDS = 1.0  # a failed extend or keep-alive is tried again this soon at most
# At exit, everything left gets this long together, and a closing channel its acks: the
# waits for other threads and the calls themselves (their sockets give up), so a broker that
# hangs without a reset cannot hang a close or the exit. The one bound of both.
EXIT_BUDGET_SECONDS = 10.0


class Keeper:
    """The process's one keeper (:data:`KEEPER`)."""

    def __init__(self) -> None:
        self._hooks = False
        self.reset()

    def reset(self) -> None:
        """Empty, fresh locks, no thread: a forked child leaves the parent's to the parent."""
        for outbox in list(getattr(self, "_outboxes", ())):
            outbox.forked()
        # Re-entrant: kombu closes a channel from a weakref finalizer, which the cycle
        # collector may run in a thread that holds the lock (orphan() then re-enters).
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._ticking = threading.Lock()  # one tick at a time: two would hand back twice
        self._taken: dict[ScriptLibrary, Taken] = {}  # live channels' (libraries hash by identity)
        self._orphans: dict[Key, Held] = {}  # closed or dropped channels'
        self._alive: dict[tuple[int, str], KeepAlive] = {}
        self._outboxes: weakref.WeakSet[Outbox] = weakref.WeakSet()  # every channel's
        self._sending: set[Outbox] = set()  # those with something to send (held until empty)
        self._extend_due = self._orphans_due = math.inf
        self._next_gc, self._gc_gap = math.inf, GC_FIRST_SECONDS
        self._paused = 0.0  # after a tick's part failed, no tick before this (monotonic)
        self._exit_deadline = math.inf  # set by at_exit: no tick after it, closes end by then
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def clear(self) -> None:
        """Forget everything (tests: what a failed test left must not be retried later)."""
        with self._lock:
            self._taken.clear()
            self._orphans.clear()
            self._alive.clear()
            self._sending.clear()
            self._extend_due = self._orphans_due = math.inf
            self._wake.notify()

    def __len__(self) -> int:
        """Deliveries held: taken and not yet settled (their ack or reject not landed)."""
        return sum(map(len, self._taken.values())) + len(self._orphans)

    def holds(self, lib: ScriptLibrary, queue: str, message_id: str) -> bool:
        taken = self._taken.get(lib)
        if taken is not None and (message_id in taken.live[queue] or message_id in taken.settling[queue]):
            return True
        return (lib, queue, message_id) in self._orphans

    def live(self, lib: ScriptLibrary, queue: str, message_id: str) -> bool:
        """Taken by ``lib``'s open channel, its ack or reject not asked for."""
        taken = self._taken.get(lib)
        return taken is not None and message_id in taken.live.get(queue, ())

    # -- the held table --------------------------------------------------------------------

    def take(self, owner: Any, lib: ScriptLibrary, deliveries: Sequence[Delivery],
             timeouts: Mapping[str, int] | None = None) -> None:
        """A consume reply was read: ``owner`` (the channel whose library ``lib`` is) holds
        ``deliveries`` now; ``timeouts``: the x-consumer-timeout (ms) of queues with one."""
        if not deliveries:
            return
        with self._lock:
            taken = self._taken.get(lib)
            if taken is None:
                taken = self._taken[lib] = Taken(weakref.ref(owner))
            for d in deliveries:
                taken.live[d.queue][d.id] = d.delivery_count
            now = time.monotonic()
            self._extend_due = min(self._extend_due, now + lib.policy.heartbeat_seconds,
                                   taken.time_out(lib, deliveries, timeouts or {}, now))
            # Woken on every consume reply, not only when the deadline moves earlier: without
            # the wake a Celery worker's hub refilled in smaller batches (0.70 consume calls
            # per task against 0.60) and ran threads early ack 5 % slower (64ea431, reverted;
            # docs/bench/flow-unused-ab-20261204.md). Why the wake helps is not pinned down.
            self._start()

    def settling(self, lib: ScriptLibrary, queue: str, message_id: str) -> int | None:
        """Its ack or reject is asked for: never handed back from now (the caller may drop
        its Message at once), extended until :meth:`release`. Returns the delivery count it
        was taken with (None: not held)."""
        with self._lock:
            taken = self._taken.get(lib)
            if taken is not None:
                count = taken.live[queue].pop(message_id, None)
                if count is not None:
                    taken.settling[queue][message_id] = count
                    return count
                if message_id in taken.settling[queue]:
                    return taken.settling[queue][message_id]
            held = self._orphans.get((lib, queue, message_id))
            if held is None:
                return None
            held.settling = True
            return held.count

    def release(self, lib: ScriptLibrary, queue: str, ids: Iterable[str]) -> None:
        """The deliveries' ack, reject or hand-back landed (or was given up)."""
        with self._lock:
            taken = self._taken.get(lib)
            if taken is not None:
                settling, live = taken.settling[queue], taken.live[queue]
                for message_id in ids:
                    if settling.pop(message_id, None) is None:
                        live.pop(message_id, None)
                    taken.deadlines.pop((queue, message_id), None)
            if self._orphans:
                for message_id in ids:
                    self._orphans.pop((lib, queue, message_id), None)

    def orphan(self, lib: ScriptLibrary, unacked: Iterable[tuple[str, str, Any]]) -> None:
        """``lib``'s channel closes: its (queue, id, Message) deliveries stay held by their
        Messages; what it took but never handed kombu is handed back now, within the exit
        budget (a close must not hang on a broker that does). The thread, woken, does the
        rest; so it does the hand-back if it is ticking now."""
        self._adopt(lib, unacked)
        del unacked  # our references must not keep the Messages alive
        if os.getpid() != self._pid or self._exit_deadline < math.inf or \
                not self._ticking.acquire(blocking=False):
            return
        try:
            self._check_orphans(time.monotonic(), self.deadline())
        finally:
            self._ticking.release()

    def _adopt(self, lib: ScriptLibrary, unacked: Iterable[tuple[str, str, Any]]) -> None:
        now = time.monotonic()
        messages = {(queue, message_id): message for queue, message_id, message in unacked}
        with self._lock:
            taken = self._taken.pop(lib, None)
            for held in self._orphaned(lib, taken, now):
                message = messages.get((held.queue, held.id))
                if message is not None:
                    held.holder = weakref.ref(message)
            self._gc_gap, self._next_gc = GC_FIRST_SECONDS, now
            self._orphans_due = now
            self._start()

    def _orphaned(self, lib: ScriptLibrary, taken: Taken | None, now: float) -> list[Held]:
        """A channel's deliveries become orphans (lock held)."""
        held = list(taken.orphans(lib, now)) if taken is not None else []
        for h in held:
            self._orphans[(lib, h.queue, h.id)] = h
        return held

    # -- keep-alive calls ------------------------------------------------------------------

    def keep_alive(self, owner: Any, name: str, lib: ScriptLibrary, calls: list[Call[Any]],
                   interval: float) -> None:
        """Run ``calls`` every ``interval`` seconds while ``owner`` lives (replacing what it
        registered under ``name``); none: withdraw them."""
        if not calls:
            return self.withdraw(owner, name)
        with self._lock:
            self._alive[(id(owner), name)] = KeepAlive(
                weakref.ref(owner), lib, calls, interval, time.monotonic() + interval)
            self._start()

    def withdraw(self, owner: Any, name: str | None = None) -> None:
        """Stop ``owner``'s keep-alive calls (those under ``name``; default all)."""
        with self._lock:
            for key in [k for k in self._alive if k[0] == id(owner) and name in (None, k[1])]:
                del self._alive[key]

    # -- outboxes -------------------------------------------------------------------------

    def outbox(self, lib: ScriptLibrary, delay: float, publishes: tuple[int, float] | None = None) -> Outbox:
        """A channel's outbox (``publishes``: the unconfirmed pipeline's size and delay)."""
        outbox = Outbox(lib, delay, self._outbox_due, self.release, publishes)
        with self._lock:
            self._outboxes.add(outbox)
        return outbox

    def _outbox_due(self, outbox: Outbox) -> None:
        with self._lock:
            self._sending.add(outbox)
            self._start()

    # -- the thread ------------------------------------------------------------------------

    def _start(self) -> None:
        """Make sure the thread runs and knows the new deadlines (lock held)."""
        if not self._hooks:  # installed on first use, not on import
            self._hooks = True
            os.register_at_fork(after_in_child=self.reset)  # the parent's are the parent's
            atexit.register(self.at_exit)
        if self._thread is None and os.getpid() == self._pid and self._exit_deadline == math.inf:
            self._thread = threading.Thread(target=self._run, name="celery-redis-lua-keeper", daemon=True)
            self._thread.start()
        self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                due = min(self._extend_due, self._orphans_due, *(o.due for o in self._sending),
                          *(alive.due for alive in self._alive.values()))
                # Nothing to keep: the thread ends, _start makes another (not after the exit).
                if due == math.inf or self._exit_deadline < math.inf:
                    self._thread = None
                    return
                due = max(due, self._paused)  # a failing part must not spin the thread
                if due > time.monotonic():
                    self._wake.wait(due - time.monotonic())
                    continue
            if not self.tick():  # another thread is ticking (a close, the exit): let it finish
                time.sleep(BUSY_SECONDS)

    def tick(self) -> bool:
        """Do what is due, unless another thread is (False). An error stays in its part: it
        is logged, the other parts run, and the thread pauses RETRY_SECONDS before the next
        tick (an exception escaping would end the thread, and every extension with it)."""
        # After the exit nothing more: kombu's own exit hooks, which run after ours, hand
        # deliveries here (QoS.restore_unacked), and the exit has reported what is left.
        if os.getpid() != self._pid or self._exit_deadline < math.inf or \
                not self._ticking.acquire(blocking=False):
            return False
        try:
            now = time.monotonic()
            parts: list[Callable[[float], None]] = [self._send_outboxes]
            if now >= self._orphans_due:
                parts.append(self._check_orphans)
            if now >= self._extend_due:
                parts.append(self._extend)
            parts.append(self._run_keep_alives)
            for part in parts:
                try:
                    part(now)
                except Exception:
                    logger.exception("celery-redis-lua: the keeper's %s failed; going on", part.__name__)
                    self._paused = now + RETRY_SECONDS
        finally:
            self._ticking.release()
        return True

    # -- what a tick does ------------------------------------------------------------------

    def _check_orphans(self, now: float, deadline: float = math.inf) -> None:
        """Hand back the orphans nobody holds any more (by ``deadline``, if any)."""
        if now >= self._next_gc:
            self._next_gc = now + self._gc_gap
            self._gc_gap = min(self._gc_gap * 2, GC_MAX_SECONDS)
            gc.collect()
        with self._lock:
            dropped = [h for h in self._orphans.values() if not h.settling and h.holder() is None]
            self._orphans_due = math.inf  # _hand_back sets it again while orphans remain
        self._hand_back(dropped, now, deadline)

    def _extend(self, now: float) -> None:
        """Push every held deadline forward; hand back what a dropped channel held."""
        dropped: list[Held] = []
        ids: dict[tuple[ScriptLibrary, str], list[str]] = defaultdict(list)
        by_lib: dict[ScriptLibrary, list[Call[Any]]] = defaultdict(list)
        with self._lock:
            for lib, taken in list(self._taken.items()):
                if taken.holder() is None:  # dropped without a close: its deliveries are orphans
                    del self._taken[lib]
                    dropped += [h for h in self._orphaned(lib, taken, now) if not h.settling]
                    continue
                for table in (taken.live, taken.settling):
                    for queue, held in table.items():
                        ids[(lib, queue)] += held
                by_lib[lib] += taken.bound_by_timeouts(lib, ids, now)  # x-consumer-timeout
            for h in self._orphans.values():
                if h.settling or h.holder() is not None:
                    ids[(h.lib, h.queue)].append(h.id)
            groups = {key: group for key, group in ids.items() if group}
            libs = {lib for lib, _ in groups} | {lib for lib, calls in by_lib.items() if calls}
            self._extend_due = now + min((lib.policy.heartbeat_seconds for lib in libs), default=math.inf)
        for (lib, queue), group in groups.items():
            by_lib[lib].append(lib.calls.extend(queue, group))
        for lib, calls in by_lib.items():
            try:
                lib.run_many(calls)
            except Exception as error:  # the broker may be down: soon again
                logger.warning("celery-redis-lua: could not extend %d held deliveries (%s); trying "
                               "again", sum(len(c.args) - 1 for c in calls), error)
                with self._lock:
                    self._extend_due = min(self._extend_due, now + RETRY_SECONDS)
        self._hand_back(dropped, now)

    def _run_keep_alives(self, now: float) -> None:
        with self._lock:
            for key in [k for k, alive in self._alive.items() if alive.owner() is None]:
                del self._alive[key]
            due = [alive for alive in self._alive.values() if alive.due <= now]
        run_keep_alives(due, now, RETRY_SECONDS)

    def _send_outboxes(self, now: float, timeout: float = 0) -> None:
        """Send the due outboxes (skipping one a close is sending); forget emptied ones."""
        with self._lock:
            due = [o for o in self._sending if o.due <= now]
        for outbox in due:
            outbox.send(timeout)
        with self._lock:
            self._sending = {o for o in self._sending if o.due != math.inf}

    def _hand_back(self, dropped: list[Held], now: float, deadline: float = math.inf) -> None:
        """Give ``dropped`` orphans back, counted; what fails stays until GIVE_UP_SECONDS."""
        for lib, queue, group in hand_back_groups(dropped, now, deadline):
            with self._lock:
                for h in group:
                    if self._orphans.get((lib, queue, h.id)) is h:
                        del self._orphans[(lib, queue, h.id)]
        with self._lock:
            if any(not h.settling for h in self._orphans.values()):
                self._orphans_due = min(self._orphans_due, now + ORPHAN_CHECK_SECONDS)

    def at_exit(self) -> None:
        """Send every outbox, hand back what is held, and log what is left, all within
        EXIT_BUDGET_SECONDS: the waits for a send on the wire or a tick under way end then, and
        so do the calls made here (their sockets give up), even if the broker hangs."""
        if not (self._taken or self._orphans or self._outboxes) or os.getpid() != self._pid:
            return
        now = time.monotonic()
        deadline = self._exit_deadline = now + EXIT_BUDGET_SECONDS
        for outbox in {*self._sending, *self._outboxes}:  # with replies unread too
            outbox.send(everything=True, deadline=deadline)
        # The hand-backs are the ticks': one still under way (its calls may hang) keeps them.
        if self._ticking.acquire(timeout=max(0.0, deadline - time.monotonic())):
            try:
                self._hand_back(self._unsettled(now), now, deadline)
            finally:
                self._ticking.release()
        report_left(list(self._outboxes), self._unsettled(now))

    def deadline(self) -> float:
        """When a close starting now must be done (monotonic): EXIT_BUDGET_SECONDS from now,
        or the exit's own deadline once it began (a close that the exit sets off, kombu's
        hooks run after ours, shares its budget)."""
        return min(time.monotonic() + EXIT_BUDGET_SECONDS, self._exit_deadline)

    def _unsettled(self, now: float) -> list[Held]:
        """Everything held whose ack or reject was not asked for, all orphans now (the exit:
        a settling one is finished, it is the outbox's to report)."""
        with self._lock:
            for lib in list(self._taken):
                self._orphaned(lib, self._taken.pop(lib), now)
            return [h for h in self._orphans.values() if not h.settling]


KEEPER = Keeper()
