"""Output: a JSON scorecard in bench-results/ and a summary appended to docs/RELIABILITY.md."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from tools.chaos.workers import ROOT

RESULTS = ROOT / "bench-results"
KEPT = ROOT / "docs" / "chaos"  # the scorecards docs/RELIABILITY.md cites are committed
DOC = ROOT / "docs" / "RELIABILITY.md"
INTRO = """# Reliability: the chaos harness

`scripts/chaos/` runs real Celery workers (prefork and threads, `acks_late` on) against one
broker server (Redis with AOF `everysec` or `always`, or Valkey with AOF `everysec`), a
producer at a fixed rate (fast, slow = longer than the visibility timeout, countdown and
high-priority tasks) and a separate Valkey ledger where every submission and every
execution start and finish is recorded by task id. Faults come on a seeded schedule:
SIGKILL / SIGTERM / SIGQUIT of a worker (then restarted), a broker restart (SIGKILL, start
again on the same AOF), `CLIENT KILL TYPE normal`, `SCRIPT FLUSH`, and a broker pause
(SIGSTOP for a few seconds, SIGCONT). Then a bounded drain, and the verdict.

    make chaos ARGS='--profile smoke --broker valkey --seed 1'              # ~4 min
    make chaos ARGS='--profile long --broker redis-aof --seed 1'            # ~35 min
    make chaos ARGS='--profile smoke --broker valkey --transport stock'     # baseline
    .venv/bin/pytest -m slow tests/test_chaos_smoke.py                      # smoke as a test

What each line means:

- **lost**: submitted (accepted by the broker) and never finished by any worker. Must be 0.
- **pending**: messages still in the broker (ready, delayed or in flight) after the drain. Must be 0.
- **early**: executions that started before the task's eligibility time (its countdown ETA). Must be 0.
- **duplicates**: executions beyond the first, attributed to the latest fault that could
  explain them (a worker fault on the worker of the previous execution, or any broker
  fault, between the previous start and the duplicate); **unattributable** must be 0.
- **broker clean**: no message hashes, index entries, ready/delayed/in-flight or dead entries left.
- **latency**: from eligibility (submission, or ETA for a countdown) to the first start.
- **task events**: a real event receiver listens to the workers' `task-succeeded` events for
  the whole run; an event is lost when a task finished and its event never arrived, and
  explained when a connection fault hit while a worker held the task (from its eligibility
  to 2 s after its finish): Celery disables the event dispatcher of a connection that
  dropped, and a task running across the reconnect still sends through it, so its events go
  nowhere; a broker restart also loses the last second of writes. An unexplained loss fails
  the run.
- **the expiring route**: 10% of the tasks go through the topic exchange `chaos.jobs` to a
  queue with `x-expires` 60 s (its bindings live 60 s without a refresh), so a run also
  proves that an expiring queue with consumers, and its route, outlive every refresh.

Our transport gets PASS or FAIL; kombu's stock Redis transport is run the same way as a
report-only baseline (faults that make no sense for it, such as SCRIPT FLUSH, are skipped
and listed). JSON scorecards are written to `bench-results/chaos-*.json`; those of the runs
summarised below are kept in `docs/chaos/`, with examples of every duplicate kind.
"""


def write(card: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    run = card["run"]
    path = RESULTS / f"chaos-{run['transport']}-{run['broker']}-{run['profile']}-s{run['seed']}-{stamp}.json"
    path.write_text(json.dumps(card, indent=2, default=str))
    return path


def keep(path: Path) -> Path:
    """Copy a scorecard next to the document that cites it."""
    KEPT.mkdir(parents=True, exist_ok=True)
    target = KEPT / path.name
    shutil.copyfile(path, target)
    return target


def summary(card: dict[str, Any], path: Path) -> str:
    run, v = card["run"], card["verdict"]
    lat = v["latency_seconds"]
    by_fault = ", ".join(
        f"{k} {n} ({n / v['faults_applied'][k]:.2f} per fault)" if v["faults_applied"].get(k)
        else f"{k} {n}" for k, n in sorted(v["duplicates_by_fault"].items())) or "none"
    applied = ", ".join(f"{k} {n}" for k, n in sorted(v["faults_applied"].items())) or "none"
    skipped = ", ".join(v["faults_skipped"]) or "none"
    return "\n".join([
        f"## {run['started']}: {run['transport']} on {run['broker']} ({run['server']}), "
        f"{run['profile']}, seed {run['seed']}: **{v['verdict']}**",
        "",
        f"Command: `{run['command']}`; scorecard `{path.relative_to(ROOT)}`.",
        "",
        *([f"Verdict recomputed from the run's ledger under the current rules "
           f"({run['recomputed']['at']}); computed then: {run['recomputed']['verdict_then']}, from "
           f"`{run['recomputed']['from']}`.", ""] if run.get("recomputed") else []),
        f"- submitted {v['submitted']} (submit errors {v['submit_errors']}), executions "
        f"{v['executions']}, drain {run['drain_seconds_used']} s",
        f"- faults applied: {applied}; skipped: {skipped}",
        f"- lost {v['lost']} (never started {v['lost_never_started']}); pending {v['pending']}; "
        f"early {v['early']}; broker clean {'yes' if v['broker_clean'] else 'no'}",
        f"- duplicates {v['duplicates']} (by fault: {by_fault}); unattributable {v['unattributable']}",
        f"- task events: received {v.get('events_received', '-')}, lost {v.get('events_lost', '-')} "
        f"(not explained by a fault: {v.get('events_lost_unexplained', '-')})",
        f"- latency eligibility->start p50 {lat['p50']} s, p95 {lat['p95']} s, "
        f"p99 {lat['p99']} s, max {lat['max']} s",
        "",
    ])


def append_doc(card: dict[str, Any], path: Path) -> None:
    text = DOC.read_text() if DOC.exists() else INTRO
    DOC.write_text(text.rstrip("\n") + "\n\n" + summary(card, path))
