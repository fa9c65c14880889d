"""Acks in batches: one ``ack`` script call per queue carries the acks of many deliveries.

``message.ack()`` hands its delivery to :data:`ACKS` and returns. The channel's next
consume (the consumer's own round trip: a prefork worker refills its prefetch
window as its pool frees slots) carries what has gathered, in front of it in the same
write; what no consume picks up within ``ack_flush_delay`` (5 ms by default), one daemon
thread per process sends, every queue's ids of one channel in one pipeline. So under load
the acks cost no round trip of their own, and the thread, which competed with the event
loop for the GIL and the CPU on every ack (a prefork worker's main process spent a third
of its time in it), mostly sleeps. On a cluster or with a durability wait the thread sends
them all (a consume must not wait for an fsync, and its node need not be the acks').

What this costs, and why it is safe:
- The caller does not wait for the server: an ack gathered but not yet sent dies with a
  crashing process. Its message then comes back after the visibility timeout and runs
  again, exactly as when a crash beats a synchronous ack to the wire; the window is the
  few milliseconds a batch waits (``ack_flush_delay`` at most).
- A batch that meets a lost connection is not dropped: its acks go to the keeper, which
  sends them again once the broker answers (before the deadline lapses,
  the task does not run twice).
- A channel that closes sends its acks first and waits for a batch of its own on the
  wire (:meth:`AckBatcher.flush`), and the process does the same at exit, so a warm
  shutdown leaves nothing behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from ..protocol.library import ScriptLibrary
from ..protocol.runner import Call
from .keeper import KEEPER

logger = logging.getLogger(__name__)

# What counts as "the broker is unreachable right now": the acks are sent again (the keeper).
RETRYABLE = (redis.ConnectionError, redis.TimeoutError, OSError)
# At exit, the acks still gathered get this long to reach an unreachable broker.
EXIT_BUDGET_SECONDS = 10.0
T = TypeVar("T")


@dataclass
class Batch:
    """The acks of one channel (one script library) waiting to be sent."""

    due: float  # monotonic time at which the thread sends it (first ack + ack_flush_delay)
    ids: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # queue -> ids


class AckBatcher:
    def __init__(self) -> None:
        self._reset()
        self._hooks = False

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[ScriptLibrary, Batch] = {}
        self._sending: set[ScriptLibrary] = set()  # libraries whose batch is on the wire
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add(self, lib: ScriptLibrary, queue: str, message_id: str, *, wait: float = 0.0) -> None:
        """Gather one ack; it is sent within ``wait`` seconds (plus the thread's wake-up)."""
        with self._cond:
            batch = self._pending.get(lib)
            if batch is None:  # a new due time: the thread must learn it
                batch = self._pending[lib] = Batch(time.monotonic() + wait)
                self._start()
                self._cond.notify_all()
            batch.ids[queue].append(message_id)

    def flush(self, lib: ScriptLibrary, timeout: float | None = None) -> None:
        """Send ``lib``'s gathered acks now, from this thread, after any batch of ``lib``
        already on the wire (a channel closing: its acks go before it does); a batch on the
        wire to a broker that does not answer is waited for at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: lib not in self._sending, timeout)
            batch = self._pending.pop(lib, None)
            if batch is None:
                return
            self._sending.add(lib)
        self._send(lib, batch)

    def run_with_acks(self, lib: ScriptLibrary, call: Call[T]) -> T:
        """Run ``call`` (a consumer's consume) with ``lib``'s gathered acks in front
        of it, in one write: the consumer's own round trip carries them and this thread
        makes none. The acks are settled as this thread settles its batches; ``call``'s
        result is returned, its error raised. Where a batch is not one write with nothing to
        wait for (a cluster, a durability wait, which would stall the consumer for an fsync)
        the acks stay with the thread."""
        if not lib.runner.batches_in_one_write:
            return lib.run(call)
        with self._cond:
            batch = self._pending.pop(lib, None)
        if batch is None:
            return lib.run(call)
        (result,) = self._run_settled(lib, batch, [call])
        if isinstance(result, Exception):
            raise result
        return result

    def take(self, lib: ScriptLibrary) -> Batch | None:
        """``lib``'s gathered acks, taken for a consume that goes out without waiting for its
        reply (channel.py) to carry; the caller settles them (:meth:`settle`) when the
        replies come, or as lost when they never will. None where batches are not one write
        (they stay with the thread, as in :meth:`run_with_acks`) or nothing is gathered."""
        if not lib.runner.batches_in_one_write:
            return None
        with self._cond:
            return self._pending.pop(lib, None)

    @staticmethod
    def calls(lib: ScriptLibrary, batch: Batch) -> list[Call[Any]]:
        """The batch's ack calls, one per queue, in the order :meth:`settle` expects."""
        return [lib.calls.ack(queue, ids) for queue, ids in batch.ids.items()]

    def settle(self, lib: ScriptLibrary, batch: Batch, results: Sequence[Any]) -> None:
        """Settle the batch's acks by their calls' results (an exception in a call's place:
        a lost connection gives them to the keeper, to be sent again)."""
        for (queue, ids), result in zip(batch.ids.items(), results, strict=True):
            self._settled(lib, queue, ids, result)

    def pending(self, lib: ScriptLibrary) -> int:
        """How many of ``lib``'s acks are gathered or on the wire (tests, and the upkeep)."""
        with self._cond:
            batch = self._pending.get(lib)
            return sum(map(len, batch.ids.values())) if batch else 0

    def _start(self) -> None:
        """Start the sending thread (called with the lock held)."""
        if not self._hooks:  # installed on first use, not on import
            self._hooks = True
            os.register_at_fork(after_in_child=self._reset)  # the parent's acks are the parent's
            atexit.register(self._flush_all_at_exit)
        if self._thread is None and os.getpid() == self._pid:
            self._thread = threading.Thread(target=self._run, name="celery-redis-lua-acks", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                lib, batch = self._next_due()
                self._sending.add(lib)
            self._send(lib, batch)

    def _next_due(self) -> tuple[ScriptLibrary, Batch]:
        """Wait (lock held) for the first batch that is due and not already on the wire."""
        while True:
            now = time.monotonic()
            ready = [(b.due, id(lib), lib) for lib, b in self._pending.items() if lib not in self._sending]
            if ready:
                due, _, lib = min(ready)
                if due <= now:
                    return lib, self._pending.pop(lib)
                self._cond.wait(due - now)
            else:
                self._cond.wait()

    def _send(self, lib: ScriptLibrary, batch: Batch) -> None:
        """One ack call per queue, in one pipeline. Runs with ``lib`` marked as sending."""
        try:
            self._run_settled(lib, batch)
        finally:
            with self._cond:
                self._sending.discard(lib)
                self._cond.notify_all()

    def _run_settled(self, lib: ScriptLibrary, batch: Batch, after: Sequence[Call[Any]] = ()) -> list[Any]:
        """``batch``'s ack calls (one per queue), then ``after``, in one pipeline; the acks
        settled, the results of ``after`` returned (an error in its place, as the exception:
        a lost connection fails them all, and the acks go to the keeper)."""
        acks = self.calls(lib, batch)
        calls = [*acks, *after]
        try:
            results = lib.run_many(calls, raise_on_error=False)
        except Exception as error:  # the caller (the sending thread) must go on; see _settled
            results = [error] * len(calls)
        self.settle(lib, batch, results[:len(acks)])
        return results[len(acks):]

    @staticmethod
    def _settled(lib: ScriptLibrary, queue: str, ids: list[str], result: object) -> None:
        if isinstance(result, RETRYABLE):
            logger.warning("celery-redis-lua: ack of %d message(s) of queue %r failed (%s); sending "
                           "them again once the broker is reachable", len(ids), queue, result)
            KEEPER.ack_later(lib, queue, ids)
        elif isinstance(result, Exception):
            logger.error("celery-redis-lua: ack of message(s) %s of queue %r was refused (%s); they "
                         "come back after the visibility timeout", ", ".join(ids), queue, result)
        # A sent ack has nothing to settle: its delivery left the keeper's held table when it
        # was acked (QoS.ack), before its batch was sent.

    def _flush_all_at_exit(self) -> None:
        deadline = time.monotonic() + EXIT_BUDGET_SECONDS
        with self._cond:
            libs = list(self._pending)
        for lib in libs:
            if time.monotonic() > deadline:
                logger.warning("celery-redis-lua: %d channel(s) exited with acks unsent; their "
                               "messages come back after the visibility timeout", len(libs))
                return
            self.flush(lib, timeout=max(0.0, deadline - time.monotonic()))


ACKS = AckBatcher()
