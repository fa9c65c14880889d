"""The chaos harness's verdict: which fault explains a second run of a task.

A worker that loses its connection goes on running what it had received, and the late acks
of those tasks are lost with the channel, so the message runs again. The fault then came
between the first delivery's receipt and its start: the verdict dates a delivery by its
receipt, which the chaos app stamps on it in the worker's consumer (a real worker here)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from helpers import wait_until
from scripts.chaos import explain, jepsen, ledger, verdict
from scripts.chaos.profiles import PROFILES
from scripts.chaos.workers import ChaosWorker
from scripts.servers import Server

WINDOW = 60.0
# The Valkey cluster run of 2026-12-02 (seed 2): a primary_kill, then a task the threads
# worker had received just before it started 1.7 s after it, and ran again 4.4 s later.
KILL = {"kind": "primary_kill", "t": 1796199610.74921, "writes_until": 1796199610.74921,
        "failover": True, "queues": ["celery"]}


def run(t: float, received: float | None = None, worker: str = "w3-threads@chaos") -> dict[str, Any]:
    entry: dict[str, Any] = {"t": t, "worker": worker}
    if received is not None:
        entry["received"] = received
    return entry


def test_a_fault_between_receipt_and_start_explains_the_second_run() -> None:
    prev = run(1796199612.4850237, received=1796199610.52)
    assert verdict.attribute(prev, run(1796199616.8532083), [KILL], WINDOW) is KILL


def test_without_a_receipt_the_start_stands_in() -> None:
    """Entries of runs recorded before the stamp: the rule they were judged by."""
    prev = run(1796199612.4850237)
    assert verdict.attribute(prev, run(1796199616.8532083), [KILL], WINDOW) is None


def test_a_fault_well_before_the_receipt_explains_nothing() -> None:
    prev = run(1796199620.0, received=1796199615.0)
    assert verdict.attribute(prev, run(1796199625.0), [KILL], WINDOW) is None


def test_a_worker_fault_on_another_worker_explains_nothing() -> None:
    kill = {"kind": "worker_kill", "t": 1796199611.0, "target": "w1-prefork@chaos"}
    prev = run(1796199612.0, received=1796199610.5)
    assert verdict.attribute(prev, run(1796199616.0), [kill], WINDOW) is None
    assert verdict.attribute(prev, run(1796199616.0), [{**kill, "target": prev["worker"]}], WINDOW)


@pytest.fixture
def ledger_server() -> Iterator[Server]:
    with Server("valkey") as server:
        yield server


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_the_chaos_app_stamps_each_start_with_its_receipt(
        valkey_server: Server, ledger_server: Server, tmp_path: Path, pool: str) -> None:
    broker_url = f"redislua://127.0.0.1:{valkey_server.port}/0"
    ledger_url = f"redis://127.0.0.1:{ledger_server.port}/0"
    worker = ChaosWorker("stamp", pool, 1, {"CHAOS_BROKER_URL": broker_url, "CHAOS_LEDGER_URL": ledger_url},
                         tmp_path)
    producer = Celery("stamp", broker=broker_url, set_as_current=False)
    worker.start()
    try:
        sent = producer.send_task("chaos.work", ("fast", 0.0), queue="celery")
        client = ledger_server.client()
        [raw] = wait_until(lambda: client.lrange("chaos:start", 0, -1), timeout=30,
                           what="the task's start in the ledger")
        batches = [json.loads(entry) for entry in client.lrange("chaos:batch", 0, -1)]
    finally:
        worker.stop()
        producer.close()
    start = json.loads(raw)
    assert isinstance(start["received"], float)
    assert start["t"] - 30 < start["received"] <= start["t"]
    # The consume batch that took it (the order check's record; batches.py), before the start.
    [taken] = [b for b in batches if ["celery", sent.id, 0] in b["deliveries"]]
    assert taken["after"] <= taken["t"] <= start["received"]


# -- the verdict in Jepsen's terms (issue 40 §5), on synthetic ledgers -----------------------

T0 = 1796200000.0


def ledger_of(**kinds: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A ledger holding ``kinds`` (every other kind empty)."""
    return {kind: list(kinds.get(kind, [])) for kind in (*ledger.KINDS,)}


def submit(tid: str, at: float, *, priority: int = 0, countdown: float = 0.0) -> dict[str, Any]:
    """A publish that began at T0 + ``at`` and returned 1 ms later."""
    return {"id": tid, "t": T0 + at, "sent": T0 + at + 0.001, "kind": "priority" if priority else "fast",
            "priority": priority, "eligible": T0 + at + countdown, "seconds": 0.01, "queue": "celery"}


def start(tid: str, at: float, worker: str = "w1-prefork@chaos") -> dict[str, Any]:
    return {"id": tid, "t": T0 + at, "worker": worker, "received": T0 + at}


def batch(after: float, took: list[str], counts: dict[str, int] | None = None) -> dict[str, Any]:
    """A consume sent at T0 + ``after`` whose reply, ``took`` in that order, was read 10 ms later."""
    return {"t": T0 + after + 0.01, "after": T0 + after, "pid": 1, "channel": 1,
            "deliveries": [["celery", tid, (counts or {}).get(tid, 0)] for tid in took]}


def total_queue(**kinds: list[dict[str, Any]]) -> dict[str, Any]:
    found = jepsen.total_queue(ledger_of(**kinds))
    found.pop("examples")
    return found


def expected(attempts: int, acknowledged: int, **counts: int) -> dict[str, Any]:
    """total-queue's fields: ``counts`` as given (ok, lost, ... default 0), fractions of attempts."""
    names = ("ok", "lost", "recovered", "unexpected", "duplicated")
    result: dict[str, Any] = {"attempts": attempts, "acknowledged": acknowledged}
    for name in names:
        result[name] = counts.get(name, 0)
        result[f"{name}_frac"] = round(counts.get(name, 0) / attempts, 6)
    result["valid"] = not counts.get("lost") and not counts.get("unexpected")
    return result


CLEAN = {"submit": [submit("a", 0), submit("b", 1)], "start": [start("a", 2), start("b", 3)]}


def test_total_queue_of_a_clean_run() -> None:
    assert total_queue(**CLEAN) == expected(2, 2, ok=2)


def test_total_queue_counts_a_confirmed_publish_never_delivered_as_lost() -> None:
    found = total_queue(submit=[*CLEAN["submit"], submit("c", 2)], start=CLEAN["start"])
    assert found == expected(3, 3, ok=2, lost=1)
    assert found["lost_frac"] == 0.333333 and not found["valid"]


def test_total_queue_counts_a_raised_publish_delivered_anyway_as_recovered() -> None:
    refused = {"id": "c", "t": T0 + 2, "kind": "fast", "error": "NotDurable('publish: ...')"}
    found = total_queue(submit=CLEAN["submit"], submit_error=[refused],
                        start=[*CLEAN["start"], start("c", 4)])
    assert found == expected(3, 2, ok=3, recovered=1)
    assert found["valid"], "a recovered message is no fault of the queue"


def test_a_raised_publish_never_delivered_is_neither_lost_nor_ok() -> None:
    refused = {"id": "c", "t": T0 + 2, "kind": "fast", "error": "ConnectionError()"}
    assert total_queue(submit=CLEAN["submit"], submit_error=[refused], start=CLEAN["start"]) == \
        expected(3, 2, ok=2)


def test_total_queue_counts_each_delivery_of_a_message_never_published_as_unexpected() -> None:
    found = total_queue(submit=CLEAN["submit"], start=[*CLEAN["start"], start("x", 4), start("x", 5)])
    assert found == expected(2, 2, ok=2, unexpected=2)
    assert not found["valid"]


def test_total_queue_counts_deliveries_beyond_the_first_as_duplicated() -> None:
    again = [start("a", 4), start("a", 5), start("b", 6)]
    found = total_queue(submit=CLEAN["submit"], start=[*CLEAN["start"], *again])
    assert found == expected(2, 2, ok=2, duplicated=3)
    assert found["duplicated_frac"] == 1.5 and found["valid"]


def test_the_fields_derived_from_an_old_scorecard_agree_with_the_ledger() -> None:
    """Runs kept in docs/chaos/ predate the fields (their ledgers are gone): docs/faults.md's
    Jepsen table derives them from the scorecard's counts, which must say the same."""
    refused = {"id": "c", "t": T0 + 2, "kind": "fast", "error": "NotDurable('publish: ...')"}
    records = ledger_of(submit=[*CLEAN["submit"], submit("d", 3)], submit_error=[refused],
                        start=[*CLEAN["start"], start("a", 4), start("c", 5)],
                        finish=[start("a", 4.5), start("b", 3.5), start("c", 5.5)])
    records["event"] = [{"id": tid, "t": T0 + 6} for tid in "abc"]
    found = verdict.compute(records, {"pending": 0, "clean": True}, PROFILES["smoke"], "ours")
    derived = jepsen.from_verdict(found)
    assert derived.pop("derived") is True
    assert derived == {k: v for k, v in found["jepsen"].items() if k != "examples"} == \
        expected(4, 3, ok=3, lost=1, recovered=1, duplicated=1)


# -- order: priority inversions and FIFO, from the consume batches ---------------------------

# h (priority 9) is ready from T0 + 10.001; l1, l2 (priority 0) were waiting already.
WAITING = [submit("l1", 1), submit("l2", 2), submit("l3", 3), submit("h", 10, priority=9)]


def order(*batches: dict[str, Any], faults: list[dict[str, Any]] | None = None,
          submits: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    found = jepsen.order(ledger_of(submit=submits or WAITING, batch=list(batches)), faults or [])
    found.pop("priority_inversion_examples")
    found.pop("fifo_violation_examples")
    return found


def order_fields(batches: int, firsts: int, **counts: int) -> dict[str, Any]:
    names = ("priority_inversions", "priority_inversions_explained", "priority_inversions_within_one_batch",
             "priority_inversion_max_batches", "fifo_violations", "fifo_violations_explained")
    return {"measured": True, "batches": batches, "first_deliveries": firsts,
            **{name: counts.get(name, 0) for name in names}}


def test_a_message_taken_first_by_priority_is_no_inversion() -> None:
    assert order(batch(10.1, ["h", "l1"]), batch(10.2, ["l2", "l3"])) == order_fields(2, 4)


def test_two_batches_of_lower_priority_taken_while_a_higher_one_was_ready_are_an_inversion() -> None:
    assert order(batch(10.1, ["l1"]), batch(10.2, ["l2"]), batch(10.3, ["h", "l3"])) == \
        order_fields(3, 4, priority_inversions=1, priority_inversion_max_batches=2)


def test_one_batch_of_lower_priority_ahead_is_within_the_allowance() -> None:
    assert order(batch(10.1, ["l1"]), batch(10.3, ["h", "l2", "l3"])) == \
        order_fields(2, 4, priority_inversions_within_one_batch=1, priority_inversion_max_batches=1)


def test_batches_that_went_out_before_the_message_was_ready_are_no_inversion() -> None:
    """Their scripts may have run before its publish: nothing says they passed it over."""
    assert order(batch(9.9, ["l1"]), batch(9.95, ["l2"]), batch(10.3, ["h", "l3"])) == order_fields(3, 4)


def test_an_inversion_across_a_fault_is_explained() -> None:
    kill = {"kind": "client_kill", "t": T0 + 10.15}
    assert order(batch(10.1, ["l1"]), batch(10.2, ["l2"]), batch(10.3, ["h", "l3"]), faults=[kill]) == \
        order_fields(3, 4, priority_inversions_explained=1, priority_inversion_max_batches=2)


def test_a_message_taken_before_one_published_ahead_of_it_is_a_fifo_violation() -> None:
    assert order(batch(10.1, ["h", "l2"]), batch(10.2, ["l1", "l3"])) == order_fields(2, 4, fifo_violations=1)


def test_a_message_ahead_of_an_older_one_in_the_same_batch_is_a_fifo_violation() -> None:
    assert order(batch(10.1, ["h", "l1", "l3", "l2"])) == order_fields(1, 4, fifo_violations=1)


def test_countdowns_are_in_order_by_their_eta_not_their_publish() -> None:
    """c2 was published after c1 with a shorter countdown: it is due first."""
    submits = [submit("c1", 1, countdown=5.0), submit("c2", 2, countdown=1.0)]
    assert order(batch(7.0, ["c2", "c1"]), submits=submits) == order_fields(1, 2)
    assert order(batch(7.0, ["c1", "c2"]), submits=submits) == order_fields(1, 2, fifo_violations=1)


def test_where_the_worker_holds_countdowns_they_are_ready_at_their_publish() -> None:
    """kombu's stock transport delivers a countdown at once (the worker holds it until its ETA):
    taken before a task published after it is in order, not its ETA's."""
    submits = [submit("c1", 1, countdown=5.0), submit("f", 2)]
    ledger = ledger_of(submit=submits, batch=[batch(1.5, ["c1"]), batch(2.5, ["f"])])
    assert jepsen.order(ledger, [])["fifo_violations"] == 1, "by its ETA, c1 was not ready yet"
    assert jepsen.order(ledger, [], etas_in_broker=False)["fifo_violations"] == 0


def test_a_redelivery_is_left_out_of_the_order_check() -> None:
    """l1 came back (counted): it was taken before, by a consume whose reply nobody read."""
    assert order(batch(10.1, ["h", "l2"]), batch(10.2, ["l1", "l3"], counts={"l1": 1})) == order_fields(2, 3)


def test_a_fifo_violation_across_a_fault_is_explained() -> None:
    restart = {"kind": "broker_restart", "t": T0 + 10.05}
    assert order(batch(10.1, ["h", "l2"]), batch(10.2, ["l1", "l3"]), faults=[restart]) == \
        order_fields(2, 4, fifo_violations_explained=1)


def test_without_recorded_batches_the_order_is_not_measured() -> None:
    """A run before the batches were recorded (its scorecard recomputed from its ledger)."""
    assert jepsen.order(ledger_of(submit=WAITING), []) == {"measured": False}


@pytest.mark.parametrize("anomaly", ["unexpected", "priority_inversion", "fifo_violation"])
def test_the_verdict_fails_on_an_unexpected_delivery_or_an_order_violation(anomaly: str) -> None:
    submits = WAITING
    starts = [start(tid, 11 + i) for i, tid in enumerate(("h", "l1", "l2", "l3"))]
    batches = {"unexpected": [batch(10.1, ["h", "l1", "l2", "l3"])],
               "priority_inversion": [batch(10.1, ["l1"]), batch(10.2, ["l2"]), batch(10.3, ["h", "l3"])],
               "fifo_violation": [batch(10.1, ["h", "l2", "l1", "l3"])]}[anomaly]
    if anomaly == "unexpected":
        starts.append(start("x", 20))
    records = ledger_of(submit=submits, start=starts, finish=starts, batch=batches)
    records["event"] = [{"id": s["id"], "t": s["t"]} for s in starts]
    found = verdict.compute(records, {"pending": 0, "clean": True}, PROFILES["smoke"], "ours")
    assert found["verdict"] == "FAIL" and not found["would_pass"]
    clean = ledger_of(submit=submits, start=starts[:4], finish=starts[:4],
                      batch=[batch(10.1, ["h", "l1", "l2", "l3"])])
    clean["event"] = [{"id": s["id"], "t": s["t"]} for s in starts[:4]]
    passed = verdict.compute(clean, {"pending": 0, "clean": True}, PROFILES["smoke"], "ours")
    assert passed["verdict"] == "PASS", "the same run without the anomaly passes"


def test_the_ledger_client_follows_each_run_s_ledger() -> None:
    """Two runs in one process (the two smoke tests in one pytest session): the second must not
    write to the first one's ledger, stopped by then."""
    first, second = ledger.client("redis://127.0.0.1:1/0"), ledger.client("redis://127.0.0.1:2/0")
    assert [c.connection_pool.connection_kwargs["port"] for c in (first, second)] == [1, 2]
    assert ledger.client("redis://127.0.0.1:2/0") is second


@pytest.mark.parametrize("transport", ["ours", "stock"])
def test_the_order_check_on_a_real_worker_s_batches(valkey_server: Server, ledger_server: Server,
                                                    tmp_path: Path, transport: str) -> None:
    """A backlog of priority 0 and 9 tasks waits before the worker starts: every one is ready
    before any batch, so our worker's batches (4 at a time: prefetch 4 x 1 thread) must take
    the eight priority-9 ones first and each priority in publish order, and the check must
    find that so. kombu's stock Redis transport takes Celery's 9 as its lowest priority (a
    batch is one BRPOP there): the check finds each priority-9 task passed over."""
    broker_url = f"{'redislua' if transport == 'ours' else 'redis'}://127.0.0.1:{valkey_server.port}/0"
    ledger_url = f"redis://127.0.0.1:{ledger_server.port}/0"
    valkey_server.client(socket_timeout=10).flushall()
    producer = Celery("order", broker=broker_url, set_as_current=False)
    try:
        for i in range(24):
            priority = 9 if i % 3 == 2 else 0
            began = time.time()
            sent = producer.send_task("chaos.work", ("fast", 0.0), queue="celery", priority=priority)
            ledger.record("submit", ledger_url, id=sent.id, t=began, sent=time.time(), kind="fast",
                          priority=priority, eligible=began, seconds=0.0, queue="celery")
    finally:
        producer.close()
    env = {"CHAOS_BROKER_URL": broker_url, "CHAOS_LEDGER_URL": ledger_url}
    worker = ChaosWorker("order", "threads", 1, env, tmp_path)
    worker.start()
    try:
        client = ledger_server.client()
        wait_until(lambda: client.llen("chaos:finish") >= 24, timeout=60, what="the backlog run")
    finally:
        worker.stop()
    records = ledger.read(ledger_url)
    found = jepsen.order(records, [])
    if transport == "stock":
        assert (found["first_deliveries"], found["priority_inversions"], found["fifo_violations"]) == \
            (24, 8, 0), found
        return
    assert (found["first_deliveries"], found["priority_inversions"], found["fifo_violations"]) == \
        (24, 0, 0), found
    priority = {entry["id"]: entry["priority"] for entry in records["submit"]}
    batches = sorted(records["batch"], key=lambda b: b["t"])
    assert [priority[tid] for b in batches for _, tid, _ in b["deliveries"]] == [9] * 8 + [0] * 16, \
        "the backlog is taken highest priority first"
    # The same batches judged as if the priorities were the other way round (a transport that
    # served priority 0 first, as kombu's stock Redis transport does Celery's 9): inversions.
    for entry in records["submit"]:
        entry["priority"] = 9 - entry["priority"]
    assert jepsen.order(records, [])["priority_inversions"] > 0


# -- power loss (issue 40 §2): what the fsync window explains -----------------------------------

# The last fsync whose bytes the server kept began at T0 + 20.0; the kill came at T0 + 20.7.
POWER_LOSS = {"kind": "power_loss", "t": T0 + 20.7, "killed_at": T0 + 20.7, "durable_until": T0 + 20.0,
              "server": "loaded", "lost_task_ids": ["late"], "lost_bytes": 900}


def power_run(lost: list[dict[str, Any]], faults: list[dict[str, Any]],
              durability: str | None = None) -> dict[str, Any]:
    """A run whose tasks ``kept`` ran and whose ``lost`` ones never did, with ``faults``."""
    kept = [submit("kept", 5)]
    starts = [start("kept", 6)]
    records = ledger_of(submit=kept + lost, start=starts, finish=starts, fault=faults)
    records["event"] = [{"id": "kept", "t": T0 + 6}]
    return verdict.compute(records, {"pending": 0, "clean": True}, PROFILES["smoke"], "ours", durability)


def test_a_publish_confirmed_after_the_last_fsync_is_explained_by_the_power_loss() -> None:
    found = power_run([submit("late", 20.3)], [POWER_LOSS])
    assert (found["lost"], found["lost_explained_by_power_loss"], found["lost_unexplained"]) == (1, 1, 0)
    assert found["lost_by_power_loss"] == {"power_loss": 1}
    assert found["lost_explained_by_power_loss_in_cut_bytes"] == 1, "its id was in the bytes cut"
    assert found["verdict"] == "PASS"


def test_a_publish_confirmed_before_the_last_fsync_kept_fails_the_run() -> None:
    """Written before that fsync began, so on disk: a power loss cannot have taken it."""
    found = power_run([submit("early", 19.5)], [POWER_LOSS])
    assert (found["lost_explained_by_power_loss"], found["lost_unexplained"]) == (0, 1)
    assert found["verdict"] == "FAIL"


def test_a_publish_begun_after_the_kill_is_not_the_power_loss_s() -> None:
    found = power_run([submit("after", 21.0)], [POWER_LOSS])
    assert found["lost_unexplained"] == 1 and found["verdict"] == "FAIL"


def test_with_durability_aof_no_loss_is_explained_by_a_power_loss() -> None:
    """A publish under durability="aof" returned only once the AOF was fsynced: a loss in the
    window means the server confirmed an fsync that had not happened (reported as such)."""
    found = power_run([submit("late", 20.3)], [POWER_LOSS], durability="aof")
    assert (found["lost_explained_by_power_loss"], found["lost_unexplained"]) == (0, 1)
    assert found["lost_in_fsync_window_despite_durability"] == 1
    assert found["verdict"] == "FAIL"


def test_an_operator_s_repair_of_a_corrupt_aof_is_reported_not_silent() -> None:
    """redis-check-aof --fix cut fsynced bytes: the tasks published in them are lost to the
    repair (their ids were in the bytes cut), with or without durability."""
    corrupt = {**POWER_LOSS, "kind": "aof_corrupt", "durable_until": None,
               "server": "refused to load; loaded after check-aof --fix",
               "repair": {"command": "redis-check-aof --fix appendonlydir/appendonly.aof.manifest",
                          "exit_code": 0}, "lost_task_ids": ["fsynced", "late"]}
    for durability in (None, "aof"):
        found = power_run([submit("fsynced", 19.5), submit("late", 20.3)], [corrupt], durability)
        assert (found["lost_to_aof_repair"], found["lost_unexplained"]) == (2, 0), durability
        assert found["verdict"] == "PASS"


def test_a_power_loss_that_failed_explains_nothing() -> None:
    found = power_run([submit("late", 20.3)], [{**POWER_LOSS, "error": "RuntimeError('no fsync recorded')"}])
    assert found["lost_unexplained"] == 1 and found["power_losses"] == 0


def test_the_report_says_what_the_power_losses_cut_and_explained() -> None:
    from scripts.chaos import report
    fault = {**POWER_LOSS, "unfsynced_seconds": 0.7, "lost_commands": {"MULTI": 2, "EXEC": 2, "HSET": 3},
             "lost_task_id_count": 1, "waitaof": {"unavailable": "unknown command 'WAITAOF'"}}
    found = power_run([submit("late", 20.3)], [fault])
    line = report.power_loss_line({"faults": [fault]})
    assert "power losses 1 (power_loss 1): AOF cut 900 bytes" in line and "WAITAOF: unknown command" in line
    assert report.power_lost_text(found) == (
        "lost 1 (never started 1; explained by power loss (published in the fsync window) 1 "
        "(power_loss 1; publish found in the bytes cut: 1); unexplained 0)")


def test_a_delivery_whose_consume_a_power_loss_cut_explains_the_second_run() -> None:
    """The Redis AOF run of 2026-12-06 11:00 (seed 13): a countdown received by the threads
    worker 0.05 s after the last fsync kept and 0.75 s before the kill; the consume was cut,
    the restarted server delivered it again (delivery count 0 both times) to a prefork worker,
    which started it first; the threads worker started its copy 1.6 s later."""
    t0 = 1796555020.9571106
    fault = {"kind": "power_loss", "t": t0 - 2.153, "killed_at": t0 - 2.153, "durable_until": t0 - 2.956}
    prev = {"t": t0, "worker": "w1-prefork@chaos", "received": t0 - 0.1007}
    dup = {"t": t0 + 1.5678, "worker": "w3-threads@chaos", "received": t0 - 2.9047}
    assert verdict.attribute(prev, dup, [fault], WINDOW) is None, "the receipt rule alone does not"
    assert verdict.consume_rolled_back(prev, dup, [fault]) is fault
    received_before_the_window = {**dup, "received": t0 - 4.5}
    assert verdict.consume_rolled_back(prev, received_before_the_window, [fault]) is None


def shard_batch(after: float, took: list[tuple[str, str]]) -> dict[str, Any]:
    """:func:`batch` from the shards of a sharded ``celery``: ``took`` as (shard, task id)."""
    return {**batch(after, []), "deliveries": [[f"celery~{shard}/2.0", tid, 0] for shard, tid in took]}


def test_a_sharded_queue_is_judged_per_shard() -> None:
    """FIFO and priority hold within a shard, not across shards (docs/sharding.md): l2 on
    shard 1 taken before l1 on shard 0 is in order; within shard 0, l3 before l1 is not."""
    in_order = shard_batch(10.1, [("1", "l2"), ("0", "h")]), shard_batch(10.2, [("0", "l1"), ("0", "l3")])
    assert order(*in_order) == order_fields(2, 4)
    overtaken = shard_batch(10.1, [("0", "h"), ("0", "l3")]), shard_batch(10.2, [("0", "l1"), ("1", "l2")])
    assert order(*overtaken) == order_fields(2, 4, fifo_violations=1)
    # two batches of the other shard's low priority while h waited are no inversion on h's shard...
    assert order(shard_batch(10.1, [("1", "l1")]), shard_batch(10.2, [("1", "l2")]),
                 shard_batch(10.3, [("0", "h"), ("1", "l3")])) == order_fields(3, 4)
    # ...two of its own are
    assert order(shard_batch(10.1, [("0", "l1")]), shard_batch(10.2, [("0", "l2")]),
                 shard_batch(10.3, [("0", "h"), ("0", "l3")])) == \
        order_fields(3, 4, priority_inversions=1, priority_inversion_max_batches=2)


def test_a_failover_explains_the_losses_of_the_queues_its_primary_held() -> None:
    """On a cluster a failover explains a lost task only of a queue its primary held, a
    --flow queue as much as celery (seed 406: a flow.retry task the paused primary confirmed
    was judged as celery's, which lived elsewhere, and the run failed)."""
    failover = {"kind": "broker_pause", "t": T0, "writes_until": T0 + 3, "queues": ["expiring", "flow.retry"]}
    retry = {"id": "r", "t": T0 + 1, "sent": T0 + 2.9, "kind": "retry", "queue": "flow.retry"}
    fast = {"id": "f", "t": T0 + 1, "sent": T0 + 2.9, "kind": "fast", "queue": "celery"}
    assert explain.lost_to_failover(retry, [failover]) is failover
    assert explain.lost_to_failover(fast, [failover]) is None
