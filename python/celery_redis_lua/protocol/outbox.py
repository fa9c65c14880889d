"""The outbox: one per channel, what has not landed yet: acks, rejects that failed, and the
unconfirmed publishes' pipeline (protocol/unconfirmed.py); the keeper sends it when due.

``message.ack()`` puts its delivery here and returns. The channel's next consume carries
what has gathered in front of it, in the same write (a prefork worker refills its window
as its pool frees slots); what none takes within ``ack_flush_delay`` the keeper sends, one
``ack`` call per queue. On a cluster or with a durability wait the keeper sends them all (a
consume must not wait for an fsync, and its node need not be the acks'). Close and exit
send what is left. A reject goes at once (its fencing count decides on the server whether
it still applies) and waits here only if it fails.

A call that fails for any reason (a lost connection, CLUSTERDOWN or MASTERDOWN in a
failover, READONLY from a demoted primary, TRYAGAIN) stays and is sent again: acking is
idempotent, and a late ack also cancels a copy the sweep restored. It is given up, logged
once with the queue and ids, when the message's lease would have lapsed (the visibility
timeout after the ack): by then it is another consumer's. An ack not yet sent dies with a
killed process: its task runs again after the visibility timeout, as when a kill beats a
synchronous ack; the window is ``ack_flush_delay``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .call import Call
from .fence import FIRST_RETRY_SECONDS, RETRY_SECONDS
from .library import ScriptLibrary
from .settle import report
from .unconfirmed import Pipeline

logger = logging.getLogger(__name__)

# A failed call goes again after FIRST_RETRY_SECONDS, then doubling up to RETRY_SECONDS
# (fence.py's): a late ack may find its message restored.


Group = tuple[str, str, bool]  # ("ack" or "reject", queue, requeue): one script call each


# One pending call's entry: (when it was first asked for: it is given up a visibility timeout
# later, the ack's or reject's fencing count or None). A tuple, not a dataclass: one is made per ack.
Pending = tuple[float, int | None]


@dataclass
class Batch:
    """group -> {message id: Pending}, taken out of an outbox to be sent."""

    groups: dict[Group, dict[str, Pending]] = field(default_factory=lambda: defaultdict(dict))

    def __len__(self) -> int:
        return sum(map(len, self.groups.values()))


class Outbox:
    """One channel's pending acks and rejects (``lib`` is the channel's script library)."""

    def __init__(self, lib: ScriptLibrary, delay: float, on_due: Callable[[Outbox], None],
                 on_landed: Callable[[ScriptLibrary, str, Iterable[str]], None],
                 publishes: tuple[int, float] | None = None) -> None:
        self.lib, self.delay = lib, delay
        self._on_due = on_due  # the keeper's: this outbox has something due at self.due
        self._on_landed = on_landed  # the keeper's: these deliveries are settled (or given up)
        # Unconfirmed publishes: (publish_pipeline, publish_flush_delay), or None (confirmed).
        self.publishes = None if publishes is None else Pipeline(lib, *publishes, lambda: on_due(self))
        self.forked()

    def forked(self) -> None:
        """Empty, with fresh locks (a forked child leaves the parent's acks to the parent)."""
        self._lock = threading.Lock()
        self._wire = threading.Lock()  # one send at a time: close waits for one on the wire
        if self.publishes is not None:
            self.publishes.forked()
        self._pending = Batch()
        self._on_wire = Batch()  # what send() has on the wire (not landed yet: the exit names it)
        self._failing: set[tuple[Group, str]] = set()  # warned about once already
        self._retry_in = FIRST_RETRY_SECONDS
        self._due = math.inf  # monotonic time at which the keeper sends the pending acks

    @property
    def due(self) -> float:
        """When the keeper must send (monotonic): the acks' time or the publishes'."""
        publishes = self.publishes.due() if self.publishes is not None else None
        return self._due if publishes is None else min(self._due, publishes)

    def __len__(self) -> int:
        """Acks and rejects not landed yet: pending, or on the wire from :meth:`send` (not
        those a consume took: they are the consume's until it settles them)."""
        return len(self._pending) + len(self._on_wire)

    def add_ack(self, queue: str, message_id: str, count: int | None = None) -> None:
        """Gather one ack, fenced by ``count`` (the delivery's); it goes within ``delay``
        seconds (with a consume, or the keeper). The path of every ack: one lock, one dict
        write, and the keeper told once per batch."""
        now = time.monotonic()
        with self._lock:
            self._pending.groups[("ack", queue, False)].setdefault(message_id, (now, count))
            sooner = now + self.delay < self._due
            if sooner:
                self._due = now + self.delay
        if sooner:  # the keeper may sleep past it
            self._on_due(self)

    def reject(self, queue: str, message_id: str, *, requeue: bool, count: int | None) -> None:
        """Reject now, fenced by ``count``; kept and sent again if that fails."""
        group: Group = ("reject", queue, requeue)
        self.run(Batch({group: {message_id: (time.monotonic(), count)}}))

    def take(self) -> Batch | None:
        """What is pending, for a consume to carry in front of it (the caller settles it with
        :meth:`settle`, or as lost); None where a batch is not one write (a cluster, a
        durability wait: they stay for the keeper) or nothing is pending."""
        if not self.lib.runner.batches_in_one_write:
            return None
        with self._lock:
            if not self._pending.groups:
                return None
            batch, self._pending, self._due = self._pending, Batch(), math.inf
        return batch

    def calls(self, batch: Batch) -> list[Call[Any]]:
        """The batch's calls, one per group, in the order :meth:`settle` expects."""
        return [self.lib.calls.ack(queue, list(ids), counts=[count for _, count in ids.values()])
                if kind == "ack" else
                self.lib.calls.reject(queue, list(ids), requeue=requeue,
                                      counts=[count for _, count in ids.values()])
                for (kind, queue, requeue), ids in batch.groups.items()]

    def settle(self, batch: Batch, results: Sequence[Any]) -> None:
        """Record the results of ``batch``'s calls (an exception in a call's place): what
        failed goes back in, to be sent again, until its message's lease would lapse."""
        now = time.monotonic()
        again = Batch()
        for (group, ids), result in zip(batch.groups.items(), results, strict=True):
            if isinstance(result, BaseException):
                again.groups[group] = self._failed(group, ids, result, now)
            else:
                self._landed(group, ids, result)
        if again:
            self._add(again, now + self._retry_in)
            self._retry_in = min(self._retry_in * 2, RETRY_SECONDS)
        else:
            self._retry_in = FIRST_RETRY_SECONDS

    def _failed(self, group: Group, ids: dict[str, Pending], error: BaseException,
                now: float) -> dict[str, Pending]:
        """What of a failed call is sent again; the rest (past its lease) is logged once."""
        kind, queue, _ = group
        lease = self.lib.policy.visibility_ms / 1000
        live = {i: p for i, p in ids.items() if now - p[0] < lease}
        lapsed = [i for i in ids if i not in live]
        if lapsed:
            logger.error("celery-redis-lua: gave up the %s of message(s) %s of queue %r (%s: %s): "
                         "their lease has lapsed, so they may run again", kind, ", ".join(lapsed),
                         queue, type(error).__name__, error)
        new = [i for i in live if (group, i) not in self._failing]
        if new:
            logger.warning("celery-redis-lua: the %s of %d message(s) of queue %r failed (%s: %s); "
                           "sending it again until it lands", kind, len(new), queue,
                           type(error).__name__, error)
        with self._lock:
            self._failing.update((group, i) for i in live)
            self._failing.difference_update((group, i) for i in lapsed)
        self._on_landed(self.lib, queue, lapsed)  # no longer extended: its lease may lapse
        return live

    def _landed(self, group: Group, ids: dict[str, Pending], result: Any) -> None:
        kind, queue, requeue = group
        self._on_landed(self.lib, queue, ids)
        if self._failing:
            with self._lock:
                self._failing.difference_update((group, i) for i in ids)
        if kind == "reject":
            report(self.lib, queue, list(ids), result, requeue=requeue)
        elif result.stale:
            logger.warning("celery-redis-lua: the ack of message(s) %s of queue %r came after their "
                           "lease lapsed, and another consumer holds them now: left to it (the task "
                           "ran here and may run there too)", ", ".join(result.stale), queue)

    def _add(self, batch: Batch, due: float) -> None:
        with self._lock:
            for group, ids in batch.groups.items():
                for message_id, pending in ids.items():
                    self._pending.groups[group].setdefault(message_id, pending)
            sooner, self._due = due < self._due, min(self._due, due)
        if sooner:  # the keeper may sleep past it
            self._on_due(self)

    def send(self, timeout: float = -1, *, everything: bool = False, deadline: float | None = None) -> bool:
        """Send the pending acks now, from this thread, after any send already on the wire
        (waited for at most ``timeout`` seconds; -1: as long as it takes), and the unconfirmed
        publishes when due (``everything``: in any case). With a ``deadline`` (monotonic: a
        close's or the exit's budget) the wait and the acks' calls end by then. Returns
        whether it got its turn."""
        if deadline is not None:
            timeout = max(0.0, deadline - time.monotonic())
        if not self._wire.acquire(timeout=timeout):
            return False
        try:
            with self._lock:
                batch, self._pending, self._due = self._pending, Batch(), math.inf
                self._on_wire = batch
            if batch:
                self.run(batch, deadline=deadline)
        finally:
            self._on_wire = Batch()
            self._wire.release()
        self._send_publishes(everything, deadline)
        return True

    def _send_publishes(self, everything: bool, deadline: float | None) -> None:
        due = self.publishes.due() if self.publishes is not None else None
        if self.publishes is None or due is None or not (everything or due <= time.monotonic()):
            return
        try:
            self.publishes.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except Exception as error:  # a lost connection: the channel's next call meets it too
            logger.warning("celery-redis-lua: unconfirmed publishes could not be sent (%s)", error)

    def run(self, batch: Batch, after: Sequence[Call[Any]] = (), deadline: float | None = None) -> list[Any]:
        """``batch``'s calls, then ``after``, in one pipeline (ending by ``deadline``, if any);
        the batch settled, the results of ``after`` returned (the exception in place of a
        failed one)."""
        settling = self.calls(batch)
        calls = [*settling, *after]
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            results = self.lib.run_many(calls, raise_on_error=False, timeout=timeout)
        except Exception as error:  # a lost connection: every call failed with it
            results = [error] * len(calls)
        self.settle(batch, results[:len(settling)])
        return results[len(settling):]

    def unsent(self) -> list[str]:
        """What has not landed, one line per queue and kind (the exit's report): pending, or
        on the wire from another thread whose reply did not come within the exit's budget."""
        with self._lock:
            lines = [f"{len(ids)} {kind}(s) of queue {queue!r} {state}: {', '.join(ids)}"
                     for batch, state in ((self._pending, "unsent"), (self._on_wire, "sent, not confirmed"))
                     for (kind, queue, _), ids in batch.groups.items() if ids]
        return lines + (self.publishes.unsent() if self.publishes is not None else [])
