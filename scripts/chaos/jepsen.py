"""The verdict in Jepsen's terms (issue 40 §5): the fields of Jepsen's ``total-queue`` checker,
as its RabbitMQ analysis reports them, and an order check on the consume batches the workers
recorded (batches.py).

total-queue, over the ledger: an *attempt* is a publish the producer made (``submit``, or
``submit_error`` when the publish raised: its outcome is unknown); it is *acknowledged* when
the publish returned (``submit``); a *delivery* is a start of the task (``start``), the
dequeue Celery observed. Then, as in ``jepsen.checker/total-queue``:

- ``ok``: attempted messages delivered at least once;
- ``lost``: acknowledged, never delivered;
- ``recovered``: delivered though the publish raised (outcome unknown);
- ``unexpected``: deliveries of a message nobody attempted to publish;
- ``duplicated``: deliveries of an attempted message beyond its first;

each with its fraction of the attempts (``*_frac``), and ``valid``: nothing lost and nothing
unexpected. Today's ``lost`` (never *finished*) stays the stricter check of the verdict.

The order check, among first deliveries (delivery count 0: a redelivery comes back when the
broker says, not in publish order). A message is *ready* from when its publish returned (for
a countdown, from its ETA); a consume batch ran on the server between ``after`` (when the
worker sent it) and ``t`` (when it read the reply). A message is judged in the queue that
delivered it: a shard, for a sharded queue (``--shards``). So, for certain:

- **a priority inversion**: a batch Z took a lower-priority message of the queue after a
  higher-priority message A was ready (``Z.after >= A ready``) and before the batch Y that
  took A ran (``Z.t <= Y.after``). The size of A's inversion is the number of such batches;
  more than one consume batch fails the check.
- **a FIFO violation**: within one queue and priority, a message B taken by a batch that ran
  before the batch of a message A ready strictly before B (or in the same batch ahead of A).

Faults may reorder (a consume whose reply a fault lost puts its messages back without a
count; a failover's two primaries), so an order violation is explained when a fault came
between FAULT_BEFORE seconds before the waiting message was ready and its delivery, like a
duplicate's attribution; only unexplained ones fail the run.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

ETA_SLACK = 0.005  # seconds: an ETA travels as whole ms; the server compares its own clock
SAME_MS = 0.002  # a strictly earlier ready time is at least this much earlier (scores are ms)
FAULT_BEFORE = 1.0  # seconds: a fault this long before a message was ready may still reorder it
ALLOWED_INVERSION_BATCHES = 1  # "no priority inversion larger than one consume batch"
EXAMPLES = 20


# -- total-queue -------------------------------------------------------------------------------


def percentile(values: list[float], q: float, digits: int = 4) -> float | None:
    """The q-quantile of ``values`` (nearest rank), rounded for the scorecard; None if none."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], digits)


def fraction(count: int, attempts: int) -> float | None:
    """count / attempts, rounded for the scorecard (None with no attempt)."""
    return round(float(Fraction(count, attempts)), 6) if attempts else None


def total_queue(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Jepsen's total-queue checker over the ledger (see the module's docstring)."""
    acknowledged = {entry["id"] for entry in records.get("submit", [])}
    attempts = acknowledged | {entry["id"] for entry in records.get("submit_error", [])}
    deliveries = Counter(entry["id"] for entry in records.get("start", []))
    # a --flow retrying task's runs that failed on purpose (rejected to be retried) are one
    # attempt with its retries, not duplicates
    deliveries.subtract(entry["id"] for entry in records.get("flow_end", [])
                        if entry.get("outcome") == "retry")
    ok = attempts & set(deliveries)
    lost = acknowledged - set(deliveries)
    recovered = ok - acknowledged
    unexpected = {tid: n for tid, n in deliveries.items() if tid not in attempts}
    duplicated = {tid: n - 1 for tid, n in deliveries.items() if tid in attempts and n > 1}
    return fields(len(attempts), len(acknowledged), ok=len(ok), lost=len(lost), recovered=len(recovered),
                  unexpected=sum(unexpected.values()), duplicated=sum(duplicated.values()),
                  examples={"lost": sorted(lost)[:EXAMPLES], "recovered": sorted(recovered)[:EXAMPLES],
                            "unexpected": sorted(unexpected)[:EXAMPLES],
                            "duplicated": sorted(duplicated)[:EXAMPLES]})


def fields(attempts: int, acknowledged: int, *, ok: int, lost: int, recovered: int, unexpected: int,
           duplicated: int, examples: dict[str, list[str]] | None = None) -> dict[str, Any]:
    counts = {"ok": ok, "lost": lost, "recovered": recovered, "unexpected": unexpected,
              "duplicated": duplicated}
    result: dict[str, Any] = {"attempts": attempts, "acknowledged": acknowledged}
    for name, count in counts.items():
        result[name] = count
        result[f"{name}_frac"] = fraction(count, attempts)
    result["valid"] = not lost and not unexpected
    if examples is not None:
        result["examples"] = examples
    return result


def from_verdict(verdict: dict[str, Any]) -> dict[str, Any]:
    """The same fields from the counts of a scorecard made before they existed (its ledger
    gone): every one follows from today's fields but ``unexpected``, which is exact only
    when no execution was of an unknown id (then 0); else it counts ids, not deliveries."""
    submitted, refused = verdict["submitted"], verdict.get("submit_errors", 0)
    lost = verdict.get("lost_never_started", verdict["lost"])
    recovered = verdict.get("submit_errors_executed") or 0
    return {**fields(submitted + refused, submitted, ok=submitted - lost + recovered, lost=lost,
                     recovered=recovered, unexpected=verdict.get("executions_not_submitted", 0),
                     duplicated=verdict["duplicates"]), "derived": True}


# -- the order check ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    id: str
    queue: str
    priority: int
    ready_lo: float  # the earliest it can have been ready (its publish began; its ETA)
    ready_hi: float  # the latest (its publish returned; its ETA)


@dataclass(frozen=True, eq=False)
class Batch:
    after: float  # the consume went out: the script ran later
    t: float  # its reply was read: the script ran before
    deliveries: tuple[tuple[str, str, int], ...]  # (queue, task id, delivery count), in order


@dataclass(frozen=True)
class First:
    """A message's first delivery: its batch and its place in it."""

    batch: Batch
    position: int


def queue_of(submit: dict[str, Any]) -> str:
    """The queue a submission went to (runs before 2026-12-06 did not record it)."""
    return str(submit.get("queue") or ("expiring" if submit.get("kind") == "routed" else "celery"))


def message(submit: dict[str, Any], etas_in_broker: bool = True) -> Message:
    """A submission's readiness. A countdown is ready at its ETA where the broker holds it
    (ours); kombu's stock transport delivers it at once (the worker holds it)."""
    sent = submit.get("sent", submit["t"])
    if etas_in_broker and submit["eligible"] > submit["t"]:  # ready at its ETA, by the server's clock
        eta = submit["eligible"]
        return Message(submit["id"], queue_of(submit), submit.get("priority") or 0,
                       max(submit["t"], eta - ETA_SLACK), max(sent, eta + ETA_SLACK))
    return Message(submit["id"], queue_of(submit), submit.get("priority") or 0, submit["t"], sent)


def batches(records: dict[str, list[dict[str, Any]]]) -> list[Batch]:
    """The recorded consume batches, in the order their replies were read."""
    found = [Batch(entry["after"], entry["t"], tuple((q, tid, n) for q, tid, n in entry["deliveries"]))
             for entry in records.get("batch", []) if entry.get("after") is not None]
    return sorted(found, key=lambda b: b.t)


def first_deliveries(taken: Iterable[Batch]) -> dict[str, First]:
    """Each message's first delivery, when the broker counted it as one (delivery count 0)."""
    seen: set[str] = set()
    firsts: dict[str, First] = {}
    for batch in taken:  # in reply order
        for position, (_, tid, count) in enumerate(batch.deliveries):
            if tid in seen:
                continue
            seen.add(tid)
            if not count:
                firsts[tid] = First(batch, position)
    return firsts


def in_delivered_queues(messages: dict[str, Message], firsts: dict[str, First]) -> dict[str, Message]:
    """Each message judged in the queue that delivered it: for a sharded queue (``x-shards``),
    its shard, where FIFO and priority hold; across shards they do not (docs/sharding.md)."""
    placed = dict(messages)
    for tid, first in firsts.items():
        delivered_from = first.batch.deliveries[first.position][0]
        if tid in placed and placed[tid].queue != delivered_from:
            placed[tid] = replace(placed[tid], queue=delivered_from)
    return placed


def served_until(fault: dict[str, Any]) -> float:
    """When a fault's old primary stopped serving clients: a split brain's ``split_until`` (its
    demotion; a fenced one refused writes from ``writes_until``, the end of the window its
    confirmed writes may be lost in, yet still served reads, subscriptions and publishes);
    another failover's ``writes_until``; else the fault's time."""
    return float(fault.get("split_until") or fault.get("writes_until", fault["t"]))


BACKLOG_SPAN = 5.0  # seconds either side of a moment: the first deliveries that tell its queue's wait


def backlog(submits: dict[str, dict[str, Any]], starts: list[dict[str, Any]]) -> Any:
    """A function of a moment: how long first deliveries started within BACKLOG_SPAN of it had
    waited since they were eligible (the median; 0 without any). A message delivered again
    waits in its queue behind the same backlog, so the time from a fault to a duplicate it
    caused grows by as much (the fenced run of seed 801: redeliveries 110-129 s after the
    executions they repeat, among first deliveries that had waited 78 s)."""
    seen: set[str] = set()
    found = []
    for start in sorted(starts, key=lambda s: s["t"]):
        if start["id"] in submits and start["id"] not in seen and not start.get("delivery_count"):
            seen.add(start["id"])
            found.append((start["t"], start["t"] - submits[start["id"]]["eligible"]))
    times = [t for t, _ in found]

    def wait_at(moment: float) -> float:
        near = sorted(w for _, w in found[bisect.bisect_left(times, moment - BACKLOG_SPAN):
                                         bisect.bisect_right(times, moment + BACKLOG_SPAN)])
        return max(0.0, near[len(near) // 2]) if near else 0.0

    return wait_at


def explaining_fault(faults: list[dict[str, Any]], ready: float, delivered: float) -> dict[str, Any] | None:
    """The first applied fault between FAULT_BEFORE before ``ready`` and ``delivered`` (a
    failover lasting until its old primary stopped serving, :func:`served_until`)."""
    return next((f for f in faults if not f.get("skipped")
                 and ready - FAULT_BEFORE <= served_until(f) and f["t"] <= delivered), None)


def lowest_priorities(taken: list[Batch], messages: dict[str, Message]) -> dict[Batch, dict[str, int]]:
    """Per batch, per queue: the lowest priority among what it took (of known messages)."""
    lowest: dict[Batch, dict[str, int]] = {}
    for batch in taken:
        per_queue: dict[str, int] = {}
        for queue, tid, _ in batch.deliveries:
            if tid in messages:
                per_queue[queue] = min(per_queue.get(queue, 256), messages[tid].priority)
        lowest[batch] = per_queue
    return lowest


def priority_inversions(messages: dict[str, Message], firsts: dict[str, First], taken: list[Batch],
                        faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message that waited while batches took lower-priority ones of its queue, with the
    number of those batches (its size)."""
    lowest = lowest_priorities(taken, messages)
    by_queue: dict[str, list[Batch]] = defaultdict(list)
    for batch in sorted(taken, key=lambda b: b.after):
        for queue in lowest[batch]:
            by_queue[queue].append(batch)
    starts = {queue: [b.after for b in found] for queue, found in by_queue.items()}
    inversions = []
    for tid, first in firsts.items():
        waiting = messages.get(tid)
        if waiting is None or not waiting.priority:
            continue
        taken_at = first.batch
        candidates, sent = by_queue.get(waiting.queue, []), starts.get(waiting.queue, [])
        # batches that went out after it was ready and no later than its own batch went out
        window = candidates[bisect.bisect_left(sent, waiting.ready_hi):
                            bisect.bisect_right(sent, taken_at.after)]
        ahead = [z for z in window if z is not taken_at and z.t <= taken_at.after
                 and lowest[z][waiting.queue] < waiting.priority]
        if ahead:
            inversions.append({"id": tid, "queue": waiting.queue, "priority": waiting.priority,
                               "batches": len(ahead), "ready": waiting.ready_hi, "delivered": taken_at.t,
                               "fault": explaining_fault(faults, waiting.ready_lo, taken_at.t)})
    return inversions


def fifo_violations(messages: dict[str, Message], firsts: dict[str, First],
                    faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message taken before one of its queue and priority that was ready strictly before it."""
    groups: dict[tuple[str, int], list[Message]] = defaultdict(list)
    for tid in firsts:
        if tid in messages:
            groups[(messages[tid].queue, messages[tid].priority)].append(messages[tid])
    violations = []
    for group in groups.values():
        violations += overtaken_across_batches(group, firsts, faults)
        violations += overtaken_within_batches(group, firsts, faults)
    return violations


def overtaken_across_batches(group: list[Message], firsts: dict[str, First],
                             faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """B overtook A when A was ready strictly before B and A's batch went out after B's reply
    was read. One pass: B by ready time, the A's ready before it by ready time, keeping the
    one whose batch went out latest."""
    earlier = sorted(group, key=lambda m: m.ready_hi)
    witness: Message | None = None
    found, i = [], 0
    for later in sorted(group, key=lambda m: m.ready_lo):
        while i < len(earlier) and earlier[i].ready_hi + SAME_MS < later.ready_lo:
            if witness is None or firsts[earlier[i].id].batch.after > firsts[witness.id].batch.after:
                witness = earlier[i]
            i += 1
        if witness is None:
            continue
        ahead, behind = firsts[later.id].batch, firsts[witness.id].batch
        if behind is not ahead and ahead.t <= behind.after:
            found.append(violation(witness, later, behind, faults))
    return found


def overtaken_within_batches(group: list[Message], firsts: dict[str, First],
                             faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """B ahead of A in one batch though A was ready strictly before B."""
    by_batch: dict[Batch, list[Message]] = defaultdict(list)
    for m in group:
        by_batch[firsts[m.id].batch].append(m)
    found = []
    for batch, taken in by_batch.items():
        for later in taken:
            before = [m for m in taken if m.ready_hi + SAME_MS < later.ready_lo
                      and firsts[m.id].position > firsts[later.id].position]
            if before:
                found.append(violation(before[0], later, batch, faults))
    return found


def violation(earlier: Message, later: Message, behind: Batch,
              faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": later.id, "overtook": earlier.id, "queue": later.queue, "priority": later.priority,
            "ready": later.ready_lo, "overtaken_ready": earlier.ready_hi, "overtaken_delivered": behind.t,
            "fault": explaining_fault(faults, earlier.ready_lo, behind.t)}


def order(records: dict[str, list[dict[str, Any]]], faults: list[dict[str, Any]],
          etas_in_broker: bool = True) -> dict[str, Any]:
    """The order check's fields (``measured`` False without recorded batches: a run before
    2026-12-06). ``etas_in_broker``: False for kombu's stock transport (see :func:`message`)."""
    taken = batches(records)
    if not taken:
        return {"measured": False}
    messages = {entry["id"]: message(entry, etas_in_broker) for entry in records.get("submit", [])}
    firsts = first_deliveries(taken)
    messages = in_delivered_queues(messages, firsts)
    inversions = priority_inversions(messages, firsts, taken, faults)
    beyond = [i for i in inversions if i["batches"] > ALLOWED_INVERSION_BATCHES]
    fifo = fifo_violations(messages, firsts, faults)
    return {
        "measured": True, "batches": len(taken), "first_deliveries": len(firsts),
        "priority_inversions": sum(1 for i in beyond if i["fault"] is None),
        "priority_inversions_explained": sum(1 for i in beyond if i["fault"] is not None),
        "priority_inversions_within_one_batch": len(inversions) - len(beyond),
        "priority_inversion_max_batches": max((i["batches"] for i in inversions), default=0),
        "fifo_violations": sum(1 for v in fifo if v["fault"] is None),
        "fifo_violations_explained": sum(1 for v in fifo if v["fault"] is not None),
        "priority_inversion_examples": beyond[:EXAMPLES], "fifo_violation_examples": fifo[:EXAMPLES],
    }
