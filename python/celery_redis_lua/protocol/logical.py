"""Operations on a logical queue, sharded or not (protocol/shards.py): its shards found by
their names (a SCAN of their meta keys), then pause, resume and limits applied to each.

An integer limit is split over the shards (:func:`shards.split`: ``total // N`` each, the
first ``total % N`` one more), a share of 0 rounded up to 1, since a shard with no share could
deliver nothing: below N the cap in force is N. A rate is split the same way in its own
unit (20/s over 3 shards: 7/s, 7/s, 6/s), so each shard's burst stays a tenth of its share.
The logical queue itself, which holds only what producers that did not declare it sharded
published, keeps the whole limit.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from .library import ScriptLibrary
from .ops import Limits, QueueMetrics
from .shards import group_shards, split


def members_of(lib: ScriptLibrary, queue: str) -> list[str]:
    """``queue`` and the shards of it that exist, in index order."""
    keys = lib.keys
    found = [keys.queue_of(key) for key in lib.client.scan_iter(match=keys.shards_meta_pattern(queue),
                                                                  count=1000)]
    return [queue, *group_shards(found).get(queue, [])]


def pause(lib: ScriptLibrary, queue: str, reason: str = "") -> bool:
    """Pause ``queue`` and its shards: True unless all were paused already."""
    return any([lib.pause(member, reason) for member in members_of(lib, queue)])


def resume(lib: ScriptLibrary, queue: str) -> bool:
    """Resume ``queue`` and its shards: True if any was paused."""
    return any([lib.resume(member) for member in members_of(lib, queue)])


def _shares(value: int | str | None, count: int) -> list[int | str | None]:
    """An in-flight cap's shares, or the text as typed for every shard (the script judges it)."""
    if value is None or (isinstance(value, str) and not value.isdigit()) or int(value) < 1:
        return [value] * count
    return [max(1, share) for share in split(int(value), count)]


def _rate_shares(rate: str | None, count: int) -> list[str | None]:
    number, _, unit = (rate or "").partition("/")
    if not number.isdigit() or int(number) < 1:
        return [rate] * count  # none, or one the script refuses by name
    return [f"{max(1, share)}/{unit}" for share in split(int(number), count)]


def limit(lib: ScriptLibrary, queue: str, *, in_flight: int | str | None = None, rate: str | None = None,
          clear_in_flight: bool = False, clear_rate: bool = False) -> Limits:
    """Set or clear ``queue``'s limits (ops.limit): a sharded queue's are split over its
    shards, and the limits returned are the shards' added up."""
    members = members_of(lib, queue)
    in_force = lib.limit(queue, in_flight=in_flight, rate=rate, clear_in_flight=clear_in_flight,
                         clear_rate=clear_rate)
    shards = members[1:]
    if not shards:
        return in_force
    results = [lib.limit(shard, in_flight=cap, rate=pace, clear_in_flight=clear_in_flight,
                         clear_rate=clear_rate)
               for shard, cap, pace in zip(shards, _shares(in_flight, len(shards)),
                                           _rate_shares(rate, len(shards)), strict=True)]
    return added_up(results)


def added_up(shares: Sequence[Limits]) -> Limits:
    """The limits in force over shards: the caps added up, and the rates when all share a unit
    (None when any shard has none)."""
    caps = [r.in_flight for r in shares]
    rates = [r.rate.partition("/") for r in shares if r.rate is not None]
    total_rate = None
    if rates and len(rates) == len(shares) and len({unit for _, _, unit in rates}) == 1:
        total_rate = f"{sum(int(n) for n, _, _ in rates)}/{rates[0][2]}"
    return Limits(None if not caps or None in caps else sum(c for c in caps if c is not None), total_rate)


def fold(found: Sequence[QueueMetrics]) -> list[tuple[QueueMetrics, list[QueueMetrics]]]:
    """``found`` by logical queue: each one's metrics (a sharded queue's, its own and its
    shards' added up), with its shards' own metrics (none for a queue not sharded)."""
    by_name = {m.queue: m for m in found}
    folded: list[tuple[QueueMetrics, list[QueueMetrics]]] = []
    for queue, names in group_shards([m.queue for m in found]).items():
        shards = [by_name[name] for name in names]
        own = by_name.get(queue)
        folded.append((_logical(queue, [own] if own else [], shards) if shards else by_name[queue], shards))
    return folded


def _logical(queue: str, own: list[QueueMetrics], shards: list[QueueMetrics]) -> QueueMetrics:
    members = own + shards
    oldest = [m.oldest_ready_at for m in members if m.oldest_ready_at is not None]
    etas = [m.next_eta for m in members if m.next_eta is not None]
    paused = [m.paused for m in members if m.paused is not None]
    return dataclasses.replace(
        members[0], queue=queue, now=max(m.now for m in members), ready=sum(m.ready for m in members),
        delayed=sum(m.delayed for m in members), in_flight=sum(m.in_flight for m in members),
        dead=sum(m.dead for m in members), retrying=sum(m.retrying for m in members),
        redelivered=sum(m.redelivered for m in members), oldest_ready_at=min(oldest, default=None),
        next_eta=min(etas, default=None), paused=paused[0] if paused else None,
        limits=added_up([m.limits for m in shards]), exists=any(m.exists for m in members),
        dropped=dict(sum((Counter(m.dropped) for m in members), Counter())),
        deduplicated=dict(sum((Counter(m.deduplicated) for m in members), Counter())))
