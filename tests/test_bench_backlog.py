"""The benchmark's cost-in-the-backlog job (scripts/bench/backlog.py; ``make bench-all`` runs it
as its ``backlog`` job): it measures the queue that holds the backlog, leaves that queue as
deep as it found it, and the report turns what it measured into issue 15's targets.

The benchmark itself is not run by the suite; these guard what its figures rest on."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.bench import backlog, report
from scripts.bench.peers import Peer
from scripts.servers import Server


def test_the_backlog_job_measures_the_backlog_queue_and_leaves_it_as_deep(scratch_server: Server) -> None:
    peer = Peer("lua", f"redislua://127.0.0.1:{scratch_server.port}/0")
    result = backlog.cost_in_backlog(scratch_server, peer, [1200, 300], n=150, prefetch=20, size=100)

    # Smallest first, the smallest again at the end (a fresh server: the host's drift shows).
    assert [r["size"] for r in result["rounds"]] == [300, 1200, 300]
    for r in result["rounds"]:
        # The kombu phase published behind the backlog and consumed from its front, and gave
        # back what its consumer had prefetched: the sweep found every message of the backlog
        # to make overdue, and handed each one back.
        assert r["made_overdue"] == r["sweep_requeued"] == r["size"], r
        assert r["slowest_during_kombu"] and r["slowest_during_kombu"]["us"] > 0
        assert r["sweep_slowest_call"] and r["sweep_slowest_call"]["script"] == "sweep"
    stats = ScriptLibrary(scratch_server.client(), Keyspace()).stats([backlog.BACKLOG])[0]
    assert (stats.ready, stats.in_flight, stats.dead) == (300, 0, 0)

    # The smallest size's rate is the median over both of its rounds.
    smallest = [r for r in result["rounds"] if r["size"] == 300]
    assert result["sizes"]["300"]["publish"] == pytest.approx(
        statistics.median(x for r in smallest for x in r["publish_msgs_per_s"]))
    rates = [m["publish"] for m in result["sizes"].values()]
    assert result["publish_flat"] == pytest.approx(min(rates) / max(rates))
    # Each backlog run has its empty-queue run beside it; the paired flatness is taken per run.
    for r in result["rounds"]:
        assert len(r["empty_publish_msgs_per_s"]) == len(r["publish_msgs_per_s"]) == 1
    paired = {}
    for r in result["rounds"]:
        paired.setdefault(r["size"], []).append(r["consume_msgs_per_s"][0] / r["empty_consume_msgs_per_s"][0])
    medians = [statistics.median(v) for v in paired.values()]
    assert result["consume_flat_against_empty"] == pytest.approx(min(medians) / max(medians))
    slowest_sweep_us = max(r["sweep_slowest_call"]["us"] for r in result["rounds"])
    assert result["sweep_slowest_call_ms"] == slowest_sweep_us / 1000


def backlog_run(**measured: float) -> list[dict[str, Any]]:
    return [{"peer": "lua", "scenario": "backlog", "rep": 1, "result": measured}]


def backlog_verdicts(runs: list[dict[str, Any]], *, rows: bool = True) -> dict[str, bool | None]:
    metrics = report.metrics([], [], (), backlog=rows)
    summary = report.summarize(runs, ["lua"], metrics)
    return {t["target"]: t["met"] for t in report.targets(summary) if "backlog" in t["target"]}


def test_the_backlog_targets_are_met_or_missed_by_what_was_measured() -> None:
    # The verdict is the paired ratio's (each run over the empty-queue run beside it), not the raw one.
    verdicts = backlog_verdicts(backlog_run(publish_flat=0.5, consume_flat=0.99,
                                            publish_flat_against_empty=0.93, consume_flat_against_empty=0.85,
                                            sweep_slowest_call_ms=6.2))
    paired = "slowest size >= 0.9x fastest, each run over an empty queue's beside it"
    assert verdicts == {
        f"kombu publish flat in the backlog ({paired})": True,
        f"kombu consume+ack flat in the backlog ({paired})": False,
        "sweep in the backlog: slowest call <= 5 ms": False,
    }
    # A backlog job that failed is reported as not measured, never as met.
    failed = [{"peer": "lua", "scenario": "backlog", "rep": 1, "error": "boom"}]
    assert set(backlog_verdicts(failed).values()) == {None}
    # A run without the job (--backlog-sizes '') has no backlog targets at all.
    assert backlog_verdicts([], rows=False) == {}
