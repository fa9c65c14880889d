"""Deliveries that outlive their channel, and acks that could not reach the broker.

When a connection drops, kombu closes the channel and asks QoS to restore what is unacked.
Celery (5.7) keeps running the tasks it already gave its pool (on the threads pool, also
those still queued in the executor) and acks them through their old Message once it has
reconnected. Handing those back at close would run them twice. So at close the channel's
deliveries are *adopted* here instead:

- while something still holds a delivery's Message, its deadline keeps being pushed
  forward (as the channel's heartbeat did), and its ack or reject through the old Message
  reaches the scripts as usual;
- a Message dropped unacked (Celery discards what it had only prefetched) is handed back,
  counted as a delivery, on the next tick;
- an ack that met a lost connection is kept and sent again on the next ticks (acking is
  idempotent, and it also cancels a copy the sweep restored meanwhile), so a task that
  finished while the broker was unreachable does not run again;
- whatever is still adopted when the process exits is handed back then.

One registry per process (:data:`ORPHANS`): Celery opens a new kombu Connection, hence a new
Transport, after a reconnect, so this cannot belong to a transport. The lease keeper's
thread (:mod:`.leases`) tends it while it holds anything (the event loop may be
reconnecting or gone). Redis calls are made outside the lock; acks arrive from pool
threads too. The exit and fork hooks are installed when the first delivery is adopted.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from ..protocol.library import ScriptLibrary
from ..protocol.ops import Rejected
from .leases import KEEPER
from .settle import hand_back

logger = logging.getLogger(__name__)

# A Message dropped in a reference cycle (Celery's requests are in cycles) is only freed
# by the cycle collector. While deliveries are adopted it runs first after this long, then
# at doubling intervals up to GC_MAX_SECONDS (a long task must not cost a collection every
# few seconds for its whole run); a new adoption starts over.
GC_FIRST_SECONDS = 2.0
GC_MAX_SECONDS = 60.0

# What counts as "the broker is unreachable right now": try again on the next tick.
RETRYABLE = (redis.ConnectionError, redis.TimeoutError, OSError)
# An ack or hand-back that still fails after this long is given up (logged). That loses
# nothing: the message stays in the broker and the sweep restores it once its deadline
# lapses; it only bounds what a process keeps retrying against a broker that is gone.
GIVE_UP_SECONDS = 3600.0
# At exit, stop trying after this long: an unreachable broker must not hang the shutdown
# (what is left comes back through the sweep).
EXIT_BUDGET_SECONDS = 10.0


@dataclass(eq=False)
class Adopted:
    """A delivery of a closed channel (or an ack that met a lost connection)."""

    lib: ScriptLibrary  # the closed channel's (its client reconnects when used; its policy applies)
    queue: str
    id: str
    delivery_count: int | None  # the delivery's x-delivery-count: a hand-back is fenced by it
    message: Callable[[], Any] | None  # a weak reference; None for a pending ack
    since: float = field(default_factory=time.monotonic)  # adopted, or found dropped
    dropped: bool = False


Key = tuple[ScriptLibrary, str, str]  # (the library it came through, queue, message id)
Group = tuple[ScriptLibrary, str]  # one script call each


@dataclass
class Orphans:
    """The process-wide registry of adopted deliveries and pending acks."""

    _adopted: dict[Key, Adopted] = field(default_factory=dict)
    _acks: dict[Key, Adopted] = field(default_factory=dict)
    # Re-entrant: kombu closes a channel from a weakref finalizer, which the cycle collector
    # may run in this very thread while it holds the lock.
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _ticking: threading.Lock = field(default_factory=threading.Lock)  # one tick at a time
    _installed: bool = False
    _next_extend: float = 0.0
    _next_gc: float = 0.0
    _gc_gap: float = GC_FIRST_SECONDS
    _pid: int = field(default_factory=os.getpid)

    def __len__(self) -> int:
        return len(self._adopted) + len(self._acks)

    # -- filled by the channels' QoS ----------------------------------------------------------

    def adopt(self, lib: ScriptLibrary, messages: Iterable[tuple[str, str, int | None, Any]]) -> int:
        """Take over (queue, id, delivery count, Message) deliveries of a closing channel."""
        taken = 0
        with self._lock:
            for queue, message_id, count, message in messages:
                self._adopted[(lib, queue, message_id)] = Adopted(
                    lib, queue, message_id, count, weakref.ref(message))
                taken += 1
            self._next_extend = time.monotonic()  # extend on the next tick
            self._gc_gap = GC_FIRST_SECONDS
            self._next_gc = min(self._next_gc, time.monotonic())
            self._tend_in_background()
        return taken

    def settle(self, lib: ScriptLibrary, queue: str, message_id: str) -> Adopted | None:
        """The delivery was acked or rejected through its old Message: no longer ours.
        Returns what was adopted (its delivery count fences a reject)."""
        if not self._adopted:
            return None  # the common case, without taking the lock on every ack
        with self._lock:
            return self._adopted.pop((lib, queue, message_id), None)

    def after_fork_in_child(self) -> None:
        """A forked child starts with an empty registry of its own (fresh locks): the
        parent's deliveries are the parent's to tend."""
        self._adopted, self._acks = {}, {}
        self._lock, self._ticking = threading.RLock(), threading.Lock()
        self._pid = os.getpid()

    def ack_later(self, lib: ScriptLibrary, queue: str, message_id: str) -> None:
        """An ack met a lost connection: send it again on the next ticks."""
        with self._lock:
            key = (lib, queue, message_id)
            self._adopted.pop(key, None)
            self._acks[key] = Adopted(lib, queue, message_id, None, None)
            self._tend_in_background()

    def _tend_in_background(self) -> None:
        """Have the lease keeper tend the registry (called with the lock held). The first
        time, install the exit hook (hand back what is left) and the fork hook."""
        if not self._installed:
            self._installed = True
            atexit.register(self.release_all)
            os.register_at_fork(after_in_child=self.after_fork_in_child)
            KEEPER.watch_always(self)
        KEEPER.wake()

    # -- tending ------------------------------------------------------------------------------

    def tend(self, now: float) -> None:
        """The lease keeper's call, once a second (or more often, see :meth:`interval`)
        while anything is here."""
        self.tick()

    def interval(self) -> float:
        """How often the held deliveries are extended: the shortest heartbeat among them
        (none held: no deadline to keep)."""
        with self._lock:
            return min((d.lib.policy.heartbeat_seconds for d in self._adopted.values()), default=math.inf)

    def tick(self) -> None:
        """Send pending acks, hand back dropped deliveries, extend the held ones when due."""
        if not len(self) or os.getpid() != self._pid:
            return  # a forked pool child inherits a copy: only the owner tends it
        if not self._ticking.acquire(blocking=False):
            return  # another thread is ticking; two would hand back the same message twice
        try:
            self._tick()
        finally:
            self._ticking.release()

    def _tick(self) -> None:
        self._collect_garbage()
        now = time.monotonic()
        with self._lock:
            acks = list(self._acks.items())
            dropped = [(k, d) for k, d in self._adopted.items() if d.message and d.message() is None]
            for _, delivery in dropped:
                if not delivery.dropped:  # the give-up clock starts when it is dropped
                    delivery.dropped, delivery.since = True, now
        self._run("ack", acks, self._acks)
        self._run("hand back", dropped, self._adopted)
        now = time.monotonic()
        if now >= self._next_extend:
            with self._lock:
                held = list(self._adopted.values())
            if held:
                self._next_extend = now + min(d.lib.policy.heartbeat_seconds for d in held)
                self._extend(held)

    def release_all(self) -> None:
        """At exit: send the pending acks, hand back everything still adopted."""
        if not len(self) or os.getpid() != self._pid:
            return
        if not self._ticking.acquire(timeout=5):  # the thread is mid-tick; do not hang the exit
            return
        try:
            with self._lock:
                acks, adopted = list(self._acks.items()), list(self._adopted.items())
            deadline = time.monotonic() + EXIT_BUDGET_SECONDS
            self._run("ack", acks, self._acks, deadline=deadline)
            self._run("hand back", adopted, self._adopted, deadline=deadline)
        finally:
            self._ticking.release()

    # -- the script calls ---------------------------------------------------------------------

    def _collect_garbage(self) -> None:
        now = time.monotonic()
        if self._adopted and now >= self._next_gc:
            self._next_gc = now + self._gc_gap
            self._gc_gap = min(self._gc_gap * 2, GC_MAX_SECONDS)
            gc.collect()

    def _run(self, what: str, items: list[tuple[Key, Adopted]],
             registry: dict[Key, Adopted], deadline: float | None = None) -> None:
        """One script call per (library, queue); the entries of calls that succeeded leave
        ``registry``; the others stay for the next tick (until GIVE_UP_SECONDS). Any error
        is kept to its group: one queue's trouble does not stall the others."""
        for (lib, queue), group in _grouped(items).items():
            if deadline is not None and time.monotonic() > deadline:
                logger.error("celery-redis-lua: out of time at exit; the sweep restores what "
                             "was not handed back")
                return
            ids = [delivery.id for _, delivery in group]
            result = None
            try:
                if what == "ack":
                    result = lib.ack(queue, ids)
                else:
                    result = hand_back(lib, queue, ids, [delivery.delivery_count for _, delivery in group])
            except Exception as error:  # connection trouble, or a refusal (READONLY, OOM)
                if time.monotonic() - min(d.since for _, d in group) < GIVE_UP_SECONDS:
                    logger.warning("celery-redis-lua: could not %s %d message(s) of queue %r "
                                   "(%s); trying again", what, len(ids), queue, error)
                    continue
                logger.error("celery-redis-lua: gave up trying to %s %d message(s) of queue %r "
                             "(%s); the sweep restores them", what, len(ids), queue, error)
            with self._lock:
                for key, delivery in group:
                    if registry.get(key) is delivery:
                        del registry[key]
            if what == "hand back" and isinstance(result, Rejected):
                logger.info("celery-redis-lua: handed back %d message(s) of queue %r that were "
                            "dropped unacked after their channel closed (%d delivered again "
                            "elsewhere meanwhile, left alone)", len(ids), queue, result.stale)

    def _extend(self, held: list[Adopted]) -> None:
        by_lib: dict[ScriptLibrary, list[Any]] = defaultdict(list)
        for (lib, queue), group in _grouped((None, d) for d in held).items():
            by_lib[lib].append(lib.calls.extend(queue, [delivery.id for _, delivery in group]))
        for lib, batch in by_lib.items():
            try:
                lib.run_many(batch)
            except Exception as error:  # the next tick tries again
                logger.warning("celery-redis-lua: could not extend adopted deliveries (%s)", error)


def _grouped(items: Iterable[tuple[Any, Adopted]]) -> dict[Group, list[tuple[Any, Adopted]]]:
    """By (library, queue): one script call each (libraries hash by identity)."""
    groups: dict[Group, list[tuple[Any, Adopted]]] = defaultdict(list)
    for key, delivery in items:
        groups[(delivery.lib, delivery.queue)].append((key, delivery))
    return groups


ORPHANS = Orphans()
