"""python -m scripts.bench: every scenario for every peer, interleaved, repeated; medians and ratios.

    python -m scripts.bench              # defaults: ~10 minutes on 2 cores
    python -m scripts.bench --quick      # ~1-2 minutes
    python -m scripts.bench --durability-only   # the durability option's cost (scripts/bench/durability.py)
    python -m scripts.bench --peer mine=redis://host:6379/3,celery_redis_lua:Transport --peer stock=redis://host:6379/4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from scripts.servers import Cluster, Server, available_kinds

from . import backlog, broker_mechanics, celery_level, durability, kombu_level, report, shutdown
from .peers import BASELINE, ROOT, Peer, default_peers, parse_checkout, parse_peer
from .script_ab import CallgrindServer
from .server_cost import CALLGRIND_ENV, version_of


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__.splitlines()[0])
    kinds = list(available_kinds())
    p.add_argument("--server-kind", default="redis" if "redis" in kinds else "valkey",
                   help="throwaway server for the Redis-based peers (default: redis if on PATH)")
    p.add_argument("--peers", default="lua,lua-unconfirmed,lua-together,stock,plus,rabbit,rabbit-confirm",
                   help="default peers to run, if available ('': only the --checkout ones)")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL[,module:Class]",
                   help="measure these instead of the default peers (name one 'stock' for ratios)")
    p.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672//")
    p.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                   help="also run our transport from another checkout (e.g. the previous commit), "
                        "side by side in the same run; repeatable")
    p.add_argument("--one", metavar="SCENARIO", help=argparse.SUPPRESS)  # a --checkout peer's job
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--size", type=int, default=300, help="message body bytes")
    p.add_argument("--kombu-n", type=int, default=3000)
    p.add_argument("--memory-n", type=int, default=30000, help="messages queued for memory per message "
                   "(0: not measured)")
    p.add_argument("--backlog-sizes", default="1000,100000,1000000",
                   help="messages queued behind our transport's kombu phases and sweep, once per run on "
                        "a throwaway server (backlog.py; '' for none)")
    p.add_argument("--prefetch", type=int, default=100, help="kombu consume prefetch_count")
    p.add_argument("--celery-n", type=int, default=1500)
    p.add_argument("--variants", default="threads_early,threads_late,prefork_early,prefork_late,"
                                         "solo_early,gevent_early")
    p.add_argument("--drains", default="prefork_early,prefork_late",
                   help="Celery variants also measured draining a prefilled queue ('' for none)")
    p.add_argument("--drain-n", type=int, default=6000, help="tasks queued for each drain")
    p.add_argument("--threads", type=int, default=4, help="--pool=threads concurrency")
    p.add_argument("--processes", type=int, default=2, help="--pool=prefork concurrency")
    p.add_argument("--greenlets", type=int, default=10, help="--pool=gevent concurrency")
    p.add_argument("--rate", type=float, default=200, help="open-loop tasks/s (threads, early ack)")
    p.add_argument("--rate-seconds", type=float, default=6)
    p.add_argument("--mech-n", type=int, default=3000)
    p.add_argument("--mech-workers", default="4", help="comma-separated W levels")
    p.add_argument("--mech-prefetch", type=int, default=4)
    p.add_argument("--mech-timeout", type=float, default=300)
    p.add_argument("--durability", action="store_true",
                   help="also measure the durability option (kombu level, primary + replica; "
                        "off vs replicas:1 vs aof), written to docs/bench/durability-<date>.*")
    p.add_argument("--durability-only", action="store_true",
                   help="--durability and nothing else (no default peers)")
    p.add_argument("--durability-n", type=int, default=None, help="messages per durability job "
                   "(default: --kombu-n)")
    p.add_argument("--durability-slow-n", type=int, default=5,
                   help="messages for aof+replicas:1 (about a second per confirmed call with everysec)")
    p.add_argument("--durability-slow-timeout", type=float, default=5.0,
                   help="durability_timeout for aof+replicas:1 (the default 1 s falls short)")
    p.add_argument("--durability-kinds", default="valkey,redis", help="server kinds, if available")
    p.add_argument("--no-shutdown", dest="shutdown", action="store_false",
                   help="skip the idle warm-shutdown measurement (SIGTERM to exit, 4 workers per peer)")
    p.add_argument("--cluster", action="store_true",
                   help="also our transport on a three-primary cluster of --server-kind (peer lua-cluster)")
    p.add_argument("--instructions", action="store_true",
                   help="run the shared server under callgrind and count its instructions per message "
                        "and per task too (slow; the kombu and Celery rows: memory and backlog use "
                        "servers of their own)")
    p.add_argument("--quick", action="store_true", help="~1-2 min: repeat 1, small N, early ack only")
    p.add_argument("--no-docs", action="store_true",
                   help="do not update docs/bench/ (latest.*, durability-<date>.*)")
    o = p.parse_args()
    if o.quick:
        o.repeat, o.kombu_n, o.celery_n, o.mech_n, o.rate_seconds = 1, 1000, 600, 1000, 4
        o.memory_n = min(o.memory_n, 3000)
        o.backlog_sizes = "1000,20000" if o.backlog_sizes else ""
        o.variants = "threads_early,prefork_early,solo_early,gevent_early"
        o.drains, o.drain_n = "prefork_early", 1500
        o.durability_slow_n = min(o.durability_slow_n, 3)
    o.durability = o.durability or o.durability_only
    if o.durability_n is None:
        o.durability_n = o.kombu_n
    o.variants = [v.strip() for v in o.variants.split(",") if v.strip()]
    o.drains = [v.strip() for v in o.drains.split(",") if v.strip()]
    o.mech_workers = [int(w) for w in o.mech_workers.split(",") if w.strip()]
    o.backlog_sizes = [int(n) for n in o.backlog_sizes.split(",") if n.strip()]
    return o


def machine(peers: list[Peer]) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    return {"nproc": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "loadavg_start": os.getloadavg(),
            "servers": {p.name: version_of(p) for p in peers},
            "packages": {name: _version(name) for name in
                         ("kombu", "celery", "redis", "amqp", "celery-redis-lua", "celery-redis-plus")}}


def _version(name: str) -> str | None:
    try:
        return version(name)
    except Exception:
        return None


def jobs(o: argparse.Namespace, peers: list[Peer], durability_peers: Sequence[Peer] = ()
         ) -> list[tuple[int, str, Peer]]:
    """Every repetition runs every scenario for every peer, the peers' order rotated from one
    repetition to the next (the first peer of a round ran 8-20 % faster on the Celery threads
    rows, docs/bench/keeper-ab-20261204.md); the durability peers (kombu level) end each
    repetition, rotated the same way."""
    scenarios = ["kombu", *(f"celery_{v}" for v in o.variants), *(f"drain_{v}" for v in o.drains),
                 *(f"mech_{w}" for w in o.mech_workers),
                 *(["shutdown"] if o.shutdown else [])]
    todo = []
    for rep in range(1, o.repeat + 1):
        turn = (rep - 1) % max(1, len(peers))
        in_turn = [*peers[turn:], *peers[:turn]]
        todo += [(rep, s, p) for s in scenarios for p in in_turn
                 if s == "kombu" or s.startswith("celery_") or not p.publish_variant]
        if rep == 1 and o.memory_n:  # a byte count, the same every repetition: measured once
            todo += [(rep, "memory", p) for p in peers if p.is_standalone_redis and not p.publish_variant]
        if rep == 1 and o.backlog_sizes:  # a million messages to fill: once, its own repetitions inside
            todo += [(rep, "backlog", p) for p in peers if p.is_ours_standalone and not p.publish_variant]
        shift = (rep - 1) % max(1, len(durability_peers))
        rotated = [*durability_peers[shift:], *durability_peers[:shift]]
        todo += [(rep, "durability", p) for p in rotated]
    return todo


def shared_server(o: argparse.Namespace, stack: ExitStack) -> Server:
    """The server the peers share, started; with --instructions, under callgrind, counting
    everything it runs, and named to every job's probe (server_cost.CALLGRIND_ENV)."""
    if not o.instructions:
        return stack.enter_context(Server(o.server_kind))
    CallgrindServer.require()
    server = stack.enter_context(CallgrindServer(o.server_kind, whole=True))
    assert server.process is not None
    os.environ[CALLGRIND_ENV] = f"{server.process.pid}:{server.port}:{server.directory}"
    return server


def instructions_text(cost: dict[str, Any], unit: str) -> str:
    per = cost.get("instructions_per_msg")
    return f"  {per / 1000:,.0f}k instructions/{unit}" if per is not None else ""


def run_job(o: argparse.Namespace, scenario: str, peer: Peer) -> tuple[dict[str, Any], str]:
    if peer.checkout:
        return run_in_checkout(scenario, peer)
    if scenario == "durability":
        return durability.run(peer, o.prefetch, o.size)
    if scenario == "shutdown":
        r = shutdown.run(peer, o.processes)
        return r, shutdown.text(r)
    if scenario == "memory":
        return memory(o, peer)
    if scenario == "backlog":
        return cost_in_backlog(o, peer)
    if scenario == "kombu":
        r = kombu_level.run(peer, o.kombu_n, o.prefetch, o.size)
        return r, (f"publish {r['publish']['msgs_per_s']:7,.0f} msg/s  "
                   f"consume+ack {r['consume']['msgs_per_s']:7,.0f} msg/s"
                   f"{instructions_text(r['publish'].get('server', {}), 'publish')}"
                   f"{instructions_text(r['consume'].get('server', {}), 'consume+ack')}")
    if scenario.startswith("drain_"):  # the consuming side only: not for publish variants (jobs)
        pool, ack = scenario.removeprefix("drain_").split("_")
        concurrency = {"threads": o.threads, "prefork": o.processes, "solo": 1, "gevent": o.greenlets}[pool]
        r = celery_level.drain(peer, pool, ack == "late", o.drain_n, concurrency)
        share = r["main_over_children"] or 0.0
        return r, (f"{r['tasks_per_s']:7,.0f} tasks/s drained  main process "
                   f"{r['main_cpu_us_per_task']:,.0f} µs/task ({share:.2f}x its children)")
    if scenario.startswith("celery_"):
        pool, ack = scenario.removeprefix("celery_").split("_")
        rate = o.rate if (pool, ack) == ("threads", "early") else None
        # solo runs one task at a time inside the event loop; a stall between prefetch
        # batches (waiting out the blocking poll) shows here first.
        concurrency = {"threads": o.threads, "prefork": o.processes, "solo": 1,
                       "gevent": o.greenlets}[pool]
        r = celery_level.run(peer, pool, ack == "late", o.celery_n, concurrency,
                             open_loop_rate=rate, open_loop_seconds=o.rate_seconds)
        text = f"{r['throughput']['tasks_per_s']:7,.0f} tasks/s" + instructions_text(
            r["throughput"]["server"], "task")
        if "open_loop" in r:
            lat = r["open_loop"]["latency_us"]
            text += f"  @{o.rate:.0f}/s p50 {lat['p50'] / 1000:.1f} p99 {lat['p99'] / 1000:.1f} ms"
        return r, text
    workers = int(scenario.removeprefix("mech_"))
    r = broker_mechanics.run(peer, o.mech_n, workers, o.mech_prefetch, o.size, o.mech_timeout)
    return r, f"{r['jobs_per_sec']:7,.0f} jobs/s  p99 {r['latency_us']['p99'] / 1000:.0f} ms in queue"


def memory(o: argparse.Namespace, peer: Peer) -> tuple[dict[str, Any], str]:
    """Memory per queued message through ``peer``'s transport, on a throwaway server of the
    run's kind (used_memory is server-wide, so not on the shared one): kombu messages, and
    Celery-like ones that carry a task id."""
    with Server(o.server_kind) as server:
        url = urlsplit(peer.url)._replace(netloc=f"127.0.0.1:{server.port}").geturl()
        there = dataclasses.replace(peer, url=url)
        r = {f"{kind}_bytes_per_message": backlog.memory_of(server.client(), there.connection(), o.memory_n,
                                                            o.size, task_ids=kind == "celery")
             for kind in ("kombu", "celery")}
    return r, (f"{r['kombu_bytes_per_message']:,.0f} B/msg "
               f"(with task ids {r['celery_bytes_per_message']:,.0f})")


def cost_in_backlog(o: argparse.Namespace, peer: Peer) -> tuple[dict[str, Any], str]:
    """Our transport's rates and slowest calls with a growing backlog (backlog.py), on a
    throwaway server of the run's kind: a million queued messages would weigh on every other
    peer of the shared one."""
    with Server(o.server_kind) as server:
        url = urlsplit(peer.url)._replace(netloc=f"127.0.0.1:{server.port}").geturl()
        r = backlog.cost_in_backlog(server, dataclasses.replace(peer, url=url), o.backlog_sizes, n=o.kombu_n,
                                    prefetch=o.prefetch, size=o.size, repeat=o.repeat)
    return r, (f"slowest size / fastest: publish {r['publish_flat']:.2f}, "
               f"consume+ack {r['consume_flat']:.2f}; "
               f"slowest sweep call {r['sweep_slowest_call_ms'] or 0:.1f} ms")


def without_checkouts(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--checkout":
            skip = True
        elif not arg.startswith("--checkout="):
            kept.append(arg)
    return kept


def run_in_checkout(scenario: str, peer: Peer) -> tuple[dict[str, Any], str]:
    """Run one job in a subprocess with the checkout's package first on the path (its
    workers inherit it), so two versions of the transport are measured in one run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(peer.checkout or "") / "python"),
                                                       str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "scripts.bench", "--one", scenario, "--peer", f"{peer.name}={peer.url}",
               *without_checkouts(sys.argv[1:])]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{peer.name} in {peer.checkout}: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["result"], result["text"]


def durability_report(o: argparse.Namespace, command: str, stamp: str, info: dict[str, Any],
                      peers: list[Peer], meta: dict[str, dict[str, Any]], skipped: dict[str, str],
                      runs: list[dict[str, Any]], out_dir: Path) -> None:
    """The durability table: printed, in bench-results/ and (full runs) docs/bench/durability-<date>.*"""
    summary = durability.summarize(runs, meta)
    versions = {p.name: info["servers"].get(p.name, "") for p in peers}
    table = durability.markdown(summary, versions)
    slow = o.durability_slow_n
    text = (f"`{command}`\n\nOur transport, kombu level ({durability.__name__}), primary + 1 replica "
            f"on loopback; medians of {o.repeat} interleaved repetitions; n = {o.durability_n:,} messages "
            f"per phase ({slow} for aof+replicas:1, durability_timeout {o.durability_slow_timeout:g} s), "
            f"{o.size}-byte bodies, consume prefetch {o.prefetch}; {info['nproc']} CPUs, load "
            f"{info['loadavg_start'][0]:.2f} -> {info['loadavg_end'][0]:.2f}. Ratios are to `off` on the "
            f"same server kind; added µs/msg = 1e6/rate - 1e6/rate(off). `--durability` adds these jobs to "
            f"the full run; `--durability-only` runs them alone.\n\n{table}\n")
    document = {"tool": "scripts/bench --durability", "command": command, "timestamp": stamp,
                "machine": info, "options": vars(o), "peers": [p.describe() for p in peers],
                "skipped": skipped, "summary": summary, "table_markdown": table, "runs": runs}
    path = out_dir / f"durability-{stamp}.json"
    path.write_text(json.dumps(document, indent=1, default=str))
    (out_dir / f"durability-{stamp}.md").write_text(text)
    print("\n" + text + f"\n-> {path.relative_to(ROOT)}")
    if not (o.quick or o.no_docs):
        docs = ROOT / "docs" / "bench"
        docs.mkdir(parents=True, exist_ok=True)
        day = stamp[:8]
        shutil.copyfile(path, docs / f"durability-{day}.json")
        (docs / f"durability-{day}.md").write_text(text)
        print(f"-> docs/bench/durability-{day}.json, durability-{day}.md")


def main() -> int:
    o = options()
    if o.one:  # one job of a --checkout peer, in its own process; the result on stdout
        result, text = run_job(o, o.one, parse_peer(o.peer[0]))
        print(json.dumps({"result": result, "text": text}, default=str))
        return 0
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = ROOT / "bench-results"
    out_dir.mkdir(exist_ok=True)
    with ExitStack() as stack:
        skipped: dict[str, str] = {}
        peers: list[Peer] = []
        if o.durability_only:
            pass
        elif o.peer:
            peers = [parse_peer(text) for text in o.peer]
        else:
            server = shared_server(o, stack)
            wanted = [p.strip() for p in o.peers.split(",") if p.strip()]  # none: the checkouts only
            peers, skipped = default_peers(server.port, o.amqp_url, wanted)
            peers += [parse_checkout(text, server.port, 8 + i) for i, text in enumerate(o.checkout)]
            if o.cluster:
                cluster = stack.enter_context(Cluster(o.server_kind))
                peers.append(Peer("lua-cluster", f"redislua+cluster://127.0.0.1:{cluster.nodes[0].port}/0"))
        dpeers: list[Peer] = []
        dmeta: dict[str, dict[str, Any]] = {}
        if o.durability:
            dpeers, dmeta, dskipped = durability.start(
                stack, [k.strip() for k in o.durability_kinds.split(",") if k.strip()],
                o.durability_n, o.durability_slow_n, o.durability_slow_timeout)
            skipped.update(dskipped)
        for name, why in skipped.items():
            print(f"skipping {name}: {why}", flush=True)
        info = machine([*peers, *dpeers])
        todo = jobs(o, peers, dpeers)
        print(f"{len(todo)} runs: {', '.join(f'{p.name}={p.url}' for p in [*peers, *dpeers])}; "
              f"{info['nproc']} CPUs ({info['cpu_model']}), load {info['loadavg_start'][0]:.2f}", flush=True)
        runs: list[dict[str, Any]] = []
        began = time.monotonic()
        for i, (rep, scenario, peer) in enumerate(todo, 1):
            t0 = time.monotonic()
            entry: dict[str, Any] = {"rep": rep, "scenario": scenario, "peer": peer.name}
            try:
                entry["result"], text = run_job(o, scenario, peer)
            except Exception as error:
                entry["error"] = f"{type(error).__name__}: {error}"
                entry["traceback"] = traceback.format_exc()
                text = f"FAILED {entry['error'].splitlines()[0][:200]}"
            runs.append(entry)
            elapsed = time.monotonic() - began
            eta = elapsed / i * (len(todo) - i)
            print(f"[{i:>3}/{len(todo)} rep {rep}] {scenario:<20} {peer.name:<7} {text}  "
                  f"({time.monotonic() - t0:4.1f} s, ~{eta / 60:.1f} min left)", flush=True)
    info["loadavg_end"] = os.getloadavg()
    info["seconds"] = round(time.monotonic() - began, 1)
    command = "python -m scripts.bench " + " ".join(sys.argv[1:])
    failed = [r for r in runs if "error" in r]
    if dpeers:
        durability_report(o, command, stamp, info, dpeers, dmeta, skipped,
                          [r for r in runs if r["scenario"] == "durability"], out_dir)
    if not peers:
        if failed:
            print(f"\n{len(failed)} runs failed; see 'runs[].traceback' in the JSON")
        return 1 if failed else 0
    runs = [r for r in runs if r["scenario"] != "durability"]

    rows = report.metrics(o.variants, o.mech_workers, o.drains, bool(o.backlog_sizes), o.instructions)
    names = [p.name for p in peers]
    summary = report.summarize(runs, names, rows)
    verdicts = report.targets(summary)
    table = report.markdown(summary, rows)
    mech_docs = {}
    for peer in peers:
        results = [dict(r["result"], rep=r["rep"]) for r in runs
                   if r["peer"] == peer.name and r["scenario"].startswith("mech_") and "error" not in r]
        tag = f"{peer.name}-{info['servers'].get(peer.name, '').replace(' ', '-')}"
        mech_docs[peer.name] = broker_mechanics.document(peer, tag, stamp, o.mech_n, o.mech_workers, 0,
                                                         results)
        (out_dir / f"celery_bench_{peer.name}-{stamp}.json").write_text(
            json.dumps(mech_docs[peer.name], indent=1))
    document = {"tool": "scripts/bench", "command": command, "timestamp": stamp, "machine": info,
                "options": {k: v for k, v in vars(o).items()}, "peers": [p.describe() for p in peers],
                "skipped": skipped, "baseline": BASELINE, "summary": summary,
                "ratios": report.ratios(summary), "targets": verdicts, "table_markdown": table,
                "runs": runs}
    path = out_dir / f"bench-{stamp}.json"
    path.write_text(json.dumps(document, indent=1, default=str))
    png = out_dir / f"bench-{stamp}.png"
    title = (f"{info['nproc']} CPUs, {', '.join(sorted(set(filter(None, info['servers'].values()))))}; "
             f"medians of {o.repeat}")
    report.chart(summary, rows, png, title)
    if o.instructions:
        print("\n" + table + "\n\nUnder callgrind: compare the instruction rows; its times and CPU "
              "are callgrind's.")
    else:
        print("\n" + table + "\n\nTargets (measured, never asserted):\n" + report.targets_markdown(verdicts))
    if failed:
        print(f"\n{len(failed)} runs failed; see 'runs[].traceback' in {path.relative_to(ROOT)}")
    print(f"\n-> {path.relative_to(ROOT)}, {png.relative_to(ROOT)}  ({info['seconds']:.0f} s; "
          f"load {info['loadavg_start'][0]:.2f} -> {info['loadavg_end'][0]:.2f})")
    if not (o.quick or o.no_docs or o.peer or o.instructions):
        docs = ROOT / "docs" / "bench"
        docs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, docs / "latest.json")
        shutil.copyfile(png, docs / "latest.png")
        (docs / "latest.md").write_text(f"`{command}`\n\n{table}\n\n{report.targets_markdown(verdicts)}\n")
        print("-> docs/bench/latest.json, latest.png, latest.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
