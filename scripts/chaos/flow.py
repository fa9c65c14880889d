"""Flow control under faults (issue 40 §4), with ``--flow``: a capped queue and a retrying
queue beside the usual ones, pauses in the schedule, and four checks in the verdict.

- ``flow.capped``: ``limit --in-flight CAP`` (celery_redis_lua.limit, the operator's API),
  its tasks acked late and running 0.5-2 s, so the cap binds now and then;
- ``flow.retry``: declared with ``x-delayed-retry-type failed`` and a backoff of
  RETRY_MIN_MS..RETRY_MAX_MS: each of its tasks raises ``Reject(requeue=True)`` on its first
  1-2 deliveries, and the broker holds it back ``min(min * (count + 1), max)`` ms, ``count``
  being the failed delivery's x-delivery-count;
- ``queue_pause``: a fault kind (celery_redis_lua.pause, held 2-4 s, then resume) on one of
  the two queues.

The workers record each flow task's start (the ``start`` entry every task writes) and its
end (``flow_end``: when it finished or failed, with the failed delivery's count), by their
own clocks. The checks (:func:`check`):

- ``cap``: at no instant more than CAP distinct capped tasks between start and end. A task's
  run lies inside its delivery's time in flight (the start after the delivery, the end before
  the late ack), so this is a lower bound of what the broker counted; a message run twice at
  once (a duplicate the main verdict attributes) counts once, as the broker holds one
  delivery of it at a time. A run a worker fault cut ends at that fault (its exit); a run
  without an end and no fault to end it is counted as running to the end of the run.
- ``retry``: each failed run's next start came at least its backoff after the failure's end
  (the reject came later still), within EARLY_TOLERANCE; an earlier one is explained only by
  a fault between the two that may have handed the failed delivery back without its reject
  (a connection or broker fault, or a fault on that worker).
- ``pause``: no consume batch (batches.py) that went out after the pause was acknowledged
  and whose reply was read before the resume was sent took a message of the paused queue.
  Deliveries taken before the pause (prefetched) may start during it: they are no violation.
- ``drain``: at the end the capped queue is empty (nothing ready, delayed or in flight) and
  every capped submission finished: a SIGKILLed worker's slots came back after the
  visibility timeout, or the queue would have stalled at the cap. A capped task whose loss
  the verdict explained (its publish confirmed by a primary a failover then replaced) never
  held a slot on the new primary: it is counted apart, not as unfinished (seed 1010).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any

from kombu.entity import Queue

from scripts.chaos.profiles import FLOW_FAULT_KINDS, WORKER_FAULTS

CAPPED, RETRYING = "flow.capped", "flow.retry"
QUEUES = (CAPPED, RETRYING)
CAP = 3
RETRY_MIN_MS, RETRY_MAX_MS = 500, 1500
RETRY_ARGUMENTS = {"x-delayed-retry-type": "failed", "x-delayed-retry-min": RETRY_MIN_MS,
                   "x-delayed-retry-max": RETRY_MAX_MS}
# Submissions per second of each flow kind, whatever the profile's rate. The capped queue
# serves about CAP / 1.25 s = 2.4 a second without faults, but under the long profile's
# (a killed worker's slots come back only after the visibility timeout; pauses) it served
# about 1.35 a second (seed 407), and 1.5 built a backlog that outlasted the drain; as
# shares of the producer's mix, 0.1 and 0.03 at the smoke profile's 10 a second.
RATES = {"capped": 1.0, "retry": 0.3}
KINDS = tuple(RATES)


def mix(rate: float) -> dict[str, float]:
    """The flow kinds' shares of a producer sending ``rate`` tasks a second."""
    return {kind: per_second / rate for kind, per_second in RATES.items()}
CAPPED_SECONDS = (0.5, 2.0)
RETRY_FAILURES = (1, 2)  # how many deliveries of a retrying task fail
PAUSE_KIND = FLOW_FAULT_KINDS[0]
EARLY_TOLERANCE = 0.005  # seconds: the server's clock in milliseconds


def queues() -> tuple[Queue, ...]:
    """The two queues, as the workers and the producer declare them."""
    return (Queue(CAPPED), Queue(RETRYING, queue_arguments=dict(RETRY_ARGUMENTS)))


def settings() -> dict[str, Any]:
    """What a scorecard keeps, for a verdict computed again later."""
    return {"cap": CAP, "capped_queue": CAPPED, "retry_queue": RETRYING,
            "retry_min_ms": RETRY_MIN_MS, "retry_max_ms": RETRY_MAX_MS}


def backoff_seconds(delivery_count: int | None, settings: dict[str, Any]) -> float:
    """The delay a failed reject of a delivery with this x-delivery-count makes (the
    reject's requeue counts one more delivery)."""
    count = (delivery_count or 0) + 1
    return float(min(int(settings["retry_min_ms"]) * count, int(settings["retry_max_ms"]))) / 1000


def next_task(rng: random.Random, kind: str) -> tuple[float, int]:
    """(seconds the task runs, deliveries that fail) of a flow submission."""
    if kind == "capped":
        return rng.uniform(*CAPPED_SECONDS), 0
    return rng.uniform(0.005, 0.05), rng.randint(*RETRY_FAILURES)


def apply_limit(app: Any) -> dict[str, Any]:
    """``limit flow.capped --in-flight CAP`` through the app's broker; the limits in force."""
    import celery_redis_lua

    limits = celery_redis_lua.limit(app, CAPPED, in_flight=CAP)
    return {"in_flight": limits.in_flight, "rate": limits.rate}


def pause_fault(app: Any, rng: random.Random, hold: tuple[float, float]) -> dict[str, Any]:
    """Pause one of the flow queues, hold it ``hold`` seconds (uniform), resume it. The
    entry's ``acked`` is when pause returned, ``resumed`` when resume was sent; resume is
    sent whatever happened in between."""
    import celery_redis_lua

    queue = rng.choice(QUEUES)
    seconds = rng.uniform(*hold)
    entry: dict[str, Any] = {"queue": queue, "t": time.time()}
    try:
        entry["changed"] = celery_redis_lua.pause(app, queue, "chaos queue_pause")
        entry["acked"] = time.time()
        time.sleep(seconds)  # the fault itself: the queue is paused this long
    finally:
        entry["resumed"] = time.time()
        entry["resume_changed"] = celery_redis_lua.resume(app, queue)
        entry["resume_acked"] = time.time()
    entry["paused_seconds"] = round(entry["resumed"] - entry["acked"], 3)
    return entry


def _runs(records: dict[str, list[dict[str, Any]]], kind: str, faults: list[dict[str, Any]],
          last: float) -> list[tuple[str, float, float, float, str, bool]]:
    """(task id, start, end counted against the cap, end, how the end is known, released) of
    every run of ``kind``'s tasks. A run whose message was delivered again later, and that a
    fault hit (a connection or broker fault, or one on its worker), is counted only up to
    that fault (``released``): the fault took its delivery away (a cold shutdown hands its
    deliveries back before it terminates the pool; a lost connection's deliveries come back
    while its tasks run on), so the broker no longer counted it."""
    ends = {(e["id"], e["started"]): e for e in records.get("flow_end", [])}
    starts_of: dict[str, list[float]] = defaultdict(list)
    for start in records["start"]:
        starts_of[start["id"]].append(start["t"])
    runs = []
    for start in records["start"]:
        if start.get("kind") != kind:
            continue
        end = ends.get((start["id"], start["t"]))
        how = "recorded"
        if end is not None:
            ended = float(end["t"])
        else:
            cut = [f for f in faults if f["kind"] in WORKER_FAULTS and f.get("target") == start["worker"]
                   and f["t"] >= start["t"] - 0.001]
            if cut:
                ended, how = cut[0]["t"] + cut[0].get("exit_seconds", 0.0), "worker_fault"
            else:
                ended, how = last, "unknown"
        counted, released = ended, False
        if any(t > start["t"] for t in starts_of[start["id"]]):
            taken = [f for f in faults
                     if start["t"] <= f["t"] < ended and takes_delivery(f, start["worker"])]
            if taken:
                counted, released = taken[0]["t"], True
        runs.append((start["id"], start["t"], counted, ended, how, released))
    return runs


def peak_of(intervals: list[tuple[str, float, float]],
            cap: int) -> tuple[int, float | None, list[dict[str, Any]]]:
    """The most distinct task ids between start and end at one instant, when, and the
    instants over ``cap``."""
    events = sorted([(s, 1, tid) for tid, s, _ in intervals] + [(e, -1, tid) for tid, _, e in intervals],
                    key=lambda ev: (ev[0], ev[1]))  # an end before a start at the same instant
    running: dict[str, int] = defaultdict(int)
    peak, over, peak_at = 0, [], None
    for t, step, tid in events:
        running[tid] += step
        if running[tid] == 0:
            del running[tid]
        if len(running) > peak:
            peak, peak_at = len(running), t
        if len(running) > cap:
            over.append({"t": t, "running": sorted(running)})
    return peak, peak_at, over


def cap_check(records: dict[str, list[dict[str, Any]]], faults: list[dict[str, Any]],
              cap: int, last: float) -> dict[str, Any]:
    runs = _runs(records, "capped", faults, last)
    peak, peak_at, over = peak_of([(tid, s, counted) for tid, s, counted, _, _, _ in runs], cap)
    to_the_end = peak_of([(tid, s, e) for tid, s, _, e, _, _ in runs], cap)[0]
    how: dict[str, int] = defaultdict(int)
    for run in runs:
        how[run[4]] += 1
    return {"executions": len(runs), "peak_running": peak, "peak_at": peak_at, "cap": cap,
            "over_cap": len(over), "over_cap_examples": over[:10], "ends": dict(how),
            "released_by_fault": sum(1 for run in runs if run[5]),
            "peak_running_released_runs_to_their_end": to_the_end, "ok": peak <= cap}


def takes_delivery(fault: dict[str, Any], worker: str) -> bool:
    """A fault that may take a delivery from the worker running it (hand it back, or lose
    it with the connection; a failed one without its reject): a connection or broker fault,
    or one on that worker (not a pause)."""
    if fault["kind"] in FLOW_FAULT_KINDS:
        return False
    return fault["kind"] not in WORKER_FAULTS or fault.get("target") == worker


def retry_check(records: dict[str, list[dict[str, Any]]], faults: list[dict[str, Any]],
                settings: dict[str, Any]) -> dict[str, Any]:
    starts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for start in sorted(records["start"], key=lambda e: e["t"]):
        starts[start["id"]].append(start)
    retries, early, explained, unretried = 0, [], [], 0
    margins: list[float] = []
    for end in records.get("flow_end", []):
        if end.get("outcome") != "retry":
            continue
        following = [s for s in starts.get(end["id"], []) if s["t"] > end["t"]]
        if not following:
            unretried += 1
            continue
        retries += 1
        backoff = backoff_seconds(end.get("delivery_count"), settings)
        margin = following[0]["t"] - (end["t"] + backoff)
        margins.append(margin)
        if margin >= -EARLY_TOLERANCE:
            continue
        example = {"id": end["id"], "failed": end["t"], "next_start": following[0]["t"],
                   "backoff": backoff, "early_by": round(-margin, 4)}
        fault = next((f for f in faults if end["started"] - 1.0 <= f["t"] <= following[0]["t"]
                      and takes_delivery(f, end["worker"])), None)
        if fault is None:
            early.append(example)
        else:
            explained.append({**example, "fault": {k: fault.get(k) for k in ("kind", "t", "target")}})
    return {"retries": retries, "early": len(early), "early_examples": early[:10],
            "early_explained": len(explained), "early_explained_examples": explained[:10],
            "failed_never_retried": unretried,
            "min_margin_ms": round(min(margins) * 1000, 1) if margins else None,
            "ok": not early}


def pause_check(records: dict[str, list[dict[str, Any]]], pauses: list[dict[str, Any]]) -> dict[str, Any]:
    violations, undecided = [], 0
    for pause in pauses:
        acked, resumed, queue = pause["acked"], pause["resumed"], pause["queue"]
        for batch in records.get("batch", []):
            taken = [d for d in batch["deliveries"] if d[0] == queue]
            if not taken or batch["t"] < acked or batch["t"] > resumed:
                continue
            if batch.get("after") is None:
                undecided += 1  # when this consume went out is unknown
            elif batch["after"] >= acked:
                violations.append({"queue": queue, "acked": acked, "resumed": resumed,
                                   "sent": batch["after"], "read": batch["t"], "took": taken})
    return {"pauses": len(pauses), "violations": len(violations), "violation_examples": violations[:10],
            "undecided_batches": undecided, "ok": not violations}


def drain_check(records: dict[str, list[dict[str, Any]]], capped_state: dict[str, Any] | None,
                faults: list[dict[str, Any]], explained: set[str]) -> dict[str, Any]:
    """``explained``: the ids of tasks whose loss the verdict explained (a write the new primary
    never had, a power loss's cut): no slot was ever held for them, so they are no leak."""
    capped = {e["id"] for e in records["submit"] if e.get("kind") == "capped"}
    finished = {e["id"] for e in records["finish"]}
    lost = capped & explained - finished
    unfinished = sorted(capped - finished - lost)
    kills = [f for f in faults if f["kind"] == "worker_kill"]
    cut = [s for s in records["start"] if s.get("kind") == "capped"
           and not any(e["id"] == s["id"] and e["started"] == s["t"] for e in records.get("flow_end", []))
           and any(f.get("target") == s["worker"] and f["t"] >= s["t"] for f in kills)]
    left = capped_state or {}
    pending = sum(left.get(k, 0) for k in ("ready", "delayed", "in_flight"))
    return {"ok": capped_state is not None and pending == 0 and not unfinished,
            "capped_submitted": len(capped), "capped_unfinished": len(unfinished),
            "capped_lost_explained": len(lost),
            "unfinished_examples": unfinished[:10], "capped_queue_at_end": capped_state,
            "runs_cut_by_worker_kill": len(cut)}


def check(records: dict[str, list[dict[str, Any]]], faults: list[dict[str, Any]],
          settings: dict[str, Any], capped_state: dict[str, Any] | None,
          explained: set[str] | None = None) -> dict[str, Any]:
    """The four checks; ``faults`` sorted by time (every kind), ``capped_state`` the capped
    queue's counts at the end (None if they could not be read), ``explained`` the ids of the
    tasks whose loss the verdict explained."""
    stamps = [e["t"] for kind in ("start", "finish", "flow_end", "fault") for e in records.get(kind, [])]
    last = max(stamps, default=time.time())
    pauses = [f for f in faults if f["kind"] == PAUSE_KIND and "acked" in f and "resumed" in f]
    result: dict[str, Any] = {"settings": settings,
              "cap": cap_check(records, faults, settings["cap"], last),
              "retry": retry_check(records, faults, settings),
              "pause": pause_check(records, pauses),
              "drain": drain_check(records, capped_state, faults, explained or set())}
    result["ok"] = all(result[name]["ok"] for name in ("cap", "retry", "pause", "drain"))
    return result
