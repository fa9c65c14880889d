"""The keeper's table (keeper.py): its entries, and the calls made on them off the thread's
lock (orphans handed back, keep-alive calls run, what is left reported at exit).

A live channel's deliveries are plain dict entries of :class:`Taken`; once the channel closed
or was dropped each is a :class:`Held` (an orphan), held by its kombu ``Message`` until
dropped, then handed back, counted and fenced by its delivery count. The keep-alive calls
channels register are :class:`KeepAlive` entries.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..protocol.library import ScriptLibrary
from ..protocol.ops import Delivery
from ..protocol.outbox import Outbox
from ..protocol.runner import Call
from ..protocol.settle import hand_back

logger = logging.getLogger(__name__)

# A hand-back failing this long is given up (logged): the sweep restores the message anyway.
GIVE_UP_SECONDS = 3600.0

Key = tuple[ScriptLibrary, str, str]  # (the library it came through, queue, message id)


def _gone() -> None:
    return None


@dataclass(eq=False, slots=True)
class Held:
    """A delivery of a closed or dropped channel whose ack, reject or hand-back has not landed
    (an orphan: one object each; a live channel's are plain dict entries of :class:`Taken`)."""

    lib: ScriptLibrary  # the channel's (its client reconnects when used after a close)
    queue: str
    id: str
    count: int  # the x-delivery-count it was delivered with: a hand-back is fenced by it
    holder: Callable[[], Any]  # a weak reference to its kombu Message, or _gone
    since: float  # orphaned (a failing hand-back is given up GIVE_UP_SECONDS after it)
    settling: bool = False


@dataclass(eq=False, slots=True)
class Taken:
    """What one live channel's consumes took: queue -> {message id: delivery count}. The
    per-message path (a take, an ack's settling, its release) is a few dict operations."""

    holder: Callable[[], Any]  # a weak reference to the channel
    live: defaultdict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    settling: defaultdict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    # (queue, id) -> when it stops being kept alive (monotonic): deliveries of queues with an
    # x-consumer-timeout only; -inf once it passed (logged, never extended again)
    deadlines: dict[tuple[str, str], float] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(map(len, self.live.values())) + sum(map(len, self.settling.values()))

    def time_out(self, lib: ScriptLibrary, deliveries: Iterable[Delivery], timeouts: Mapping[str, int],
                 now: float) -> float:
        """When each delivery of a queue with an x-consumer-timeout (ms) stops being kept alive;
        returns when the first must be extended to exactly that (consume gave it a visibility
        timeout from now, which may reach past it), or inf."""
        first = math.inf
        if not timeouts:
            return first
        for d in deliveries:
            if d.queue in timeouts:
                at = self.deadlines[d.queue, d.id] = now + timeouts[d.queue] / 1000
                first = min(first, at - lib.policy.visibility_ms / 1000)
        return first

    def bound_by_timeouts(self, lib: ScriptLibrary, ids: dict[tuple[ScriptLibrary, str], list[str]],
                          now: float) -> list[Call[Any]]:
        """x-consumer-timeout (the keeper's lock held): a delivery past its queue's timeout is
        taken out of ``ids`` and no longer extended (logged once; the sweep takes it back at its
        deadline, with the delayed retry and the delivery limit applying, as RabbitMQ's consumer
        timeout takes it back), and one nearer to it than the visibility timeout is extended
        to it exactly, on a call of its own (returned), instead of with the others."""
        if not self.deadlines:
            return []
        visibility = lib.policy.visibility_ms / 1000
        calls, bounded = [], set()
        for (queue, message_id), at in self.deadlines.items():
            if at > now + visibility:
                continue
            bounded.add((queue, message_id))
            if at > now:
                left_ms = max(1, int((at - now) * 1000))
                calls.append(lib.calls.extend(queue, [message_id], visibility_ms=left_ms))
            elif at > -math.inf:
                self.deadlines[queue, message_id] = -math.inf
                logger.warning("celery-redis-lua: message %s of queue %r is held past the queue's "
                               "x-consumer-timeout: no longer kept alive, the broker takes it back at "
                               "its deadline (delivered again, or dead-lettered by the delivery limit)",
                               message_id, queue)
        for queue in {queue for queue, _ in bounded}:
            ids[(lib, queue)] = [i for i in ids[(lib, queue)] if (queue, i) not in bounded]
        return calls

    def orphans(self, lib: ScriptLibrary, now: float) -> Iterable[Held]:
        """Its deliveries as orphans nobody holds yet (settling ones stay settling)."""
        for settling, table in ((False, self.live), (True, self.settling)):
            for queue, ids in table.items():
                for message_id, count in ids.items():
                    yield Held(lib, queue, message_id, count, _gone, now, settling)


@dataclass(eq=False)
class KeepAlive:
    owner: Callable[[], Any]  # a weak reference to the channel that registered the calls
    lib: ScriptLibrary
    calls: list[Call[Any]]
    interval: float
    due: float


def hand_back_groups(dropped: list[Held], now: float, deadline: float = math.inf
                     ) -> Iterator[tuple[ScriptLibrary, str, list[Held]]]:
    """Give ``dropped`` orphans back, counted, a call per (library, queue); yields each group
    done with (handed back, or given up GIVE_UP_SECONDS after it was orphaned), so the
    keeper forgets it at once. What fails sooner is not yielded: it is tried again."""
    for (lib, queue), group in grouped(dropped).items():
        if time.monotonic() > deadline:  # the rest stays (and is tried again, or reported)
            break
        ids = [h.id for h in group]
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        try:
            result = hand_back(lib, queue, ids, [h.count for h in group], timeout)
        except Exception as error:  # connection trouble, or a refusal (READONLY, OOM)
            if now - min(h.since for h in group) < GIVE_UP_SECONDS:
                logger.warning("celery-redis-lua: could not hand back %d message(s) of queue %r "
                               "(%s); trying again", len(ids), queue, error)
                continue
            logger.error("celery-redis-lua: gave up handing back message(s) %s of queue %r (%s); "
                         "the sweep restores them", ", ".join(ids), queue, error)
        else:
            logger.info("celery-redis-lua: handed back %d message(s) of queue %r that nobody "
                        "holds any more (%d delivered again elsewhere meanwhile, left alone)",
                        len(ids), queue, result.stale)
        yield lib, queue, group


def grouped(held: Iterable[Held]) -> dict[tuple[ScriptLibrary, str], list[Held]]:
    """By (library, queue): one script call each (libraries hash by identity)."""
    groups: dict[tuple[ScriptLibrary, str], list[Held]] = defaultdict(list)
    for h in held:
        groups[(h.lib, h.queue)].append(h)
    return groups



def run_keep_alives(due: Iterable[KeepAlive], now: float, retry_seconds: float) -> None:
    """Run the due keep-alive calls; a failure (the broker may be down) goes again soon."""
    for alive in due:
        try:
            alive.lib.run_many(alive.calls)
            alive.due = now + alive.interval
        except Exception as error:
            logger.warning("celery-redis-lua: keeping queues alive failed (%s); trying again", error)
            alive.due = now + min(retry_seconds, alive.interval)


def report_left(outboxes: Iterable[Outbox], unsettled: Iterable[Held]) -> None:
    """At exit: log what did not land (the outboxes') and what was not handed back."""
    for outbox in outboxes:
        for line in outbox.unsent():
            logger.error("celery-redis-lua: exiting with %s", line)
    for (_, queue), group in grouped(unsettled).items():
        logger.error("celery-redis-lua: exiting with %d message(s) of queue %r not handed back: "
                     "%s; the sweep restores them after the visibility timeout", len(group), queue,
                     ", ".join(h.id for h in group))

