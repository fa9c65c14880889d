"""Partition faults (issue 40 §1) on the topology of netns.py, and the recovery they are judged
by: for each partition kind, the time from healing to the cut-off client's first success
after it.

- ``partition_worker``: one worker's pair cut both ways for 2-30 s (the profile's
  ``partition_seconds``), then healed;
- ``partition_producer``: the producer's pair, the same way;
- ``partition_oneway``: the broker's packets to one worker dropped, the worker's own still
  arriving (the broker runs what it sends; the replies never come back);
- ``latency``: +200 ms with jitter needs ``tc ... netem``; where the kernel has none it is
  skipped, with the probe's error as the reason, in the log and in the scorecard.

Recovery (``recovery``): for a worker, heal -> the first consume batch its main process
read after the heal (batches.py; kombu's stock transport: its first BRPOP message; a worker
with no batch recorded: its first task start received after the heal); for the producer,
heal -> the first publish confirmed after it. A kind whose p99 exceeds RECOVERY_LIMIT, or
a partition after which the client never succeeded again, fails the run."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any

from scripts.chaos import split_brain
from scripts.chaos.jepsen import percentile
from scripts.chaos.netns import Topology
from scripts.chaos.profiles import PARTITION_FAULT_KINDS, SPLIT_BRAIN_KINDS
from scripts.chaos.switch import Switch

RECOVERY_LIMIT = 5.0  # seconds, p99 per kind (issue 40 §1)
# After a heal the next fault waits this long, and the load goes on at least this long: a
# partition that overran its slot in the schedule is not followed at once by another (which
# would cut the client off again before it could recover), nor by the end of the load.
CALM_SECONDS = 3 * RECOVERY_LIMIT
CUTS = {"partition_worker": False, "partition_producer": False, "partition_oneway": True}
# the kinds whose recovery the verdict reports (partition_primary's: split_brain.recovery)
MEASURED = (*CUTS, *SPLIT_BRAIN_KINDS)
PRODUCER = "producer"


def inject(kind: str, network: Topology | Switch | None, workers: list[Any], rng: random.Random,
           seconds: tuple[float, float], skipped: dict[str, str]) -> dict[str, Any]:
    """Cut, wait the drawn duration (the fault itself), heal; the entry's ``t`` is when the cut
    was in force (its commands returned; ``cut_began`` before them: a publish that began in
    between could still reach the broker, and be retried after the heal), ``healed`` the heal
    and ``writes_until`` too (the fault lasts that long, for the duplicate
    and lost-event rules of verdict.py)."""
    if kind in skipped:
        return {"skipped": skipped[kind]}
    if network is None or kind not in CUTS or (isinstance(network, Switch) and not network.clients):
        return {"skipped": "needs --partitions (the broker in its own network namespace, or each "
                           "client in its own on a switch)"}
    if kind == "partition_producer":
        label, target, pid = PRODUCER, PRODUCER, None
    else:
        worker = rng.choice(workers)
        label, target = worker.name, worker.hostname
        pid = worker.process.pid if worker.process is not None else None
    planned = rng.uniform(*seconds)
    began = time.time()
    network.partition(label, oneway=CUTS[kind])
    cut = time.time()  # in force from here on (the `ip` commands take up to ~0.1 s on a busy host)
    try:
        time.sleep(planned)  # the fault itself: cut off this long
    finally:
        network.heal(label)
    healed = time.time()
    return {"t": cut, "cut_began": began, "target": target, "target_pid": pid,
            "pair": network.client_address(label), "oneway": CUTS[kind],
            "partitioned_seconds": round(healed - cut, 3), "healed": healed, "writes_until": healed}


def first_after(times: list[float], after: float) -> float | None:
    later = [t for t in times if t >= after]
    return min(later) if later else None


def recovered_at(fault: dict[str, Any], records: dict[str, list[dict[str, Any]]]) -> float | None:
    """When the partitioned client first succeeded after the heal (None: never)."""
    healed = fault["healed"]
    if fault["target"] == PRODUCER:
        return first_after([s.get("sent", s["t"]) for s in records["submit"]], healed)
    consumed = [b["t"] for b in records.get("batch", []) if b.get("pid") == fault.get("target_pid")]
    if consumed or records.get("batch"):
        return first_after(consumed, healed)
    received = [s.get("received") or s["t"] for s in records["start"] if s.get("worker") == fault["target"]]
    return first_after(received, healed)


def recovery(records: dict[str, list[dict[str, Any]]], faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Per partition kind applied: how many, heal -> first success p50/p99/max, those that
    never recovered, and whether the kind holds (p99 within RECOVERY_LIMIT, none never)."""
    seconds: dict[str, list[float]] = defaultdict(list)
    never: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for fault in faults:
        if fault["kind"] not in CUTS or fault.get("skipped") or "healed" not in fault:
            continue
        at = recovered_at(fault, records)
        if at is None:
            never[fault["kind"]].append({k: fault.get(k) for k in ("t", "target", "healed")})
        else:
            seconds[fault["kind"]].append(at - fault["healed"])
    kinds: dict[str, Any] = {}
    for kind in sorted(set(seconds) | set(never)):
        values = seconds[kind]
        p99 = percentile(values, 0.99, 3)
        kinds[kind] = {"partitions": len(values) + len(never[kind]), "p50": percentile(values, 0.5, 3),
                       "p99": p99, "max": percentile(values, 1.0, 3), "never_recovered": len(never[kind]),
                       "never_examples": never[kind][:5],
                       "ok": not never[kind] and p99 is not None and p99 <= RECOVERY_LIMIT}
    split = split_brain.recovery(records, faults)
    if split is not None:
        kinds[split_brain.KIND] = split
    skipped = sorted({f["kind"] for f in faults if f["kind"] in PARTITION_FAULT_KINDS + SPLIT_BRAIN_KINDS
                      and f.get("skipped")})
    return {"limit_seconds": RECOVERY_LIMIT, "kinds": kinds,
            "skipped": {k: next(f["skipped"] for f in faults if f["kind"] == k and f.get("skipped"))
                        for k in skipped},
            "ok": all(k["ok"] for k in kinds.values())}


def line(p: dict[str, Any]) -> str:
    """The scorecard's partition recovery in one line of docs/RELIABILITY.md."""
    parts = [f"{kind} {k['partitions']}x: p50 {k['p50']} s, p99 {k['p99']} s, max {k['max']} s"
             + (f" (any worker; {k['failovers']} failed over, promotion -> every worker on the new "
                f"primary p50 {k['followed_p50']} s, max {k['followed_max']} s; reported, no limit)"
                if kind == split_brain.KIND else "")
             + (f", never recovered {k['never_recovered']}" if k["never_recovered"] else "")
             + ("" if k["ok"] else " **FAILS**") for kind, k in p["kinds"].items()]
    skipped = "".join(f"; {kind} skipped: {why}" for kind, why in p["skipped"].items())
    return (f"- partitions, heal -> first consume (producer: first confirmed publish), limit p99 "
            f"{p['limit_seconds']:g} s: {'; '.join(parts) or 'none applied'}{skipped}")
