#!/usr/bin/env python3
"""Script-level benchmark: our Lua scripts against the stock kombu Redis protocol.

For each server kind (a throwaway valkey-server, and redis-server when it is on
PATH), on the same server, with the same N messages and W consumer processes:

  lua-1   prefill with the publish script (pipelined), then W consumers loop
          consume(count=1) + ack until the queue is empty (like-for-like with BRPOP);
  lua-B   the same with consume(count=B) and one ack call per batch;
  stock   what kombu's Redis transport does per message: prefill with LPUSH
          (pipelined), then W consumers loop BRPOP -> pipeline(ZADD unacked_index,
          HSET unacked) -> ack pipeline(ZREM unacked_index, HDEL unacked).

Variants are interleaved (A B C A B C ...) with FLUSHALL SYNC and CONFIG RESETSTAT
between runs. Per run it records the consumer-side latency of every message (from
the start of the consume/BRPOP call to the ack reply; in a batch every message
gets its batch's latency), consume-phase messages/s, publish-phase messages/s, and
the server's cost: INFO cpu (used_cpu_sys + used_cpu_user) delta per message and
the INFO commandstats delta (calls and usec per command; Redis 7 and Valkey count
the commands a script runs too, and EVALSHA's usec includes them).

The table shows medians over the repetitions and ratios to the stock protocol;
the raw runs go to bench-results/lua_level-<kind>-<timestamp>.json.

    python scripts/bench/lua_level.py                 # defaults, ~2-3 minutes on 2 cores
    python scripts/bench/lua_level.py --quick         # ~20 s smoke run
    python scripts/bench/lua_level.py --kinds valkey --messages 50000 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from array import array
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]

from celery_redis_lua.protocol import ops  # noqa: E402
from celery_redis_lua.protocol.keys import Keyspace  # noqa: E402
from celery_redis_lua.protocol.policy import Policy  # noqa: E402
from celery_redis_lua.protocol.runner import ScriptRunner  # noqa: E402
from scripts.bench.server_cost import server_cost, snapshot  # noqa: E402
from scripts.servers import Server, available_kinds, server_version  # noqa: E402

QUEUE = "bench"
KEYS = Keyspace()
VISIBILITY_MS = 1_800_000  # long enough that nothing is restored during a run
POLICY = Policy(visibility_ms=VISIBILITY_MS)
CHUNK = 1000  # publishes per pipeline in the prefill
BRPOP_TIMEOUT = 0.1  # seconds; the queue is prefilled, so nil means empty
UNACKED, UNACKED_INDEX = "unacked", "unacked_index"  # kombu's default key names


def kombu_like_payload(size: int = 300) -> bytes:
    """A JSON kombu envelope of about ``size`` bytes (a small Celery task message)."""
    envelope: dict[str, Any] = {
        "body": "", "content-encoding": "utf-8", "content-type": "application/json",
        "headers": {"lang": "py", "task": "proj.tasks.add", "id": str(uuid.UUID(int=1)),
                    "retries": 0, "eta": None},
        "properties": {"delivery_tag": str(uuid.UUID(int=2)), "priority": 0,
                       "delivery_info": {"exchange": "", "routing_key": QUEUE}},
    }
    bare = len(json.dumps(envelope, separators=(",", ":")))
    envelope["body"] = "W" * max(0, size - bare)
    return json.dumps(envelope, separators=(",", ":")).encode()


PAYLOAD = kombu_like_payload()


# ---------------------------------------------------------------- consumers (child processes)

def _consumer(variant: str, port: int, batch: int, transaction: bool,
              barrier: Any, start: Any, results: Any) -> None:
    client = redis.Redis(host="127.0.0.1", port=port)
    client.ping()
    latencies = array("d")
    last = 0.0
    clock = time.perf_counter  # CLOCK_MONOTONIC: comparable across processes
    barrier.wait()
    start.wait()
    if variant == "stock":
        while True:
            began = clock()
            item = client.brpop([QUEUE], timeout=BRPOP_TIMEOUT)
            if item is None:
                break
            tag = str(uuid.uuid4())
            client.pipeline(transaction=transaction).zadd(UNACKED_INDEX, {tag: time.time()}) \
                .hset(UNACKED, tag, item[1]).execute()
            # ... the task would run here ...
            client.pipeline(transaction=transaction).zrem(UNACKED_INDEX, tag) \
                .hdel(UNACKED, tag).execute()
            last = clock()
            latencies.append(last - began)
    else:
        runner = ScriptRunner(client)
        consume = ops.consume(KEYS, POLICY, [QUEUE], batch)
        while True:
            began = clock()
            deliveries = runner.run(consume).deliveries
            if not deliveries:
                break
            runner.run(ops.ack(KEYS, POLICY, QUEUE, [d.id for d in deliveries]))
            last = clock()
            latencies.extend([last - began] * len(deliveries))
    results.put((latencies.tobytes(), last))
    client.close()


# ---------------------------------------------------------------- server-side measurement

# ---------------------------------------------------------------- one run

def prefill(client: redis.Redis, variant: str, n: int) -> None:
    if variant == "stock":
        for first in range(0, n, CHUNK):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(CHUNK, n - first)):
                pipe.lpush(QUEUE, PAYLOAD)
            pipe.execute()
    else:
        runner = ScriptRunner(client)
        call = ops.publish(KEYS, POLICY, QUEUE, PAYLOAD)
        for first in range(0, n, CHUNK):
            runner.run_many([call] * min(CHUNK, n - first))


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_once(client: redis.Redis, port: int, variant: str, n: int, consumers: int, batch: int,
             transaction: bool) -> dict[str, Any]:
    client.execute_command("FLUSHALL", "SYNC")
    client.config_resetstat()
    ScriptRunner(client).load(["publish", "consume", "ack"])

    before = snapshot(client)
    began = time.perf_counter()
    prefill(client, variant, n)
    publish_seconds = time.perf_counter() - began
    after_publish = snapshot(client)
    queued = client.zcard(KEYS.queue(QUEUE)) if variant != "stock" else client.llen(QUEUE)
    if queued != n:
        raise RuntimeError(f"{variant}: prefill left {queued} messages, expected {n}")

    ctx = mp.get_context("fork")
    barrier, start, results = ctx.Barrier(consumers + 1), ctx.Event(), ctx.Queue()
    count = 1 if variant == "lua-1" else batch
    workers = [ctx.Process(target=_consumer, args=(variant, port, count, transaction,
                                                   barrier, start, results), daemon=True)
               for _ in range(consumers)]
    for worker in workers:
        worker.start()
    barrier.wait(timeout=30)
    consume_before = snapshot(client)
    began = time.perf_counter()
    start.set()
    latencies: list[float] = []
    last = began
    for _ in workers:
        raw, worker_last = results.get(timeout=600)
        latencies.extend(array("d", raw))
        last = max(last, worker_last)
    for worker in workers:
        worker.join(timeout=30)
        if worker.exitcode != 0:
            raise RuntimeError(f"{variant}: a consumer exited with {worker.exitcode}")
    consume_seconds = last - began
    consume_after = snapshot(client)

    if len(latencies) != n:
        raise RuntimeError(f"{variant}: consumers acked {len(latencies)} messages, expected {n}")
    leftover = client.dbsize() - (1 if variant != "stock" else 0)  # ours keeps meta:{Q} (seq)
    ordered = sorted(latencies)
    consume = server_cost(consume_before, consume_after, n)
    publish = server_cost(before, after_publish, n)
    return {
        "variant": variant, "n": n, "consumers": consumers, "batch": count,
        "leftover_keys": leftover,
        "publish": {"seconds": publish_seconds, "msgs_per_s": n / publish_seconds, **publish},
        "consume": {
            "seconds": consume_seconds, "msgs_per_s": n / consume_seconds,
            "latency_us": {name: percentile(ordered, q) * 1e6 for name, q in
                           (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))},
            **consume,
        },
        "total_cpu_us_per_msg": publish["cpu_us_per_msg"] + consume["cpu_us_per_msg"],
    }


# ---------------------------------------------------------------- summaries and table

def median_tree(values: list[Any]) -> Any:
    """The median of each numeric leaf of equally shaped dicts (missing leaves count as 0)."""
    first = values[0]
    if isinstance(first, dict):
        keys = {k for value in values for k in value}
        return {k: median_tree([value.get(k, 0) for value in values]) for k in sorted(keys)}
    if isinstance(first, bool | str):
        return first
    if isinstance(first, int | float):
        return statistics.median(values)
    return first


def _num(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], float]]] = [
    ("pub msg/s", lambda s: s["publish"]["msgs_per_s"]),
    ("msg/s", lambda s: s["consume"]["msgs_per_s"]),
    ("p50 µs", lambda s: s["consume"]["latency_us"]["p50"]),
    ("p90 µs", lambda s: s["consume"]["latency_us"]["p90"]),
    ("p99 µs", lambda s: s["consume"]["latency_us"]["p99"]),
    ("max µs", lambda s: s["consume"]["latency_us"]["max"]),
    ("cpu µs/msg", lambda s: s["consume"]["cpu_us_per_msg"]),
    ("+pub cpu", lambda s: s["total_cpu_us_per_msg"]),
    ("cmd µs/msg", lambda s: s["consume"]["cmd_us_per_msg"]),
    ("req/msg", lambda s: s["consume"]["requests_per_msg"]),
    ("calls/msg", lambda s: s["consume"]["calls_per_msg"]),
]


def render_table(title: str, summary: dict[str, dict[str, Any]]) -> str:
    header = ["variant", *(name for name, _ in COLUMNS)]
    rows = [header]
    stock = summary.get("stock")
    for variant, s in summary.items():
        rows.append([variant, *(_num(get(s)) for _, get in COLUMNS)])
        if stock is not None and variant != "stock":
            rows.append(["  /stock", *(f"{get(s) / get(stock):.2f}x" if get(stock) else "-"
                                       for _, get in COLUMNS)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [title]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[0]) if j == 0 else cell.rjust(widths[j])
                               for j, cell in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_breakdown(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["server commands per message (calls/msg / usec/msg; usec is wall time while the command "
             "runs, and EVALSHA's includes its inner commands):"]
    for variant, s in summary.items():
        for phase in ("publish", "consume"):
            commands = s[phase]["commands"]
            ranked = sorted(commands.items(), key=lambda kv: -kv[1]["usec"])
            n = s["n"]
            parts = [f"{name} {v['calls'] / n:.2f}/{v['usec'] / n:.2f}" for name, v in ranked]
            inner = s[phase]["inner_cmd_us_per_msg"]
            outside = (f"  [script usec outside redis.call: {s[phase]['cmd_us_per_msg'] - inner:.2f}]"
                       if inner else "")
            lines.append(f"  {variant:<8} {phase:<8} " + ", ".join(parts) + outside)
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def bench_kind(kind: str, options: argparse.Namespace, variants: list[str]) -> dict[str, Any]:
    with Server(kind) as server:
        client = server.client()
        version = server_version(client)
        print(f"== {version} on 127.0.0.1:{server.port}: N={options.messages}, "
              f"W={options.consumers}, batch={options.batch}, repeat={options.repeat}", flush=True)
        warmup = min(1000, options.messages)
        for variant in variants:
            run_once(client, server.port, variant, warmup, options.consumers, options.batch,
                     options.stock_transaction)
        runs: list[dict[str, Any]] = []
        for rep in range(1, options.repeat + 1):
            for variant in variants:
                result = run_once(client, server.port, variant, options.messages,
                                  options.consumers, options.batch, options.stock_transaction)
                result["rep"] = rep
                runs.append(result)
                c = result["consume"]
                print(f"  [{kind} {rep}/{options.repeat}] {variant:<7} "
                      f"publish {result['publish']['msgs_per_s']:>8,.0f} msg/s  "
                      f"consume {c['msgs_per_s']:>7,.0f} msg/s  p50 {c['latency_us']['p50']:>6,.0f} µs  "
                      f"server cpu {c['cpu_us_per_msg']:5.1f} µs/msg "
                      f"(+publish {result['total_cpu_us_per_msg']:5.1f})  "
                      f"calls/msg {c['calls_per_msg']:.2f}", flush=True)
        client.close()
    summary = {variant: median_tree([r for r in runs if r["variant"] == variant])
               for variant in variants}
    return {"kind": kind, "version": version, "runs": runs, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(available_kinds()),
                        help="comma-separated server kinds (default: valkey, and redis if on PATH)")
    parser.add_argument("--messages", "-n", type=int, default=20_000, help="N messages per run")
    parser.add_argument("--consumers", "-w", type=int, default=4, help="W consumer processes")
    parser.add_argument("--batch", type=int, default=10, help="consume count of the batch variant")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--stock-transaction", action="store_true",
                        help="wrap the stock pipelines in MULTI/EXEC, as kombu 5.x's "
                             "client.pipeline() does (default: plain pipelines, the cheaper baseline)")
    parser.add_argument("--quick", action="store_true", help="smoke run: N=2000, repeat 1")
    options = parser.parse_args()
    if options.quick:
        options.messages, options.repeat = 2000, 1
    if options.messages < 1 or options.consumers < 1 or options.repeat < 1 or options.batch < 1:
        parser.error("--messages, --consumers, --repeat and --batch must be positive")
    kinds = [k.strip() for k in options.kinds.split(",") if k.strip()]
    variants = ["stock", "lua-1"] + ([f"lua-{options.batch}"] if options.batch > 1 else [])

    out_dir = ROOT / "bench-results"
    out_dir.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    began = time.monotonic()
    tables = []
    for kind in kinds:
        result = bench_kind(kind, options, variants)
        result.update({
            "tool": "scripts/bench/lua_level.py", "argv": sys.argv[1:], "timestamp": stamp,
            "config": {"messages": options.messages, "consumers": options.consumers,
                       "batch": options.batch, "repeat": options.repeat,
                       "payload_bytes": len(PAYLOAD), "stock_transaction": options.stock_transaction,
                       "publish_chunk": CHUNK, "visibility_ms": VISIBILITY_MS},
            "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        })
        path = out_dir / f"lua_level-{kind}-{stamp}.json"
        path.write_text(json.dumps(result, indent=1))
        title = (f"\n{result['version']}: N={options.messages}, W={options.consumers}, "
                 f"payload {len(PAYLOAD)} B, medians of {options.repeat} "
                 f"(stock pipelines {'MULTI/EXEC' if options.stock_transaction else 'plain'})")
        tables.append(render_table(title, result["summary"]) + "\n" + render_breakdown(result["summary"])
                      + f"\n-> {path.relative_to(ROOT)}")
        print(tables[-1], flush=True)
    print(f"\ncolumns: msg/s and latency are the consume phase (consume/BRPOP call start -> ack reply,"
          f" per message); cpu = server used_cpu_sys+user delta per message (consume phase; "
          f"'+pub cpu' adds the publish phase); cmd µs = commandstats usec of the requests; "
          f"req = commands clients sent; calls = every command the server ran. "
          f"{time.monotonic() - began:.0f} s in all.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
