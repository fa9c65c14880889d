"""The verdict: lost, pending, early, duplicates (attributed to faults or not), broker
clean, latency. Computed from the ledger and an inspection of the broker at the end."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import redis

from celery_redis_lua import ScriptLibrary
from tools.chaos import ledger
from tools.chaos.profiles import WORKER_FAULTS, Profile

EARLY_TOLERANCE = 0.005  # seconds: ETAs travel as milliseconds
QUEUES = ("celery", "expiring")
# A task's events are lost when a connection fault hits while its worker holds the task:
# Celery disables the event dispatcher of a connection that dropped, and a request that
# runs across the reconnect still sends through the old one (its events go nowhere); a
# broker restart also loses the last second of writes (AOF everysec). So a lost event is
# explained by a fault between the task's eligibility and EVENT_AFTER seconds after its
# finish (the events are flushed about then).
EVENT_AFTER = 2.0


def broker_state(client: redis.Redis, transport: str) -> dict[str, Any]:
    """What is left in the broker for the default queue."""
    if transport == "ours":
        lib = ScriptLibrary(client)
        stats = lib.stats(list(QUEUES))
        keys = lib.keys
        messages = sum(client.hlen(keys.message(q)) + client.hlen(keys.state(q)) for q in QUEUES)
        index = sum(client.zcard(keys.index(q)) for q in QUEUES)
        state = {"ready": sum(s.ready for s in stats), "delayed": sum(s.delayed for s in stats),
                 "in_flight": sum(s.in_flight for s in stats), "dead": sum(s.dead for s in stats),
                 "index_entries": index, "message_fields": messages,
                 "expiring_queue_exists": bool(lib.exists("expiring"))}
        state["pending"] = state["ready"] + state["delayed"] + state["in_flight"]
        state["clean"] = not (state["pending"] or index or messages or state["dead"])
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
    execution's start and this one, at most ``window`` before it. A worker fault counts only
    if it hit the worker of the previous execution, and is preferred (it is the specific
    cause); otherwise the earliest broker-wide fault in that span."""
    candidates = [f for f in faults if not f.get("skipped")
                  and prev["t"] - 1.0 <= f["t"] <= dup["t"] and dup["t"] - f["t"] <= window]
    on_worker = [f for f in candidates if f["kind"] in WORKER_FAULTS
                 and f.get("target") == prev["worker"]]
    broker_wide = [f for f in candidates if f["kind"] not in WORKER_FAULTS]
    return (on_worker or broker_wide or [None])[0]


def events_lost(records: dict[str, list[dict[str, Any]]], finishes: dict[str, list[dict[str, Any]]],
                faults: list[dict[str, Any]], submits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Tasks that finished but whose ``task-succeeded`` event never reached the receiver;
    explained when a fault (broker-wide, or on the worker that ran it) hit while the worker
    held the task: from its eligibility to EVENT_AFTER seconds after its finish."""
    received = {entry["id"] for entry in records.get("event", [])}
    lost = [tid for tid in finishes if tid not in received]
    unexplained = []
    for tid in lost:
        finish = finishes[tid][-1]
        held_from = submits[tid]["eligible"] - 1.0 if tid in submits else finish["t"] - 1.0
        if not any(held_from <= f["t"] <= finish["t"] + EVENT_AFTER and (
                f["kind"] not in WORKER_FAULTS or f.get("target") == finish["worker"])
                for f in faults if not f.get("skipped")):
            unexplained.append(tid)
    return {"events_received": len(received), "events_lost": len(lost),
            "events_lost_unexplained": len(unexplained), "events_lost_examples": unexplained[:20]}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def compute(records: dict[str, list[dict[str, Any]]], state: dict[str, Any],
            profile: Profile, transport: str) -> dict[str, Any]:
    submits = {entry["id"]: entry for entry in records["submit"]}
    starts, finishes = ledger.by_id(records["start"]), ledger.by_id(records["finish"])
    faults = sorted(records["fault"], key=lambda f: f["t"])
    window = 3 * profile.visibility_timeout + profile.slow_seconds[1] + 15
    lost = [tid for tid in submits if tid not in finishes]
    never_started = [tid for tid in lost if tid not in starts]
    early, latencies = [], []
    duplicates: Counter[str] = Counter()
    unattributable: list[dict[str, Any]] = []
    attributed: list[dict[str, Any]] = []
    for tid, submit in submits.items():
        runs = starts.get(tid, [])
        if runs:
            latencies.append(runs[0]["t"] - submit["eligible"])
        early += [{"id": tid, "by": round(submit["eligible"] - run["t"], 4)} for run in runs
                  if run["t"] < submit["eligible"] - EARLY_TOLERANCE]
        for prev, dup in itertools.pairwise(runs):
            fault = attribute(prev, dup, faults, window)
            if fault is None:
                unattributable.append({"id": tid, "kind": submit["kind"], "prev": prev, "dup": dup})
            else:
                duplicates[fault["kind"]] += 1
                attributed.append({"id": tid, "kind": submit["kind"], "fault": fault,
                                   "prev": prev, "dup": dup})
    unknown = [tid for tid in starts if tid not in submits]
    events = events_lost(records, finishes, faults, submits)
    applied = Counter(f["kind"] for f in faults if not f.get("skipped"))
    verdict = {
        "submitted": len(submits), "submit_errors": len(records["submit_error"]),
        "executions": len(records["start"]), "finished_ids": len(finishes),
        "lost": len(lost), "lost_never_started": len(never_started),
        "lost_ids": lost[:50], "pending": state["pending"], "broker_clean": state["clean"],
        "broker": state, "early": len(early), "early_examples": early[:20],
        "duplicates": sum(duplicates.values()) + len(unattributable),
        "duplicates_by_fault": dict(duplicates), "unattributable": len(unattributable),
        "unattributable_examples": unattributable[:20],
        "attributed_examples": attributed[:30],
        "executions_not_submitted": len(unknown),
        "faults_applied": dict(applied),
        "faults_skipped": sorted({f["kind"] for f in faults if f.get("skipped")}),
        "duplicate_window_seconds": window,
        **events,
        "latency_seconds": {name: percentile(latencies, q) for name, q in
                            (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0))},
    }
    ok = (not lost and not state["pending"] and not early and not unattributable
          and state["clean"] and not events["events_lost_unexplained"])
    verdict["verdict"] = ("PASS" if ok else "FAIL") if transport == "ours" else "REPORT"
    verdict["would_pass"] = ok
    return verdict
