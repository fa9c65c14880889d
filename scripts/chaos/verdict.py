"""The verdict: lost, pending, early, duplicates (attributed to faults or not), broker
clean, latency; and in Jepsen's terms (jepsen.py): total-queue's fields with their
fractions, and the order check. Computed from the ledger and an inspection of the broker at
the end."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import redis

from celery_redis_lua import ScriptLibrary
from scripts.chaos import flow, jepsen, ledger, partitions
from scripts.chaos.explain import events_lost, lost_to_failover, lost_to_power_loss, lost_to_repair
from scripts.chaos.profiles import (
    PARTITION_FAULT_KINDS,
    POWER_LOSS_KINDS,
    PRODUCER_FAULTS,
    TARGETED_FAULTS,
    Profile,
)

EARLY_TOLERANCE = 0.005  # seconds: ETAs travel as milliseconds
QUEUES = ("celery", "expiring")


def chaos_queues(with_flow: bool) -> tuple[str, ...]:
    """The run's queues by name (the flow queues too with --flow), as the workers consume them."""
    return QUEUES + (flow.QUEUES if with_flow else ())


def broker_state(client: redis.Redis, transport: str, queues: tuple[str, ...] = QUEUES) -> dict[str, Any]:
    """What is left in the broker for the chaos queues (``queues``: with --flow, the flow
    queues too; the capped one's counts then also under ``capped``)."""
    if transport == "ours":
        lib = ScriptLibrary(client)
        stats = lib.stats(list(queues))
        keys = lib.keys
        messages = sum(client.hlen(keys.message(q)) + client.hlen(keys.state(q)) for q in queues)
        index = sum(client.zcard(keys.index(q)) for q in queues)
        state = {"ready": sum(s.ready for s in stats), "delayed": sum(s.delayed for s in stats),
                 "in_flight": sum(s.in_flight for s in stats), "dead": sum(s.dead for s in stats),
                 "index_entries": index, "message_fields": messages,
                 "expiring_queue_exists": bool(lib.exists("expiring"))}
        state["pending"] = state["ready"] + state["delayed"] + state["in_flight"]
        state["clean"] = not (state["pending"] or index or messages or state["dead"])
        if flow.CAPPED in queues:
            capped = stats[queues.index(flow.CAPPED)]
            state["capped"] = {"ready": capped.ready, "delayed": capped.delayed,
                               "in_flight": capped.in_flight, "dead": capped.dead}
        return state
    lists = [key for key in client.scan_iter(match="*", count=1000)
             if key.decode().split("\x06\x16")[0] in QUEUES and client.type(key) == b"list"]
    ready = sum(client.llen(key) for key in lists)
    unacked, index = client.hlen("unacked"), client.zcard("unacked_index")
    return {"ready": ready, "unacked": unacked, "unacked_index": index,
            "pending": ready + unacked, "clean": not (ready or unacked or index)}


def attribute(prev: dict[str, Any], dup: dict[str, Any], faults: list[dict[str, Any]],
              window: float) -> dict[str, Any] | None:
    """The fault that explains a duplicate: one between (just before) the previous
    execution's receipt by its worker and this one's start, at most ``window`` before it. A
    worker fault counts only if it hit the worker of the previous execution, and is
    preferred (it is the specific cause); otherwise the earliest broker-wide fault in that
    span. The receipt, not the start: a worker that lost its connection goes on running
    what it had received, and those tasks' late acks are lost with the channel (the Valkey
    cluster run of 2026-12-02 saw seven start up to a second after a primary_kill). Entries
    of earlier runs have no receipt time; their start stands in.

    A failover (a fault entry with ``failover``) lasts from the fault to when the old primary
    stopped serving (jepsen.served_until: ``writes_until``; a split brain's ``split_until``,
    its demotion): until then two primaries can each deliver a message both hold (a
    countdown both promote, a message one of them already handed out) and take acks the
    other never sees. So a failover explains a duplicate whose executions
    span any part of that interval, not only those whose first execution came before it."""
    held_from = min(prev.get("received") or prev["t"], prev["t"]) - 1.0
    if (dup.get("delivery_count") or 0) < (prev.get("delivery_count") or 0):
        # a stale copy (an older delivery than the one that ran first): held since its receipt
        held_from = min(held_from, (dup.get("received") or dup["t"]) - 1.0)
    candidates = [f for f in faults if not f.get("skipped")
                  and held_from <= jepsen.served_until(f) and f["t"] <= dup["t"]
                  and dup["t"] - jepsen.served_until(f) <= window]
    on_worker = [f for f in candidates if f["kind"] in TARGETED_FAULTS
                 and f.get("target") in (prev["worker"], *stale_on_cut_worker(f, prev, dup))]
    broker_wide = [f for f in candidates if f["kind"] not in TARGETED_FAULTS | PRODUCER_FAULTS]
    return (on_worker or broker_wide or [None])[0]


def stale_on_cut_worker(fault: dict[str, Any], prev: dict[str, Any], dup: dict[str, Any]) -> tuple[str, ...]:
    """A partitioned worker can hold the second execution too: it held a delivery across the
    cut (prefetched before it, or a consume reply held in the network); its lease lapsed
    meanwhile (nobody could extend it), the message was delivered again and another worker
    ran it; after the heal the partitioned worker ran its stale copy, an older delivery
    (a lower delivery count) than the one that ran first."""
    if fault["kind"] in PARTITION_FAULT_KINDS and dup["t"] >= fault["t"] \
            and (dup.get("delivery_count") or 0) < (prev.get("delivery_count") or 0):
        return (dup["worker"],)
    return ()


def consume_rolled_back(prev: dict[str, Any], dup: dict[str, Any],
                        power_losses: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A power loss that erased one execution's consume: that delivery was received in the
    fsync window (from ``durable_until``, less a second, to the kill), so the server's record
    of it was cut and the message was delivered again after the restart, while the worker
    still held the first delivery. Its execution may start after the other's (a prefetched
    task held across the reconnect), which the rule of ``attribute`` does not cover."""
    for fault in power_losses:
        until, killed = fault.get("durable_until"), fault.get("killed_at", fault["t"])
        if until is None:
            continue
        for held, other in ((prev, dup), (dup, prev)):
            received = held.get("received") or held["t"]
            if until - 1.0 <= received <= killed and other["t"] >= killed:
                return fault
    return None


def publish_retried(submit: dict[str, Any], faults: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A broker-wide fault that hit while the task's publish was in flight (between the
    producer's call and its return): the script ran, the reply was lost with the
    connection, and kombu's retry published the message again, so two copies were stored
    and each ran once. Such a duplicate's first execution comes after the fault, which the
    rule of ``attribute`` does not cover."""
    return next((f for f in faults if not f.get("skipped") and f["kind"] not in TARGETED_FAULTS
                 and submit["t"] - 0.05 <= f["t"] <= submit.get("sent", submit["t"])), None)


# A duplicate started this long after its failover's window closed (``writes_until``: the old
# primary demoted or dead) was delivered again as the window closed.
ON_CLOSE_SECONDS = 2.0


def failover_duplicates(attributed: list[dict[str, Any]], applied: Counter[str]) -> dict[str, Any]:
    """Duplicates a failover explains, per kind of fault: per fault applied (issue 40 §3's
    target: at most 5 per sentinel_failover), and by when, as "previous -> duplicate". The
    previous delivery was received ``before`` the fault, ``during`` its window (the fault to
    jepsen.served_until) or ``after`` it; the duplicate started ``during`` the window, ``on_close``
    (within ON_CLOSE_SECONDS after it: delivered again once the old primary was gone or a
    fenced new one took writes again) or ``later`` (a lapsed lease swept back). A duplicate of a
    publish retried across the fault is ``publish_retried``."""
    kinds: dict[str, dict[str, Any]] = {}
    for entry in attributed:
        fault = entry["fault"]
        if not fault.get("failover"):
            continue
        until = jepsen.served_until(fault)
        received = entry["prev"].get("received") or entry["prev"]["t"]
        held = "before" if received < fault["t"] else "during" if received <= until else "after"
        start = entry["dup"]["t"]
        again = "during" if start <= until else "on_close" if start <= until + ON_CLOSE_SECONDS else "later"
        phase = "publish_retried" if entry.get("publish_retried") else f"{held} -> {again}"
        kind = kinds.setdefault(fault["kind"], {"faults": applied.get(fault["kind"], 0), "duplicates": 0,
                                                "phases": Counter()})
        kind["duplicates"] += 1
        kind["phases"][phase] += 1
    return {kind: {**k, "per_fault": round(k["duplicates"] / k["faults"], 2) if k["faults"] else None,
                   "phases": dict(k["phases"].most_common())} for kind, k in sorted(kinds.items())}


def order_holds(verdict: dict[str, Any]) -> bool:
    """Nothing delivered that nobody published (Jepsen's ``unexpected``), no priority inversion
    beyond one consume batch and no FIFO violation that a fault does not explain (when the
    run recorded its batches)."""
    order = verdict["order"]
    return not verdict["jepsen"]["unexpected"] and not order.get("priority_inversions") \
        and not order.get("fifo_violations")


def brief(fault: dict[str, Any]) -> dict[str, Any]:
    """A power-loss entry without its list of task ids (for the examples)."""
    return {k: v for k, v in fault.items() if k not in ("lost_task_ids", "server_said")}


def error_type(error: str) -> str:
    """'NotDurable' from "NotDurable('publish: ...')"."""
    return error.split("(", 1)[0] or error


def losses(submits: dict[str, dict[str, Any]], starts: dict[str, list[dict[str, Any]]],
           finishes: dict[str, list[dict[str, Any]]], failovers: list[dict[str, Any]],
           power_losses: list[dict[str, Any]], durability: str | None) -> dict[str, Any]:
    """The confirmed tasks that never finished, each explained (explain.py) or not."""
    lost = [tid for tid in submits if tid not in finishes]
    found: dict[str, list[dict[str, Any]]] = {"explained": [], "power": [], "repaired": [],
                                              "despite_durability": []}
    for tid in lost:
        example = {"id": tid, "kind": submits[tid]["kind"], "submit": submits[tid], "started": tid in starts}
        fault = lost_to_failover(submits[tid], failovers) if durability is None else None
        if fault is not None:
            found["explained"].append({**example, "fault": fault})
            continue
        fault = lost_to_repair(tid, power_losses)
        if fault is not None:
            found["repaired"].append({**example, "fault": brief(fault), "explained_by": "aof_repair"})
            continue
        fault = lost_to_power_loss(submits[tid], power_losses)
        if fault is None:
            continue
        seen = {"fault": brief(fault), "in_cut_bytes": tid in fault.get("lost_task_ids", ())}
        if durability and "aof" in durability:  # confirmed fsynced, yet published after the last fsync kept
            found["despite_durability"].append({**example, **seen})
        else:
            found["power"].append({**example, **seen, "explained_by": "power_loss"})
    explained_ids = {e["id"] for e in found["explained"] + found["power"] + found["repaired"]}
    return {**found, "lost": lost, "never_started": [tid for tid in lost if tid not in starts],
            "unexplained": [tid for tid in lost if tid not in explained_ids]}


def timing(submits: dict[str, dict[str, Any]],
           starts: dict[str, list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[float]]:
    """(runs started before their ETA, eligibility -> first start of every task that ran)."""
    early, latencies = [], []
    for tid, submit in submits.items():
        runs = starts.get(tid, [])
        if runs:
            latencies.append(runs[0]["t"] - submit["eligible"])
        early += [{"id": tid, "by": round(submit["eligible"] - run["t"], 4)} for run in runs
                  if run["t"] < submit["eligible"] - EARLY_TOLERANCE]
    return early, latencies


def duplicates_explained(submits: dict[str, dict[str, Any]], refused: dict[str, dict[str, Any]],
                         starts: dict[str, list[dict[str, Any]]], faults: list[dict[str, Any]],
                         power_losses: list[dict[str, Any]], deliberate: set[tuple[str, float]],
                         window: float, queue_wait: Any) -> dict[str, Any]:
    """Every run after a task's first, attributed to a fault or not: a confirmed task's, and
    one whose publish raised but ran anyway (maybe twice). A duplicate no fault explains
    within the window is tried again with the window grown by its queue's wait."""
    by_fault: Counter[str] = Counter()
    unattributable: list[dict[str, Any]] = []
    attributed: list[dict[str, Any]] = []
    publish_retries = 0
    for tid, entry, submit_error in [*((tid, e, False) for tid, e in submits.items()),
                                     *((tid, e, True) for tid, e in refused.items())]:
        for prev, dup in itertools.pairwise(starts.get(tid, [])):
            if (tid, prev["t"]) in deliberate:
                continue  # the retry of a run that failed on purpose (flow.py)
            fault = attribute(prev, dup, faults, window) or consume_rolled_back(prev, dup, power_losses) \
                or attribute(prev, dup, faults, window + queue_wait(dup["t"]))
            seen = {"id": tid, "kind": entry["kind"], "prev": prev, "dup": dup}
            if submit_error:
                seen["submit_error"] = True
            elif fault is None and (retried := publish_retried(entry, faults)):
                fault, seen["publish_retried"] = retried, True
                publish_retries += 1
            if fault is None:
                unattributable.append(seen)
            else:
                by_fault[fault["kind"]] += 1
                attributed.append({**seen, "fault": fault})
    return {"by_fault": by_fault, "unattributable": unattributable, "attributed": attributed,
            "publish_retries": publish_retries}


def loss_fields(loss: dict[str, Any], failovers: list[dict[str, Any]],
                power_losses: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict's fields of :func:`losses`."""
    explained, power, repaired = loss["explained"], loss["power"], loss["repaired"]
    return {
        "lost": len(loss["lost"]), "lost_never_started": len(loss["never_started"]),
        "lost_explained_by_failover": len(explained),
        "lost_by_failover": dict(Counter(e["fault"]["kind"] for e in explained)),
        "lost_unexplained": len(loss["unexplained"]), "lost_explained_examples": explained[:20],
        "failovers": len(failovers), "power_losses": len(power_losses),
        "lost_explained_by_power_loss": len(power),
        "lost_by_power_loss": dict(Counter(e["fault"]["kind"] for e in power)),
        "lost_explained_by_power_loss_in_cut_bytes": sum(1 for e in power if e["in_cut_bytes"]),
        "lost_to_aof_repair": len(repaired),
        "lost_in_fsync_window_despite_durability": len(loss["despite_durability"]),
        "lost_in_fsync_window_despite_durability_examples": loss["despite_durability"][:20],
        "lost_power_examples": (power + repaired)[:20], "lost_ids": loss["lost"][:50]}


def duplicate_fields(dups: dict[str, Any], applied: Counter[str]) -> dict[str, Any]:
    """The verdict's fields of :func:`duplicates_explained` (``applied``: faults per kind)."""
    by_fault, unattributable, attributed = dups["by_fault"], dups["unattributable"], dups["attributed"]
    return {
        "duplicates": sum(by_fault.values()) + len(unattributable),
        "duplicates_by_fault": dict(by_fault), "unattributable": len(unattributable),
        "duplicates_of_retried_publishes": dups["publish_retries"],
        "unattributable_examples": unattributable[:20], "attributed_examples": attributed[:30],
        "duplicates_per_fault": {k: round(n / applied[k], 2) for k, n in sorted(by_fault.items())
                                 if applied.get(k)},
        "failover_duplicates": failover_duplicates(attributed, applied)}


def fault_sets(records: dict[str, list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], ...]:
    """(every fault in time order, the faults that explain anything (a queue pause of --flow
    does not), the failovers applied, the power losses applied). A power loss is dated by its
    kill (entries recorded before 2026-12-06 11:10 had the moment the fault began, up to a
    second before it, as their ``t``)."""
    every_fault = sorted(({**f, "t": f["killed_at"]} if "killed_at" in f else f for f in records["fault"]),
                         key=lambda f: f["t"])
    faults = [f for f in every_fault if f["kind"] not in flow.FLOW_FAULT_KINDS]
    failovers = [f for f in faults if f.get("failover") and not f.get("skipped")]
    power_losses = [f for f in faults if f["kind"] in POWER_LOSS_KINDS and not f.get("skipped")
                    and not f.get("error")]
    return every_fault, faults, failovers, power_losses


def compute(records: dict[str, list[dict[str, Any]]], state: dict[str, Any],
            profile: Profile, transport: str, durability: str | None = None,
            flow_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """``durability``: the run's durability setting (ours only). Without one, a lost task
    may be explained by a failover's unreplicated writes (lost_to_failover); with one, a
    publish the broker confirmed was on the replica, so every loss counts against the run.
    Likewise for a power loss (lost_to_power_loss): without ``aof`` in the setting a task
    published in the fsync window is explained; with it, its publish waited for the fsync,
    so no loss is. A task whose publish was in bytes an operator's repair of a corrupt AOF
    cut (lost_to_repair) is reported as such, with or without durability: a documented
    action, not a silent loss.
    Tasks whose publish raised (submit errors, NotDurable among them) were never confirmed:
    they are not lost if they never run; if they do run, their executions are counted, and
    duplicates among them attributed like any other.
    ``flow_settings`` (a --flow run, scripts/chaos/flow.py): the flow checks run, under
    ``flow``, and each must hold; a retrying task's run after its deliberate failure is its
    retry, not a duplicate; a queue pause explains no duplicate, loss or lost event."""
    submits = {entry["id"]: entry for entry in records["submit"]}
    refused = {entry["id"]: entry for entry in records["submit_error"]}
    starts, finishes = ledger.by_id(records["start"]), ledger.by_id(records["finish"])
    every_fault, faults, failovers, power_losses = fault_sets(records)
    deliberate = {(e["id"], e["started"]) for e in records.get("flow_end", []) if e.get("outcome") == "retry"}
    window = 3 * profile.visibility_timeout + profile.slow_seconds[1] + 15
    loss = losses(submits, starts, finishes, failovers, power_losses, durability)
    early, latencies = timing(submits, starts)
    dups = duplicates_explained(submits, refused, starts, faults, power_losses, deliberate, window,
                                jepsen.backlog(submits, records["start"]))
    unknown = [tid for tid in starts if tid not in submits and tid not in refused]
    # a task whose publish raised was held from that publish (it has no eligibility time)
    held = {**{tid: {"eligible": e["t"]} for tid, e in refused.items()}, **submits}
    events = events_lost(records, finishes, faults, held)
    applied = Counter(f["kind"] for f in every_fault if not f.get("skipped"))
    verdict = {
        "submitted": len(submits), "submit_errors": len(errors := records["submit_error"]),
        "submit_errors_by_type": dict(Counter(error_type(e.get("error", "")) for e in errors)),
        "submit_errors_executed": sum(1 for tid in refused if tid in starts),
        "submit_errors_finished": sum(1 for tid in refused if tid in finishes), "durability": durability,
        "executions": len(records["start"]), "finished_ids": len(finishes),
        **loss_fields(loss, failovers, power_losses),
        "pending": state["pending"], "broker_clean": state["clean"],
        "broker": state, "early": len(early), "early_examples": early[:20],
        **duplicate_fields(dups, applied),
        "executions_not_submitted": len(unknown),
        "faults_applied": dict(applied),
        "faults_skipped": sorted({f["kind"] for f in every_fault if f.get("skipped")}),
        "duplicate_window_seconds": window,
        **events,
        "latency_seconds": {name: jepsen.percentile(latencies, q) for name, q in
                            (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0))},
        "jepsen": jepsen.total_queue(records),
        "order": jepsen.order(records, faults, etas_in_broker=transport == "ours"),
    }
    ok = (not loss["unexplained"] and not state["pending"] and not early and not dups["unattributable"]
          and state["clean"] and not events["events_lost_unexplained"] and order_holds(verdict))
    if any(f["kind"] in partitions.MEASURED for f in every_fault):
        verdict["partitions"] = partitions.recovery(records, every_fault)
        ok = ok and verdict["partitions"]["ok"]
    if flow_settings is not None:
        explained = set(loss["lost"]) - set(loss["unexplained"])
        verdict["flow"] = flow.check(records, every_fault, flow_settings, state.get("capped"), explained)
        ok = ok and verdict["flow"]["ok"]
    verdict["verdict"] = ("PASS" if ok else "FAIL") if transport == "ours" else "REPORT"
    verdict["would_pass"] = ok
    return verdict
