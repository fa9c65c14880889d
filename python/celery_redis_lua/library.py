"""One object to call every script: a :class:`ScriptRunner` plus a :class:`Keyspace`.

Each method marshals its arguments through :mod:`.calls` and runs the script.
The batched operations (purge, delete, sweep) repeat until the script says
there is nothing left, each call staying short on the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis.cluster import RedisCluster

from . import calls
from .calls import (
    Consumed,
    DeadLetter,
    Declared,
    Delivery,
    FanoutBatch,
    FanoutBound,
    Payload,
    QueueStats,
    Rejected,
    SweepReport,
)
from .keys import Keyspace
from .scripts import Call, ScriptRunner


class ScriptLibrary:
    """Typed access to the scripts on one client (standalone or cluster)."""

    def __init__(self, client: Any, keys: Keyspace | None = None, *,
                 visibility_ms: int = 300_000, dead_letter_maxlen: int = 10_000) -> None:
        self.client = client
        self.keys = keys or Keyspace()
        self.runner = ScriptRunner(client)
        self.visibility_ms = visibility_ms
        self.dead_letter_maxlen = dead_letter_maxlen

    def run(self, call: Call) -> Any:
        return self.runner.run(call)

    def run_many(self, batch: Sequence[Call], *, raise_on_error: bool = True) -> list[Any]:
        return self.runner.run_many(batch, raise_on_error=raise_on_error)

    def publish(self, queue: str, payload: Payload, *, priority: int | str = 0,
                eta_ms: int | None = None, ttl_ms: int | None = None) -> str:
        return self.run(calls.publish(self.keys, queue, payload, priority=priority, eta_ms=eta_ms,
                                      ttl_ms=ttl_ms, visibility_ms=self.visibility_ms))

    def slot_groups(self, queues: Sequence[str]) -> list[list[str]]:
        """``queues`` grouped so that each group shares a cluster slot (one group when
        the server is not a cluster), in first-seen order."""
        if not isinstance(self.client, RedisCluster):
            return [list(queues)] if queues else []
        groups: dict[int, list[str]] = {}
        for queue in queues:
            groups.setdefault(self.keys.slot(queue), []).append(queue)
        return list(groups.values())

    def consume(self, queues: Sequence[str], count: int = 1, *, no_ack: bool = False) -> Consumed:
        """Up to ``count`` messages across ``queues``. Priority order holds across the
        queues of one cluster slot; on a cluster, slot groups are asked in turn."""
        deliveries: list[Delivery] = []
        wake: list[int] = []
        expired = 0
        for group in self.slot_groups(queues):
            consumed = self.run(calls.consume(self.keys, group, count=count - len(deliveries),
                                              visibility_ms=self.visibility_ms, no_ack=no_ack,
                                              dead_letter_maxlen=self.dead_letter_maxlen))
            deliveries += consumed.deliveries
            expired += consumed.expired
            if consumed.wake_in_ms is not None:
                wake.append(consumed.wake_in_ms)
            if len(deliveries) >= count:
                break
        return Consumed(deliveries, min(wake) if wake else None, expired)

    def claim(self, queue: str, ids: Sequence[str], *, no_ack: bool = False) -> Consumed:
        return self.run(calls.claim(self.keys, queue, ids, visibility_ms=self.visibility_ms,
                                    no_ack=no_ack, dead_letter_maxlen=self.dead_letter_maxlen))

    def unpop(self, queue: str, popped: Sequence[tuple[str, float | str]]) -> int:
        return self.run(calls.unpop(self.keys, queue, popped))

    def ack(self, queue: str, ids: Sequence[str]) -> int:
        return self.run(calls.ack(self.keys, queue, ids))

    def reject(self, queue: str, ids: Sequence[str], *, requeue: bool,
               delivery_limit: int | None = 20, dead_letter_maxlen: int = 10_000,
               counts: Sequence[int | None] | None = None) -> Rejected:
        return self.run(calls.reject(self.keys, queue, ids, requeue=requeue,
                                     delivery_limit=delivery_limit,
                                     dead_letter_maxlen=dead_letter_maxlen,
                                     visibility_ms=self.visibility_ms, counts=counts))

    def extend(self, queue: str, ids: Sequence[str]) -> int:
        return self.run(calls.extend(self.keys, queue, ids, visibility_ms=self.visibility_ms))

    def sweep(self, queues: Sequence[str], *, delivery_limit: int | None = 20,
              dead_letter_maxlen: int = 10_000, batch: int = 1000, report_limit: int = 10,
              max_rounds: int = 100) -> SweepReport:
        """Sweep until no batch is full (at most ``max_rounds`` calls); reports add up."""
        total = SweepReport(0, 0, 0, 0, 0, 0, 0, False, [])
        for group in self.slot_groups(queues):
            for _ in range(max_rounds):
                report = self.run(calls.sweep(
                    self.keys, group, visibility_ms=self.visibility_ms,
                    delivery_limit=delivery_limit, dead_letter_maxlen=dead_letter_maxlen,
                    batch=batch, report_limit=report_limit))
                total = _add_reports(total, report, report_limit)
                if not report.more:
                    break
        return total

    def declare(self, queue: str, *, expires_ms: int | None = None,
                message_ttl_ms: int | None = None, max_priority: int | None = None) -> Declared:
        return self.run(calls.declare(self.keys, queue, expires_ms=expires_ms,
                                      message_ttl_ms=message_ttl_ms, max_priority=max_priority))

    def bind(self, exchange: str, members: Iterable[str], *, lifetime_ms: int | None = None) -> int:
        return self.run(calls.bind(self.keys, exchange, members, lifetime_ms=lifetime_ms))

    def unbind(self, exchange: str, members: Iterable[str]) -> int:
        return self.run(calls.unbind(self.keys, exchange, members))

    def lookup(self, exchange: str, sep: str = "\x06\x16") -> list[tuple[str, ...]]:
        return self.run(calls.lookup(self.keys, exchange, sep))

    def fanout_publish(self, stream_key: str, payload: Payload, *, maxlen: int = 10_000,
                       expires_ms: int | None = None, routing_key: str = "") -> str:
        return self.run(calls.fanout_publish(self.keys, stream_key, payload, maxlen=maxlen,
                                             expires_ms=expires_ms, routing_key=routing_key))

    def fanout_bind(self, stream_key: str, queue: str, *, expires_ms: int | None = None,
                    message_ttl_ms: int | None = None,
                    stream_expires_ms: int | None = None) -> FanoutBound:
        return self.run(calls.fanout_bind(self.keys, stream_key, queue, expires_ms=expires_ms,
                                          message_ttl_ms=message_ttl_ms,
                                          stream_expires_ms=stream_expires_ms))

    def fanout_consume(self, stream_key: str, queue: str, consumer: str, *,
                       count: int = 100, stream_expires_ms: int | None = None) -> FanoutBatch:
        return self.run(calls.fanout_consume(self.keys, stream_key, queue, consumer, count=count,
                                             stream_expires_ms=stream_expires_ms))

    def fanout_unbind(self, stream_key: str, queue: str) -> bool:
        return self.run(calls.fanout_unbind(self.keys, stream_key, queue))

    def fanout_leave(self, stream_key: str, queue: str, consumer: str) -> bool:
        return self.run(calls.fanout_leave(self.keys, stream_key, queue, consumer))

    def exists(self, queue: str) -> bool:
        return self.run(calls.exists(self.keys, queue))

    def purge(self, queue: str, *, batch: int = 10_000) -> int:
        purged, remaining = self.run(calls.purge(self.keys, queue, batch=batch))
        while remaining:
            more, remaining = self.run(calls.purge(self.keys, queue, batch=batch))
            if not more:
                break  # only the wake marker or racing in-flight entries remain
            purged += more
        return purged

    def delete(self, queue: str) -> int:
        return self.run(calls.delete(self.keys, queue))

    def size(self, queue: str) -> int:
        return self.run(calls.size(self.keys, queue))

    def stats(self, queues: Sequence[str]) -> list[QueueStats]:
        by_name = {s.queue: s for group in self.slot_groups(queues)
                   for s in self.run(calls.stats(self.keys, group))}
        return [by_name[queue] for queue in queues]

    def dead_list(self, queue: str, *, count: int = 100, after: str | None = None) -> list[DeadLetter]:
        return self.run(calls.dead_list(self.keys, queue, count=count, after=after))

    def dead_replay(self, queue: str, *, count: int = 100, entry_ids: Sequence[str] = ()) -> list[str]:
        return self.run(calls.dead_replay(self.keys, queue, visibility_ms=self.visibility_ms,
                                          count=count, entry_ids=entry_ids))

    def dead_purge(self, queue: str) -> int:
        return self.run(calls.dead_purge(self.keys, queue))


def _add_reports(a: SweepReport, b: SweepReport, report_limit: int) -> SweepReport:
    return SweepReport(
        a.promoted + b.promoted, a.requeued + b.requeued, a.unclaimed + b.unclaimed,
        a.backlog + b.backlog, a.dead_lettered + b.dead_lettered, a.expired + b.expired,
        a.orphans + b.orphans, b.more, (a.dropped_messages + b.dropped_messages)[:report_limit],
    )
