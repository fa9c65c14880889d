"""Fair queues at script level: how long quiet tenants wait while one tenant floods a queue.

One flooding tenant publishes ``--flood`` tasks at ``--flood-rate`` per consume step (a bulk
job: faster than the workers drain), nine quiet tenants ``--per-quiet`` each, spread evenly
over the flood's drain time, round-robin; a worker consumes ``--batch`` at a time and acks
what it took in the next step's pipeline. A step is one pipeline on the server: this step's
publishes, the last batch's ack, one consume. A quiet message published in step s and
delivered in step d waited d - s + 1 steps (1: taken by the first consume after it).

Three runs on one throwaway server: the quiet tenants alone (no flood), the flood without
fairness keys (today: the quiet wait behind the flood), the flood with each tenant's key.

    python -m scripts.bench.fairness                      # 100,000 + 9 x 100 on Valkey
    python -m scripts.bench.fairness --kind redis --flood 5000 --per-quiet 20
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Server

PAYLOAD = '{"body":"W1sxLDJdLHt9LHt9XQ==","headers":{"id":"x","task":"tasks.add"}}' + "x" * 300
QUEUE = "fair"


def percentile(values: list[int], p: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))])


def run(client: Any, *, flood: int, quiet: int = 9, per_quiet: int = 100, batch: int = 10,
        flood_rate: int = 100, keyed: bool = True, spread: int | None = None) -> dict[str, Any]:
    """One run on a flushed server: the quiet messages' waits in consume steps (p50, p99,
    max) and the steps the whole run took. The quiet messages are spread over ``spread``
    steps (default: the time the flood and they take to drain); ``flood`` 0: the quiet
    tenants alone, one consume per step as a polling worker."""
    client.flushall()
    lib = ScriptLibrary(client, Keyspace(), visibility_ms=600_000)
    lib.declare(QUEUE)
    drain_steps = spread or max(1, (flood + quiet * per_quiet) // batch)
    total_quiet = quiet * per_quiet
    # Quiet message i is published in step quiet_step(i): evenly over the flood's drain time.
    quiet_steps = [i * drain_steps // total_quiet for i in range(total_quiet)]
    published_at: dict[str, int] = {}
    waits: list[int] = []
    flood_left, next_quiet, to_ack, step = flood, 0, [], 0
    while flood_left or next_quiet < total_quiet or published_at:
        calls: list[Any] = []
        quiet_now: list[int] = []
        for _ in range(min(flood_rate, flood_left)):
            calls.append(lib.calls.publish(QUEUE, PAYLOAD, fairness_key="flood" if keyed else None))
        flood_left -= min(flood_rate, flood_left)
        while next_quiet < total_quiet and quiet_steps[next_quiet] <= step:
            tenant = f"quiet-{next_quiet % quiet}"
            calls.append(lib.calls.publish(QUEUE, PAYLOAD.replace('"x"', f'"{tenant}"'),
                                           fairness_key=tenant if keyed else None))
            quiet_now.append(len(calls) - 1)
            next_quiet += 1
        if to_ack:
            calls.append(lib.calls.ack(QUEUE, to_ack))
        calls.append(lib.calls.consume([QUEUE], batch))
        replies = lib.run_many(calls)
        for index in quiet_now:
            published_at[str(replies[index])] = step
        consumed = replies[-1]
        to_ack = [d.id for d in consumed.deliveries]
        for delivery in consumed.deliveries:
            at = published_at.pop(delivery.id, None)
            if at is not None:
                waits.append(step - at + 1)
        step += 1
        if step > 10 * drain_steps + 1000:
            raise RuntimeError(f"not drained after {step} steps")
    return {"p50": statistics.median(waits), "p99": percentile(waits, 99), "max": max(waits),
            "steps": step, "quiet": len(waits)}


def compare(client: Any, *, flood: int, per_quiet: int, batch: int = 10,
            flood_rate: int = 100) -> dict[str, dict[str, Any]]:
    """The three runs: no flood, the flood without keys, the flood with keys. The no-flood run
    keeps the flood run's schedule for the quiet tenants (the same steps apart)."""
    drain = (flood + 9 * per_quiet) // batch
    return {name: run(client, flood=size, per_quiet=per_quiet, batch=batch, flood_rate=flood_rate,
                      keyed=keyed, spread=drain)
            for name, size, keyed in (("no flood", 0, True), ("flood, no keys", flood, False),
                                      ("flood, keys", flood, True))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--kind", choices=["valkey", "redis"], default="valkey")
    parser.add_argument("--flood", type=int, default=100_000)
    parser.add_argument("--per-quiet", type=int, default=100)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--flood-rate", type=int, default=100, help="flood publishes per consume step")
    args = parser.parse_args(argv)
    with Server(args.kind) as server:
        client = server.client(socket_timeout=60)
        results = compare(client, flood=args.flood, per_quiet=args.per_quiet, batch=args.batch,
                          flood_rate=args.flood_rate)
        client.close()
    print(f"fair queues on {args.kind}: flood {args.flood}, 9 quiet tenants x {args.per_quiet}, "
          f"batch {args.batch}, flood {args.flood_rate}/step; quiet waits in consume steps:")
    for name, r in results.items():
        print(f"  {name:15} p50 {r['p50']:g}  p99 {r['p99']:g}  max {r['max']}  ({r['quiet']} quiet, "
              f"{r['steps']} steps)")
    base = results["no flood"]["p99"]
    print(f"  p99 ratio to no flood: without keys {results['flood, no keys']['p99'] / base:.1f}x, "
          f"with keys {results['flood, keys']['p99'] / base:.1f}x")


if __name__ == "__main__":
    main()
