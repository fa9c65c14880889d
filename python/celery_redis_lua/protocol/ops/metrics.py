"""What queues hold, read in one call per cluster slot group: counts (stats), and what a
dashboard shows (metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..call import Call
from ..keys import Keyspace
from ..policy import Policy
from .base import int_or_none, keys_of, operation, text
from .flow import Limits, limits_of

# -- what the scripts reply ---------------------------------------------------------------

@dataclass(frozen=True)
class QueueStats:
    queue: str
    ready: int
    delayed: int
    in_flight: int
    dead: int


@dataclass(frozen=True)
class QueueMetrics:
    """What a dashboard shows of one queue, from one snapshot (metrics.lua). Times are the
    server's unix ms; ``oldest_ready_at`` and ``next_eta`` are None when there is none."""

    queue: str
    now: int
    ready: int
    delayed: int
    in_flight: int
    dead: int
    oldest_ready_at: int | None
    next_eta: int | None
    redelivered: int
    dropped: dict[str, int]
    paused: str | None = None  # the reason given to pause ('' for none); None: running
    retrying: int = 0  # of the delayed, how many wait for a delayed retry (x-delayed-retry-type)
    limits: Limits = Limits()  # the queue's limits (the limit script); Limits() when it has none
    exists: bool = True  # its meta hash exists; False: gone (expired, deleted) or only bound
    deduplicated: dict[str, int] = field(default_factory=dict)  # dedup mode -> publishes it dropped

    @property
    def oldest_ready_age_ms(self) -> int | None:
        return None if self.oldest_ready_at is None else max(0, self.now - self.oldest_ready_at)

    @property
    def next_eta_in_ms(self) -> int | None:
        return None if self.next_eta is None else max(0, self.next_eta - self.now)


def _pairs(flat: Sequence[Any]) -> dict[str, int]:
    """A reply's flat name, count pairs (the counters of a reason or a mode)."""
    return {text(flat[j]): int(flat[j + 1]) for j in range(0, len(flat), 2)}


def _paused_reason(value: Any) -> str | None:
    """meta's 'paused' field ('<unix ms> <reason>') as the reason; None when not paused."""
    if not value:
        return None
    return text(value).partition(" ")[2]


# -- the scripts --------------------------------------------------------------------------

@operation
def stats(k: Keyspace, p: Policy, queues: Sequence[str]) -> Call[list[QueueStats]]:
    names = list(queues)

    def decode(reply: Sequence[Any]) -> list[QueueStats]:
        return [QueueStats(names[i // 4], *(int(n) for n in reply[i:i + 4])) for i in range(0, len(reply), 4)]

    return Call("stats", keys_of(k, names), [], decode)


METRICS_ITEMS = 14  # per queue in the metrics script's reply


@operation
def metrics(k: Keyspace, p: Policy, queues: Sequence[str]) -> Call[list[QueueMetrics]]:
    names = list(queues)

    def decode(reply: Sequence[Any]) -> list[QueueMetrics]:
        now, rows = int(reply[0]), reply[1:]
        found = []
        for i in range(0, len(rows), METRICS_ITEMS):
            (ready, delayed, in_flight, dead, oldest, eta, redelivered, dropped, paused,
             retrying, cap, rate, exists, deduplicated) = rows[i:i + METRICS_ITEMS]
            found.append(QueueMetrics(
                names[i // METRICS_ITEMS], now, int(ready), int(delayed), int(in_flight), int(dead),
                int_or_none(oldest), int_or_none(eta), int(redelivered),
                _pairs(dropped), _paused_reason(paused), int(retrying), limits_of(cap, rate),
                bool(int(exists)), _pairs(deduplicated)))
        return found

    return Call("metrics", keys_of(k, names), [], decode)
