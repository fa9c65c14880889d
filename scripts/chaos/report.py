"""Output: a JSON scorecard in bench-results/ and a summary appended to docs/RELIABILITY.md."""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from scripts.chaos import jepsen, partitions
from scripts.chaos.profiles import POWER_LOSS_KINDS, PROFILES
from scripts.chaos.workers import ROOT

RESULTS = ROOT / "bench-results"
KEPT = ROOT / "docs" / "chaos"  # the scorecards docs/RELIABILITY.md cites are committed
DOC = ROOT / "docs" / "RELIABILITY.md"
INTRO = """# Reliability: the chaos harness

`scripts/chaos/` runs real Celery workers (prefork and threads, `acks_late` on) against one
broker server (Redis with AOF `everysec` or `always`, or Valkey with AOF `everysec`) or a
Sentinel group (a primary, a replica and three sentinels: `--broker redis-sentinel`), a
producer at a fixed rate (fast, slow = longer than the visibility timeout, countdown and
high-priority tasks) and a separate Valkey ledger where every submission and every
execution start and finish is recorded by task id. Faults come on a seeded schedule:
SIGKILL / SIGTERM / SIGQUIT of a worker (then restarted), a broker restart (SIGKILL, start
again on the same AOF), `CLIENT KILL TYPE normal`, `SCRIPT FLUSH`, and a broker pause
(SIGSTOP for a few seconds, SIGCONT); with a Sentinel group, also SIGKILL of the primary
and `SENTINEL FAILOVER`; with a cluster (three primaries with a replica each:
`--broker valkey-cluster`), SIGKILL of a primary and `CLUSTER FAILOVER`, half of the broker
faults on the primary of the main queue. Then a bounded drain, and the verdict.

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
- **Jepsen total-queue** (since 2026-12-06): the fields of Jepsen's `total-queue` checker, each
  with its fraction of the attempts (every publish made, confirmed or raised): **ok**
  (delivered, i.e. started, at least once), **lost** (confirmed, never delivered),
  **recovered** (the publish raised, delivered anyway), **unexpected** (deliveries of a
  message never published; must be 0), **duplicated** (deliveries beyond the first).
- **order** (since 2026-12-06): each worker records every consume batch it took (when it
  went out, when its reply came, what it took, in order; for kombu's stock transport, each
  BRPOP's message). Among first deliveries, a
  **priority inversion** is a batch that certainly ran after a higher-priority message was
  ready and before the batch that took it, yet took a lower-priority one of the same queue;
  more than one such batch for a message fails the run. A **FIFO violation** is a message taken
  before one of its queue and priority that was ready strictly before it. Either is explained
  by a fault between the waiting message's readiness (less 1 s) and its delivery.
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
    raised = sum(1 for f in card.get("faults", []) if f.get("error") or f.get("settle_error"))
    durability = f", durability {run['durability']}" if run.get("durability") else ""
    if v.get("power_losses"):
        lost = power_lost_text(v)
    elif "lost_unexplained" in v and v.get("durability") and v.get("failovers"):
        lost = (f"lost {v['lost']} (never started {v['lost_never_started']}; with durability "
                f"{v['durability']} no loss is explained by a failover)")
    elif "lost_unexplained" in v and (v["lost_explained_by_failover"] or v.get("failovers")):
        by = ", ".join(f"{k} {n}" for k, n in sorted(v["lost_by_failover"].items()))
        lost = (f"lost {v['lost']} (never started {v['lost_never_started']}; explained by "
                f"unreplicated writes at a failover {v['lost_explained_by_failover']}"
                f"{f' ({by})' if by else ''}; unexplained {v['lost_unexplained']})")
    else:
        lost = f"lost {v['lost']} (never started {v['lost_never_started']})"
    errors = ", ".join(f"{k} {n}" for k, n in sorted(v.get("submit_errors_by_type", {}).items()))
    refused = (f" ({errors}; of them executed anyway {v['submit_errors_executed']})"
               if v["submit_errors"] and errors else "")
    return "\n".join([
        f"## {run['started']}: {run['transport']} on {run['broker']} ({run['server']}{durability}"
        f"{other_visibility(run)}), {run['profile']}, seed {run['seed']}: **{v['verdict']}**",
        "",
        f"Command: `{run['command']}`; scorecard `{path.relative_to(ROOT)}`.",
        "",
        *([f"Verdict recomputed from the run's ledger under the current rules "
           f"({run['recomputed']['at']}); computed then: {run['recomputed']['verdict_then']}, from "
           f"`{run['recomputed']['from']}`.", ""] if run.get("recomputed") else []),
        f"- submitted {v['submitted']} (submit errors {v['submit_errors']}{refused}), executions "
        f"{v['executions']}, drain {run['drain_seconds_used']} s",
        f"- faults applied: {applied}; skipped: {skipped}" + (
            f"; faults that raised {raised} (see the scorecard)" if raised else ""),
        *([failover_line(card)] if v.get("failovers") else []),
        *([power_loss_line(card)] if v.get("power_losses") else []),
        f"- {lost}; pending {v['pending']}; "
        f"early {v['early']}; broker clean {'yes' if v['broker_clean'] else 'no'}",
        f"- duplicates {v['duplicates']} (by fault: {by_fault}); unattributable {v['unattributable']}",
        *([failover_duplicates_line(v["failover_duplicates"])] if v.get("failover_duplicates") else []),
        *([refusals_line(run["server_errors"])] if "server_errors" in run else []),
        f"- task events: received {v.get('events_received', '-')}, lost {v.get('events_lost', '-')} "
        f"(not explained by a fault: {v.get('events_lost_unexplained', '-')})"
        + (f"; the receiver failed and was restarted {v['listener_restarts']} times "
           f"({v['events_lost_listener_down']} events lost while it was down; first error: "
           f"`{v['listener_errors'][0][:160]}`)" if v.get("listener_restarts") else ""),
        f"- latency eligibility->start p50 {lat['p50']} s, p95 {lat['p95']} s, "
        f"p99 {lat['p99']} s, max {lat['max']} s",
        *([jepsen_line(v["jepsen"])] if "jepsen" in v else []),
        *([order_line(v["order"])] if "order" in v else []),
        *([flow_line(v["flow"])] if "flow" in v else []),
        *([partitions.line(v["partitions"])] if "partitions" in v else []),
        *unmade_line(run, v),
        "",
    ])


def unmade_line(run: dict[str, Any], v: dict[str, Any]) -> list[str]:
    """Partition kinds --partitions could not make on this host or topology and that the
    schedule did not hold (those it held are among the skipped faults): said, not dropped."""
    unmade = {kind: why for kind, why in run.get("partitions", {}).get("skipped", {}).items()
              if kind not in v["faults_skipped"] and kind not in v["faults_applied"]}
    if not unmade:
        return []
    reasons = "; ".join(f"{why} ({', '.join(k for k, w in unmade.items() if w == why)})"
                        for why in dict.fromkeys(unmade.values()))
    return [f"- partition kinds not made here: {reasons}"]


def released(cap: dict[str, Any]) -> str:
    """The cap check's runs a fault released (scorecards before the rule have none)."""
    if not cap.get("released_by_fault"):
        return ""
    return (f"; {cap['released_by_fault']} runs released by a fault, with them to their end "
            f"{cap['peak_running_released_runs_to_their_end']}")


def flow_line(f: dict[str, Any]) -> str:
    """The --flow checks (scripts/chaos/flow.py) in one line."""
    cap, retry, pause, drain = f["cap"], f["retry"], f["pause"], f["drain"]
    ok = {True: "holds", False: "FAILS"}
    explained = f", {retry['early_explained']} explained by a fault" if retry["early_explained"] else ""
    lost_explained = (f", {drain['capped_lost_explained']} lost to a failover (explained)"
                      if drain.get("capped_lost_explained") else "")
    return (f"- flow control: cap {ok[cap['ok']]} ({cap['executions']} capped runs, peak running "
            f"{cap['peak_running']} of {cap['cap']}{released(cap)}); "
            f"retry {ok[retry['ok']]} ({retry['retries']} retries, "
            f"early {retry['early']}{explained}, least margin over the backoff {retry['min_margin_ms']} ms); "
            f"pause {ok[pause['ok']]} (pauses {pause['pauses']}, consumes of a paused queue "
            f"{pause['violations']}); drain {ok[drain['ok']]} ({drain['capped_submitted']} capped "
            f"submissions, unfinished {drain['capped_unfinished']}"
            f"{lost_explained}, runs cut by a worker_kill "
            f"{drain['runs_cut_by_worker_kill']})")


JEPSEN_FIELDS = ("ok", "lost", "recovered", "unexpected", "duplicated")


def frac_text(value: float | None) -> str:
    """A fraction of the attempts as the scorecard holds it (6 decimals), trailing zeros cut."""
    if value is None:
        return "-"
    return f"{value:.6f}".rstrip("0").rstrip(".") or "0"


def jepsen_line(j: dict[str, Any]) -> str:
    counts = ", ".join(f"{name} {j[name]} ({frac_text(j[name + '_frac'])})" for name in JEPSEN_FIELDS)
    return (f"- Jepsen total-queue: attempts {j['attempts']} (acknowledged {j['acknowledged']}); "
            f"{counts}; valid {'yes' if j['valid'] else 'no'}")


def order_line(o: dict[str, Any]) -> str:
    if not o.get("measured"):
        return "- order: not measured (no consume batches in the ledger: a run before 2026-12-06)"
    return (f"- order: {o['batches']} consume batches, {o['first_deliveries']} first deliveries; "
            f"priority inversions beyond one batch {o['priority_inversions']} (explained by a fault "
            f"{o['priority_inversions_explained']}; within one batch "
            f"{o['priority_inversions_within_one_batch']}; "
            f"largest {o['priority_inversion_max_batches']} batch(es)); FIFO violations "
            f"{o['fifo_violations']} (explained by a fault {o['fifo_violations_explained']})")


def other_visibility(run: dict[str, Any]) -> str:
    """", visibility N s" for a run whose visibility timeout is not its profile's (else "")."""
    visibility = run.get("profile_settings", {}).get("visibility_timeout")
    if visibility is None or run["profile"] not in PROFILES \
            or visibility == PROFILES[run["profile"]].visibility_timeout:
        return ""
    return f", visibility {visibility:g} s"


def jepsen_table(cards: list[dict[str, Any]]) -> str:
    """The Jepsen-format table of docs/faults.md, a column per scorecard: total-queue's fields
    with their fractions (derived from the counts of a scorecard made before they existed),
    and the order check where the run recorded its consume batches."""
    columns = []
    for card in cards:
        run, v = card["run"], card["verdict"]
        j = v.get("jepsen") or jepsen.from_verdict(v)
        columns.append((f"{'ours' if run['transport'] == 'ours' else 'stock kombu'}, {run['broker']}, "
                        f"{run['profile']} s{run['seed']}{other_visibility(run)}", j,
                        v.get("order") or {"measured": False}))
    rows = [["attempts"] + [str(j["attempts"]) for _, j, _ in columns]]
    rows += [[name] + [f"{j[name]} ({frac_text(j[name + '_frac'])})" for _, j, _ in columns]
             for name in JEPSEN_FIELDS]
    rows.append(["valid (nothing lost or unexpected)"]
                + ["yes" if j["valid"] else "**no**" for _, j, _ in columns])
    rows.append(["priority inversions > 1 batch / FIFO violations"] + [
        f"{o['priority_inversions']} / {o['fifo_violations']}" if o.get("measured") else "not recorded"
        for _, _, o in columns])
    rows += jepsen_failover_rows(cards)
    lines = ["| | " + " | ".join(label for label, _, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def failover_duplicates_line(by_kind: dict[str, dict[str, Any]]) -> str:
    """Duplicates per failover fault, and by when (verdict.failover_duplicates)."""
    parts = []
    for kind, k in by_kind.items():
        phases = ", ".join(f"{phase} {n}" for phase, n in k["phases"].items())
        per = f"{k['per_fault']:.2f}" if k["per_fault"] is not None else "-"
        parts.append(f"{kind} {k['duplicates']} in {k['faults']} faults, {per} per fault ({phases})")
    return ("- duplicates at failovers (previous delivery received -> duplicate started, before, during "
            "or after the failover's window; on_close: within 2 s after it): " + "; ".join(parts))


def refusals_line(errors: dict[str, int]) -> str:
    """What the data servers refused over the run (INFO errorstats, killed servers' included)."""
    return (f"- the servers refused: NOREPLICAS {errors.get('NOREPLICAS', 0)} (the fence: writes refused "
            f"while a primary lacked a good replica), READONLY {errors.get('READONLY', 0)} (a demoted "
            f"primary), LOADING {errors.get('LOADING', 0)}, ERR {errors.get('ERR', 0)} (mostly new "
            f"connections' handshakes: redis-py 8 sends CLIENT SETINFO twice and CLIENT "
            f"MAINT_NOTIFICATIONS, which Redis 7.0 refuses, 3 per connection; Valkey 7.2+ 1: a count "
            f"of reconnects, not of failures)")


def jepsen_failover_rows(cards: list[dict[str, Any]]) -> list[list[str]]:
    """Rows of the Jepsen table for runs with failovers: duplicates per failover fault, losses
    explained by unreplicated writes, and the fence's refusals where they were counted."""
    verdicts = [card["verdict"] for card in cards]
    if not any(v.get("failovers") for v in verdicts):
        return []
    kinds = sorted({k for v in verdicts for k in v.get("faults_applied", {})
                    if k in ("sentinel_failover", "primary_kill", "cluster_failover", "partition_primary")})
    rows = [[f"duplicates per {kind}"] + [
        f"{v['duplicates_by_fault'].get(kind, 0) / v['faults_applied'][kind]:.2f}"
        if v.get("faults_applied", {}).get(kind) else "-" for v in verdicts] for kind in kinds]
    rows.append(["lost, explained by unreplicated writes at a failover"]
                + [str(v.get("lost_explained_by_failover", "-")) for v in verdicts])
    if any("server_errors" in card["run"] for card in cards):
        rows.append(["writes refused by the fence (NOREPLICAS)"] + [
            str(card["run"]["server_errors"].get("NOREPLICAS", 0)) if "server_errors" in card["run"]
            else "not counted" for card in cards])
    return rows


def failover_line(card: dict[str, Any]) -> str:
    """How the Sentinel or cluster faults went: how many moved a primary, how long until a
    new one."""
    moved = [f for f in card.get("faults", []) if f.get("failover")]
    by_kind = Counter(f["kind"] for f in moved)
    named = [f["new_primary_seconds"] for f in moved if f.get("new_primary_seconds") is not None]
    demoted = [f["old_demoted_seconds"] for f in moved if f.get("old_demoted_seconds") is not None]
    parts = [f"- failovers {len(moved)} ({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))})"]
    if named:
        parts.append(f"new primary named after {min(named):.1f}-{max(named):.1f} s "
                     f"(median {statistics.median(named):.1f} s)")
    if demoted:
        parts.append(f"a still-running old primary demoted after {min(demoted):.1f}-{max(demoted):.1f} s")
    fenced = [f["fence_closed_seconds"] for f in moved if f.get("fence_closed_seconds") is not None]
    if fenced:  # partition_primary on a fenced group: the isolated primary refused writes from then
        parts.append(f"an isolated primary's fence closed after {min(fenced):.1f}-{max(fenced):.1f} s")
    down = [f["cluster_down_seconds"] for f in moved if f.get("cluster_down_seconds") is not None]
    if down:  # partition_primary on a cluster: the isolated primary refused every command from then
        parts.append(f"an isolated cluster primary said CLUSTERDOWN after {min(down):.1f}-{max(down):.1f} s")
    return "; ".join(parts)


def power_lost_text(v: dict[str, Any]) -> str:
    by = ", ".join(f"{k} {n}" for k, n in sorted(v["lost_by_power_loss"].items()))
    parts = [f"never started {v['lost_never_started']}",
             f"explained by power loss (published in the fsync window) {v['lost_explained_by_power_loss']}"
             + (f" ({by}; publish found in the bytes cut: "
                f"{v['lost_explained_by_power_loss_in_cut_bytes']})" if by else "")]
    if v["lost_to_aof_repair"]:
        parts.append(f"lost to an operator's repair of a corrupt AOF {v['lost_to_aof_repair']}")
    if v.get("durability"):
        parts.append(f"published in the fsync window though durability {v['durability']} confirmed "
                     f"them {v['lost_in_fsync_window_despite_durability']}")
    parts.append(f"unexplained {v['lost_unexplained']}")
    return f"lost {v['lost']} ({'; '.join(parts)})"


def power_loss_line(card: dict[str, Any]) -> str:
    """What the power losses cut and what the server did (scripts/chaos/aof.py)."""
    hits = [f for f in card.get("faults", []) if f.get("kind") in POWER_LOSS_KINDS
            and not f.get("skipped") and not f.get("error")]
    by_kind = Counter(f["kind"] for f in hits)
    did = Counter(f["server"] for f in hits)
    windows = sorted(f["unfsynced_seconds"] for f in hits if f.get("unfsynced_seconds") is not None)
    commands: Counter[str] = Counter()
    for f in hits:
        commands.update(f.get("lost_commands", {}))
    probes = [f["waitaof"] for f in hits if isinstance(f.get("waitaof"), dict)]
    asked = [w for w in probes if "unavailable" not in w]
    parts = [f"- power losses {len(hits)} ({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))}): "
             f"AOF cut {sum(f['lost_bytes'] for f in hits)} bytes in all, "
             f"{sum(commands.values())} commands "
             f"({', '.join(f'{k} {n}' for k, n in commands.most_common(4))}), "
             f"holding {sum(f['lost_task_id_count'] for f in hits)} task ids"]
    if windows:
        parts.append(f"last fsync before the kill {windows[0]:.2f}-{windows[-1]:.2f} s earlier "
                     f"(median {statistics.median(windows):.2f} s)")
    parts.append("the server " + ", ".join(f"{what} {n}" for what, n in sorted(did.items())))
    repairs = [f["repair"] for f in hits if f.get("repair")]
    if repairs:
        parts.append(f"repairs: {', '.join(sorted({r['command'] for r in repairs}))}")
    if asked:
        early = sum(1 for w in asked if w["confirmed"] and not w["fsynced_when_confirmed"])
        parts.append(f"WAITAOF 1 0 confirmed a marker before any fsync covered it in {early} of "
                     f"{len(asked)} probes")
    elif probes:
        parts.append(f"WAITAOF: {probes[0]['unavailable'][:60]}")
    skipped = [f for f in card.get("faults", []) if f.get("kind") in POWER_LOSS_KINDS and f.get("skipped")]
    if skipped:
        parts.append(f"skipped {len(skipped)}: {skipped[0]['skipped']}")
    return "; ".join(parts)


def append_doc(card: dict[str, Any], path: Path) -> None:
    text = DOC.read_text() if DOC.exists() else INTRO
    DOC.write_text(text.rstrip("\n") + "\n\n" + summary(card, path))
