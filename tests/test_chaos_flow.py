"""The chaos harness's flow checks (issue 40 §4, scripts/chaos/flow.py), on hand-made ledgers:
a run that keeps the cap, waits out every backoff, delivers nothing from a paused queue and
drains passes; each mutant that breaks one of those fails the verdict, named by its check.
The real runs (workers, faults, a broker) are the slow smoke test with --flow."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from scripts.chaos import flow, jepsen, ledger, verdict
from scripts.chaos.profiles import PROFILES

T0 = 1796300000.0
W1, W2 = "w1-prefork@chaos", "w3-threads@chaos"
SETTINGS = flow.settings()
EMPTY = {"ready": 0, "delayed": 0, "in_flight": 0, "dead": 0}


def submit(tid: str, at: float, kind: str) -> dict[str, Any]:
    queue = flow.CAPPED if kind == "capped" else flow.RETRYING
    return {"id": tid, "t": T0 + at, "sent": T0 + at + 0.001, "kind": kind, "priority": 0,
            "eligible": T0 + at, "seconds": 0.5, "queue": queue}


def run(records: dict[str, list[dict[str, Any]]], tid: str, kind: str, began: float, ended: float | None,
        *, worker: str = W1, count: int = 0, outcome: str = "ok") -> None:
    """One run of a flow task: its start, its end (none if ``ended`` is None: cut off), and
    its finish when it succeeded."""
    started = T0 + began
    records["start"].append({"id": tid, "kind": kind, "t": started, "worker": worker, "pid": 1,
                             "delivery_count": count, "received": started - 0.01})
    if ended is None:
        return
    records["flow_end"].append({"id": tid, "t": T0 + ended, "started": started, "worker": worker, "pid": 1,
                                "kind": kind, "delivery_count": count, "outcome": outcome})
    if outcome == "ok":
        records["finish"].append({"id": tid, "t": T0 + ended + 0.001, "worker": worker, "pid": 1})


def batch(after: float, queue: str, tid: str, count: int = 0) -> dict[str, Any]:
    return {"t": T0 + after + 0.005, "after": T0 + after, "pid": 1, "channel": 1,
            "deliveries": [[queue, tid, count]]}


def good() -> dict[str, list[dict[str, Any]]]:
    """Capped runs up to the cap at once; a retry 0.5 s + 8 ms after its failure, the next
    1 s + 20 ms after the second; a pause of flow.capped from 10 s to 13 s, a task taken before
    it (started during it) and one after it."""
    records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in ledger.KINDS}
    for i, (tid, began, ended) in enumerate((("c1", 0.0, 1.0), ("c2", 0.1, 1.1), ("c3", 0.2, 1.2),
                                             ("c4", 1.05, 2.0), ("c5", 9.9, 10.5), ("c6", 13.1, 13.5))):
        records["submit"].append(submit(tid, began - 0.05, "capped"))
        records["batch"].append(batch(began - 0.03, flow.CAPPED, tid))
        run(records, tid, "capped", began, ended, worker=(W1, W2)[i % 2])
    records["submit"].append(submit("r1", 0.0, "retry"))
    records["batch"].append(batch(0.01, flow.RETRYING, "r1"))
    run(records, "r1", "retry", 0.02, 0.05, outcome="retry")
    run(records, "r1", "retry", 0.558, 0.6, count=1, outcome="retry", worker=W2)
    run(records, "r1", "retry", 1.62, 1.65, count=2)
    records["fault"].append({"kind": "queue_pause", "queue": flow.CAPPED, "t": T0 + 9.99, "acked": T0 + 10.0,
                             "resumed": T0 + 13.0, "resume_acked": T0 + 13.001, "paused_seconds": 3.0})
    records["event"] = [{"id": e["id"], "t": e["t"]} for e in records["finish"]]
    return records


def state(capped: dict[str, int] | None = None) -> dict[str, Any]:
    return {"pending": 0, "clean": True, "capped": EMPTY if capped is None else capped}


def judged(records: dict[str, list[dict[str, Any]]], capped: dict[str, int] | None = None) -> dict[str, Any]:
    return verdict.compute(records, state(capped), PROFILES["smoke"], "ours", None, SETTINGS)


def test_a_run_that_keeps_every_flow_promise_passes() -> None:
    found = judged(good())
    checks = found["flow"]
    assert checks["cap"] | {"over_cap_examples": []} == {
        "executions": 6, "peak_running": 3, "peak_at": T0 + 0.2, "cap": 3, "over_cap": 0,
        "over_cap_examples": [], "ends": {"recorded": 6}, "released_by_fault": 0,
        "peak_running_released_runs_to_their_end": 3, "ok": True}
    retry = checks["retry"]
    assert (retry["retries"], retry["early"], retry["min_margin_ms"]) == (2, 0, 8.0)
    assert (checks["pause"]["pauses"], checks["pause"]["violations"]) == (1, 0)
    assert checks["drain"]["ok"] and checks["drain"]["capped_submitted"] == 6
    # a retry is no duplicate, in the verdict nor in Jepsen's terms
    assert (found["duplicates"], found["unattributable"], found["jepsen"]["duplicated"]) == (0, 0, 0)
    assert found["verdict"] == "PASS", found
    assert "flow" not in verdict.compute(good(), state(), PROFILES["smoke"], "ours"), "only with --flow"


def test_a_fourth_capped_task_running_at_once_fails_the_cap() -> None:
    records = good()
    records["submit"].append(submit("c7", 0.4, "capped"))
    records["batch"].append(batch(0.45, flow.CAPPED, "c7"))
    run(records, "c7", "capped", 0.5, 0.9, worker=W2)
    found = judged(records)
    assert found["flow"]["cap"]["peak_running"] == 4 and found["flow"]["cap"]["over_cap"] == 1
    assert found["verdict"] == "FAIL"


def test_one_message_run_twice_at_once_holds_one_slot() -> None:
    """A duplicate (the main verdict attributes it) is one delivery in the broker at a time."""
    records = good()
    run(records, "c1", "capped", 0.5, 0.95, worker=W2)
    cap = flow.check(records, records["fault"], SETTINGS, EMPTY)["cap"]
    assert (cap["executions"], cap["peak_running"], cap["ok"]) == (7, 3, True)


def test_a_run_cut_by_a_worker_kill_ends_at_the_kill_and_an_unended_one_runs_on() -> None:
    records = good()
    records["submit"].append(submit("c7", 1.9, "capped"))
    run(records, "c7", "capped", 2.5, None, worker=W2)  # SIGKILLed at 3.0
    kill = {"kind": "worker_kill", "t": T0 + 3.0, "target": W2, "exit_seconds": 0.01}
    records["fault"].append(kill)
    run(records, "c7", "capped", 9.5, 9.6, count=1)  # after the visibility timeout
    found = flow.check(records, sorted(records["fault"], key=lambda f: f["t"]), SETTINGS, EMPTY)
    assert found["cap"]["ends"] == {"recorded": 7, "worker_fault": 1} and found["cap"]["ok"]
    assert found["drain"]["runs_cut_by_worker_kill"] == 1 and found["drain"]["ok"]
    records["fault"].remove(kill)  # nothing ended it: it counts as running to the end
    found = flow.check(records, records["fault"], SETTINGS, EMPTY)
    assert found["cap"]["ends"]["unknown"] == 1
    assert found["cap"]["peak_running"] == 3, "c5, c6 and the unended c7 at most"


def test_a_run_whose_delivery_a_cold_shutdown_handed_back_stops_counting_at_the_signal() -> None:
    """The seed-403 smoke run: SIGQUIT on a worker running two capped tasks; Celery's cold
    shutdown hands their deliveries back (1.2 s later) before it terminates the pool, two
    other tasks take the slots at once, and the two run again later: the two cut runs count
    up to the signal. Without the second runs nothing took their deliveries: over the cap."""
    records = good()
    for tid, began in (("q1", 3.0), ("q2", 3.1)):
        records["submit"].append(submit(tid, began - 0.1, "capped"))
        run(records, tid, "capped", began, None)
    records["fault"].append({"kind": "worker_quit", "t": T0 + 3.5, "target": W1, "exit_seconds": 1.2})
    run(records, "c8", "capped", 4.6, 5.5, worker=W2)
    run(records, "c9", "capped", 4.61, 5.6, worker=W2)
    run(records, "c10", "capped", 4.62, 5.7, worker=W2)
    records["submit"] += [submit(tid, 4.5, "capped") for tid in ("c8", "c9", "c10")]
    rerun = copy.deepcopy(records)
    run(rerun, "q1", "capped", 6.0, 6.5, worker=W2, count=1)
    run(rerun, "q2", "capped", 6.6, 7.0, worker=W2, count=1)
    cap = flow.check(rerun, sorted(rerun["fault"], key=lambda f: f["t"]), SETTINGS, EMPTY)["cap"]
    assert (cap["peak_running"], cap["released_by_fault"], cap["ok"]) == (3, 2, True), cap
    assert cap["peak_running_released_runs_to_their_end"] == 5
    cap = flow.check(records, sorted(records["fault"], key=lambda f: f["t"]), SETTINGS, EMPTY)["cap"]
    assert (cap["peak_running"], cap["released_by_fault"], cap["ok"]) == (5, 0, False), cap


@pytest.mark.parametrize("next_start", [0.3, 0.544])
def test_a_retry_before_its_backoff_fails(next_start: float) -> None:
    """0.5 s after a failure of delivery 0 (at 0.05 s): 0.25 s early, and 1 ms beyond the 5 ms tolerance."""
    records = good()
    records["start"][-2]["t"] = T0 + next_start
    records["flow_end"][-2]["started"] = T0 + next_start
    found = judged(records)
    assert found["flow"]["retry"]["early"] == 1 and found["verdict"] == "FAIL"
    assert found["flow"]["retry"]["min_margin_ms"] < -5


def test_the_second_backoff_is_twice_the_first() -> None:
    """Delivery 1's failure waits min(500 * 2, 1500) ms: a retry 0.6 s after it is early."""
    records = good()
    records["start"][-1]["t"] = T0 + 1.2
    records["flow_end"][-1]["started"] = T0 + 1.2
    found = judged(records)
    assert found["flow"]["retry"]["early"] == 1 and found["verdict"] == "FAIL"
    assert [flow.backoff_seconds(n, SETTINGS) for n in (0, 1, 2, 3, None)] == [0.5, 1.0, 1.5, 1.5, 0.5]


def test_an_early_retry_after_a_connection_fault_is_explained() -> None:
    """A CLIENT KILL between the failure and the reject hands the delivery back unrejected."""
    records = good()
    records["start"][-2]["t"] = T0 + 0.3
    records["flow_end"][-2]["started"] = T0 + 0.3
    records["fault"].append({"kind": "client_kill", "t": T0 + 0.06})
    retry = judged(records)["flow"]["retry"]
    assert (retry["early"], retry["early_explained"], retry["ok"]) == (0, 1, True)
    records["fault"][-1] = {"kind": "worker_kill", "t": T0 + 0.06, "target": W2}  # another worker
    assert judged(records)["flow"]["retry"]["early"] == 1


def test_a_consume_on_a_paused_queue_fails_the_pause() -> None:
    records = good()
    records["submit"].append(submit("c7", 10.8, "capped"))
    records["batch"].append(batch(11.0, flow.CAPPED, "c7"))  # sent after the pause was acked
    run(records, "c7", "capped", 11.02, 11.5)
    found = judged(records)
    assert found["flow"]["pause"]["violations"] == 1 and found["verdict"] == "FAIL"


def test_a_consume_sent_before_the_pause_or_of_another_queue_is_no_violation() -> None:
    records = good()
    records["batch"].append(batch(9.999, flow.CAPPED, "c5"))  # read after the ack, sent before it
    records["batch"].append(batch(11.0, flow.RETRYING, "r1", 3))
    assert judged(records)["flow"]["pause"] == {
        "pauses": 1, "violations": 0, "violation_examples": [], "undecided_batches": 0, "ok": True}


@pytest.mark.parametrize("mutant", ["slot_held", "unfinished", "not_read"])
def test_a_capped_queue_that_did_not_drain_fails(mutant: str) -> None:
    records, capped = good(), dict(EMPTY)
    if mutant == "slot_held":  # a killed worker's slot never came back
        capped["in_flight"] = 1
    elif mutant == "unfinished":
        records["submit"].append(submit("c7", 5.0, "capped"))
    found = verdict.compute(copy.deepcopy(records), state(None if mutant == "not_read" else capped),
                            PROFILES["smoke"], "ours", None, SETTINGS)
    if mutant == "not_read":
        found = verdict.compute(records, {"pending": 0, "clean": True}, PROFILES["smoke"], "ours", None,
                                SETTINGS)
    assert not found["flow"]["drain"]["ok"] and found["verdict"] == "FAIL"


def test_a_capped_task_lost_to_a_failover_is_no_leak() -> None:
    """A capped task that a primary confirmed just before a failover replaced it never ran
    (its write was not replicated: the loss is explained) and the queue drained: no slot
    leaked, so the drain holds (seed 1010 failed on one such task)."""
    records = good()
    records["submit"].append(submit("c7", 5.0, "capped"))
    records["fault"].append({"kind": "broker_pause", "t": T0 + 5.0, "writes_until": T0 + 5.5,
                             "failover": True, "queues": [flow.CAPPED]})
    found = judged(records)
    drain = found["flow"]["drain"]
    assert (drain["ok"], drain["capped_unfinished"], drain["capped_lost_explained"]) == (True, 0, 1)
    assert (found["lost_explained_by_failover"], found["verdict"]) == (1, "PASS")
    records["fault"][-1]["queues"] = ["celery"]  # a failover of another primary explains nothing
    assert not judged(records)["flow"]["drain"]["ok"]


def test_a_queue_pause_explains_no_duplicate() -> None:
    records = good()
    run(records, "c6", "capped", 14.0, 14.2, count=1)  # run again after the pause, no other fault
    found = judged(records)
    assert found["unattributable"] == 1 and found["verdict"] == "FAIL"
    assert jepsen.total_queue(records)["duplicated"] == 1
