"""One object to call every script: a :class:`ScriptRunner`, a :class:`Keyspace` and a
:class:`Policy`.

Every operation of :mod:`.ops` is bound here as a method (``lib.ack(queue, ids)`` runs
it; ``lib.calls.ack(queue, ids)`` builds its :class:`Call` for a pipeline). What the
library adds is only what loops: consume and stats across cluster slots, the sweep and
purge until nothing is left, each call staying short on the server.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from . import ops
from .call import Call
from .fence import NoReplicasError
from .keys import Binding, Keyspace
from .ops import (
    EMPTY_SWEEP,
    Consumed,
    DeadLetter,
    Declared,
    FanoutBatch,
    FanoutBound,
    QueueMetrics,
    QueueStats,
    Rejected,
    SweepReport,
)
from .policy import Policy
from .runner import ScriptRunner

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")
# Operations the library runs in loops of its own (below) rather than bound as one call;
# a test checks that every other operation of ops is bound.
LOOPED = frozenset({"consume", "sweep", "purge", "stats", "metrics"})


class _Bound(Generic[P, T]):
    """An operation of :mod:`.ops` as a method: the library's keyspace and policy go first."""

    def __init__(self, op: Callable[Concatenate[Keyspace, Policy, P], Call[T]]) -> None:
        self.op = op
        functools.update_wrapper(self, op)  # type: ignore[arg-type]

    @overload
    def __get__(self, lib: None, owner: type) -> _Bound[P, T]: ...
    @overload
    def __get__(self, lib: ScriptLibrary, owner: type) -> Callable[P, T]: ...

    def __get__(self, lib: ScriptLibrary | None, owner: type) -> Any:
        if lib is None:
            return self
        op = self.op

        def run(*args: P.args, **kwargs: P.kwargs) -> T:  # on every publish and ack: kept bare
            return lib.run(op(lib.keys, lib.policy, *args, **kwargs))
        return run


class Calls:
    """``lib.calls.<op>(...)``: the :class:`Call` of an operation, to run in a pipeline."""

    def __init__(self, lib: ScriptLibrary) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Callable[..., Call[Any]]:
        try:
            op = ops.OPERATIONS[name]
        except KeyError:
            raise AttributeError(f"no script operation {name!r}") from None
        return functools.partial(op, self._lib.keys, self._lib.policy)


# 1,000 rounds of SWEEP_BATCH (ops/delivery.py) hand back as many per sweep as 100 rounds of 1,000 did.
SWEEP_ROUNDS = 1000


class ScriptLibrary:
    """Typed access to the scripts on one client (standalone or cluster)."""

    def __init__(self, client: Any, keys: Keyspace | None = None, policy: Policy | None = None, *,
                 visibility_ms: int | None = None, hold_connection: bool = False) -> None:
        self.client = client
        self.keys = keys or Keyspace()
        self.policy = policy or Policy()
        if visibility_ms is not None:  # the 0.1 signature: ScriptLibrary(client, keys, visibility_ms=...)
            self.policy = dataclasses.replace(self.policy, visibility_ms=visibility_ms)
        # hold_connection: single calls over a connection of the library's own (runner.py),
        # for a library one thread mostly uses (a kombu channel's); close() lets it go.
        self.runner = ScriptRunner(client, durability=self.policy.durability, hold_connection=hold_connection)
        self.calls = Calls(self)

    def close(self) -> None:
        self.runner.close()

    def with_policy(self, **changes: Any) -> ScriptLibrary:
        """The same client and keyspace under another policy (e.g. another delivery limit)."""
        return ScriptLibrary(self.client, self.keys, dataclasses.replace(self.policy, **changes))

    def run(self, call: Call[T]) -> T:
        return self.runner.run(call)

    def run_many(self, batch: Sequence[Call[Any]], *, raise_on_error: bool = True,
                 timeout: float | None = None) -> list[Any]:
        return self.runner.run_many(batch, raise_on_error=raise_on_error, timeout=timeout)

    # -- one call each ----------------------------------------------------------------------

    publish = _Bound(ops.publish)
    publish_many = _Bound(ops.publish_many)  # the publish script, several messages in one call
    unpop = _Bound(ops.unpop)
    pause = _Bound(ops.pause)
    resume = _Bound(ops.resume)
    limit = _Bound(ops.limit)
    ack = _Bound(ops.ack)
    reject = _Bound(ops.reject)
    extend = _Bound(ops.extend)
    declare = _Bound(ops.declare)
    delete = _Bound(ops.delete)
    dead_replay = _Bound(ops.dead_replay)
    locate = _Bound(ops.locate)
    cancel = _Bound(ops.cancel)
    exists = _Bound(ops.exists)
    size = _Bound(ops.size)
    dead_list = _Bound(ops.dead_list)
    dead_purge = _Bound(ops.dead_purge)
    migrated = _Bound(ops.migrated)
    bind = _Bound(ops.bind)
    unbind = _Bound(ops.unbind)
    lookup = _Bound(ops.lookup)
    rerouted = _Bound(ops.rerouted)
    fanout_publish = _Bound(ops.fanout_publish)
    fanout_bind = _Bound(ops.fanout_bind)
    fanout_consume = _Bound(ops.fanout_consume)
    fanout_unbind = _Bound(ops.fanout_unbind)
    fanout_leave = _Bound(ops.fanout_leave)

    # -- what loops ---------------------------------------------------------------------------

    def queue_names(self) -> list[str]:
        """Every queue that exists (:meth:`declared_queues` and :meth:`bound_queues`). A SCAN
        of the keyspace: an operator's call, not one for a hot path."""
        return sorted(set(self.declared_queues()) | set(self.bound_queues()))

    def declared_queues(self) -> list[str]:
        """Every queue with a meta key: what makes a queue exist (a SCAN)."""
        return sorted({self.keys.queue_of(key)
                       for key in self.client.scan_iter(match=self.keys.meta_pattern(), count=1000)})

    def bound_queues(self) -> list[str]:
        """Every queue bound for good (a binding that never goes stale: a queue without
        x-expires, routed to before anything declared it), from a SCAN of the binding tables.
        A binding with a stale-at time belongs to an expiring queue, which lives in its keys:
        it names no queue of its own, so a queue that expired leaves with its keys, though its
        bindings go stale only later (max(x-expires, binding_lifetime_floor)) and stale ones
        stay until a lookup prunes them."""
        client, names = self.client, set[str]()
        for key in client.scan_iter(match=self.keys.binding_pattern(), count=1000):
            forever = client.zrange(key, "+inf", "+inf", byscore=True)  # bind's score for no lifetime
            names.update(b.queue for b in map(self.keys.parse_binding, forever) if b.queue)
        return sorted(names)

    def slot_groups(self, queues: Sequence[str]) -> list[list[str]]:
        """``queues`` grouped so that each group shares a cluster slot (one group when
        the server is not a cluster), in first-seen order."""
        if not isinstance(self.client, RedisCluster):
            return [list(queues)] if queues else []
        groups: dict[int, list[str]] = {}
        for queue in queues:
            groups.setdefault(self.keys.slot(queue), []).append(queue)
        return list(groups.values())

    def consume(self, queues: Sequence[str], count: int = 1, *, no_ack: bool = False,
                run: Callable[[Call[Consumed]], Consumed] | None = None,
                refused: Callable[[list[str], NoReplicasError], None] | None = None) -> Consumed:
        """Up to ``count`` messages across ``queues``. Priority order holds across the
        queues of one cluster slot; on a cluster, slot groups are asked in turn. ``run``
        runs each consume call (default :meth:`run`; a kombu channel's also carries the acks
        gathered meanwhile). A slot group whose call fails (a fenced or lost primary) does not
        stop the others: what they took is returned, and the failure is raised only when
        nothing was taken (else what the earlier groups took would be in flight with nobody
        holding it until the visibility timeout, and a shard's outage would stop every queue).
        ``refused``, when given, is told of each group a fenced primary refused instead (a
        kombu channel on a cluster leaves that slot alone a moment), which is then no failure."""
        deliveries: list[ops.Delivery] = []
        wake: list[int] = []
        rate: list[int] = []
        expired = 0
        run = run or self.run
        failed: BaseException | None = None
        for group in self.slot_groups(queues):
            try:
                consumed = run(ops.consume(self.keys, self.policy, group, count - len(deliveries),
                                           no_ack=no_ack))
            except (RedisError, OSError) as error:
                if refused is not None and isinstance(error, NoReplicasError):
                    refused(group, error)
                    continue
                failed = failed or error
                logger.warning("celery-redis-lua: consume of %s failed (%s); the other slots go on",
                               ", ".join(group), error)
                continue
            deliveries += consumed.deliveries
            expired += consumed.expired
            if consumed.wake_in_ms is not None:
                wake.append(consumed.wake_in_ms)
            if consumed.rate_in_ms is not None:
                rate.append(consumed.rate_in_ms)
            if len(deliveries) >= count:
                break
        if failed is not None and not deliveries:
            raise failed
        return Consumed(deliveries, min(wake) if wake else None, expired, min(rate) if rate else None)

    def sweep(self, queues: Sequence[str], *, batch: int = ops.SWEEP_BATCH, report_limit: int = 10,
              max_rounds: int = SWEEP_ROUNDS,
              refused: Callable[[list[str], NoReplicasError], None] | None = None) -> SweepReport:
        """Sweep until no batch is full (at most ``max_rounds`` calls); reports add up.
        ``refused``, as for :meth:`consume`: told of a slot group a fenced primary refused,
        which the next sweep takes up, instead of the refusal being raised."""
        total = EMPTY_SWEEP
        for group in self.slot_groups(queues):
            for _ in range(max_rounds):
                try:
                    report = self.run(ops.sweep(self.keys, self.policy, group, batch=batch,
                                                report_limit=report_limit))
                except NoReplicasError as error:
                    if refused is None:
                        raise
                    refused(group, error)
                    break
                total += report
                if not report.more:
                    break
        return dataclasses.replace(total, dropped_messages=total.dropped_messages[:report_limit])

    def purge(self, queue: str, *, batch: int = 10_000) -> int:
        purged, remaining = self.run(ops.purge(self.keys, self.policy, queue, batch=batch))
        while remaining:
            more, remaining = self.run(ops.purge(self.keys, self.policy, queue, batch=batch))
            if not more:
                break  # only the wake marker or racing in-flight entries remain
            purged += more
        return purged

    def stats(self, queues: Sequence[str]) -> list[QueueStats]:
        by_name = {s.queue: s for group in self.slot_groups(queues)
                   for s in self.run(ops.stats(self.keys, self.policy, group))}
        return [by_name[queue] for queue in queues]

    def metrics(self, queues: Sequence[str], *, per_call: int = 16) -> list[QueueMetrics]:
        """One metrics call per ``per_call`` queues of one cluster slot group: each call looks
        at up to 256 priority bands per queue, and a short call never holds the server up."""
        by_name = {m.queue: m for group in self.slot_groups(queues)
                   for first in range(0, len(group), per_call)
                   for m in self.run(ops.metrics(self.keys, self.policy, group[first:first + per_call]))}
        return [by_name[queue] for queue in queues]


__all__ = ["Binding", "Consumed", "DeadLetter", "Declared", "FanoutBatch", "FanoutBound", "QueueMetrics",
           "QueueStats",
           "Rejected", "ScriptLibrary", "SweepReport"]
