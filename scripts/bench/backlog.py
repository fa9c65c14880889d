"""Cost in the backlog (issue 15): kombu publish and consume+ack rates of our transport with
1,000, 100,000 and 1,000,000 messages already queued, the slowest script call the server
logged meanwhile (SLOWLOG, every call logged), a sweep over the whole backlog, and the memory
per queued message against kombu's stock Redis transport.

``python -m scripts.bench.backlog [--sizes 1000,100000,1000000] [--kind redis]`` on a
throwaway server of its own; the backlog is filled with pipelined publish calls (1,000 per
round trip), then each phase runs kombu_level on that queue (publish behind the backlog,
consume+ack from its front); the smallest size comes again at the end. Prints a markdown
table; writes bench-results/backlog-*.json. ``make bench-all`` runs the same measurement
(``cost_in_backlog``) as its ``backlog`` job and reports its targets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from kombu import Connection

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.contract import load_scripts
from scripts.servers import Server

from . import kombu_level
from .peers import ROOT, Peer, bind_queue, body_of_size

BACKLOG = "backlog"
FILL_BATCH = 1000
SLOWLOG_LEN = 50_000  # every call of a phase stays in the log (each phase makes a few thousand)


def fill(lib: ScriptLibrary, queue: str, count: int, payload: str) -> None:
    for first in range(0, count, FILL_BATCH):
        lib.run_many([lib.calls.publish(queue, payload) for _ in range(min(FILL_BATCH, count - first))])


SCRIPT_NAMES = {script.sha1: name for name, script in load_scripts().items()}
IN_FLIGHT = 100_000  # at most this many of the backlog are made overdue for the sweep


def slowest_call(client: Any) -> dict[str, Any] | None:
    """The slowest script call the server logged since the last reset, in µs, and which."""
    calls = []
    for entry in client.slowlog_get(SLOWLOG_LEN):
        command = entry["command"]
        words = (command.decode() if isinstance(command, bytes) else str(command)).split()
        if words and words[0].upper() == "EVALSHA" and len(words) > 1:
            calls.append((entry["duration"], SCRIPT_NAMES.get(words[1], words[1][:12])))
    if not calls:
        return None
    duration, name = max(calls)
    return {"us": duration, "script": name}


def overdue(client: Any, queue: str, count: int) -> int:
    """Deliver ``count`` messages of ``queue`` with a 1 ms visibility timeout: in flight and
    overdue at once, for the sweep to hand back."""
    lib = ScriptLibrary(client, Keyspace(), visibility_ms=1)
    taken = 0
    while taken < count:
        got = len(lib.consume([queue], min(10_000, count - taken)).deliveries)
        if not got:
            break
        taken += got
    return taken


def envelope(size: int) -> str:
    """A kombu envelope of a Celery-like message, as the transport stores it."""
    with Connection("memory://") as conn:
        channel = conn.channel()
        message = channel.prepare_message(json.dumps(body_of_size(size)), 0, "application/json", "utf-8",
                                          {"id": "x" * 36, "task": "bench.noop"}, {"delivery_mode": 2})
        message["properties"]["delivery_info"] = {"exchange": "", "routing_key": BACKLOG}
    return json.dumps(message)


def memory_of(client: Any, connection: Connection, count: int, size: int, *, task_ids: bool = False) -> float:
    """used_memory delta per queued message: ``count`` kombu publishes through ``connection``
    into a fresh queue of ``client``'s server (flushed first). With ``task_ids``, each
    message carries a Celery task id header (``headers.id``), as every Celery task does."""
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    queue = bind_queue("mem")
    body = body_of_size(size)
    with connection:
        producer = connection.Producer()
        for i in range(count):
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue],
                             headers={"id": str(uuid.UUID(int=i))} if task_ids else None)
    delta = (int(client.info("memory")["used_memory"]) - before) / count
    client.flushall()
    return delta


def memory_per_message(server: Server, count: int, size: int) -> dict[str, float]:
    """Ours (publish script) and stock (kombu's LPUSH), kombu messages without task ids."""
    return {name: memory_of(server.client(), Connection(f"{scheme}://127.0.0.1:{server.port}/0"), count, size)
            for name, scheme in (("lua", "redislua"), ("stock", "redis"))}


@contextlib.contextmanager
def every_call_logged(client: Any) -> Iterator[None]:
    """SLOWLOG records every call (from an empty log) inside the block; the default after."""
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    try:
        yield
    finally:
        client.config_set("slowlog-log-slower-than", 10000)


def kombu_phase(peer: Peer, client: Any, n: int, prefetch: int, size: int, repeat: int) -> dict[str, Any]:
    """``repeat`` kombu publish and consume+ack runs on the backlog's queue itself (``n``
    published behind it, the first ``n`` of it consumed and acked: as deep after as before),
    each followed at once by the same run on a fresh, empty queue of the same server, every
    script call in SLOWLOG: the rates of each run, and the slowest call of them all. The
    empty-queue run shares the backlog run's seconds of host speed and the server's size, so
    their ratio is the cost of the queue's depth alone (this host's speed drifts by more
    than the 10% the target allows within a run)."""
    with every_call_logged(client):
        pairs = [(kombu_level.run(peer, n, prefetch, size, queue_name=BACKLOG),
                  kombu_level.run(peer, n, prefetch, size)) for _ in range(repeat)]
        slowest = slowest_call(client)
    return {"publish_msgs_per_s": [deep["publish"]["msgs_per_s"] for deep, _ in pairs],
            "consume_msgs_per_s": [deep["consume"]["msgs_per_s"] for deep, _ in pairs],
            "empty_publish_msgs_per_s": [empty["publish"]["msgs_per_s"] for _, empty in pairs],
            "empty_consume_msgs_per_s": [empty["consume"]["msgs_per_s"] for _, empty in pairs],
            "slowest_during_kombu": slowest}


def sweep_phase(client: Any, lib: ScriptLibrary, queue: str, in_flight: int) -> dict[str, Any]:
    """``in_flight`` messages of the backlog delivered and overdue at once, then one sweep
    (every call of it in SLOWLOG): how long it took, its slowest call, what it handed back."""
    made_overdue = overdue(client, queue, in_flight)
    with every_call_logged(client):
        began = time.perf_counter()
        report = lib.sweep([queue], max_rounds=1000)
        seconds = time.perf_counter() - began
        slowest = slowest_call(client)
    return {"made_overdue": made_overdue, "sweep_requeued": report.requeued, "sweep_seconds": seconds,
            "sweep_slowest_call": slowest}


def cost_in_backlog(server: Server, peer: Peer, sizes: list[int], *, n: int = 3000, prefetch: int = 100,
                    size: int = 300, repeat: int = 1) -> dict[str, Any]:
    """Our transport (``peer``, on ``server``, a throwaway one: the backlog fills it) with each
    of ``sizes`` messages queued, smallest first: kombu publish and consume+ack (medians of
    ``repeat`` runs) and the slowest script call meanwhile, then a sweep of up to IN_FLIGHT
    overdue deliveries. The smallest size is measured again at the end, on a fresh server
    state, so that a host whose speed drifts during the run does not pass for a cost that
    grows with the backlog. The summary: each rate's slowest size over its fastest (1.0 =
    flat), and the slowest sweep call, in ms."""
    client = server.client()
    lib = ScriptLibrary(client, Keyspace())
    payload = envelope(size)
    client.config_set("slowlog-max-len", SLOWLOG_LEN)
    kombu_level.run(peer, n, prefetch, size)  # a warm-up on a queue of its own: imports, script loads
    order = sorted(sizes)
    rounds: list[tuple[int, dict[str, Any]]] = []
    queued = 0
    for count in [*order, order[0]] if len(order) > 1 else order:
        if count < queued:  # back to the smallest: start again from an empty server
            client.flushall()  # not ASYNC: the lazy free of a million would run beside the round
            queued = 0
        began = time.perf_counter()
        fill(lib, BACKLOG, count - queued, payload)
        queued = count
        entry = {"size": count, "fill_seconds": time.perf_counter() - began,
                 **kombu_phase(peer, client, n, prefetch, size, repeat),
                 **sweep_phase(client, lib, BACKLOG, min(count, IN_FLIGHT)),
                 "used_memory": int(client.info("memory")["used_memory"])}
        rounds.append((count, entry))
        print(f"backlog {count:>9,}: publish {statistics.median(entry['publish_msgs_per_s']):7,.0f} msg/s, "
              f"consume+ack {statistics.median(entry['consume_msgs_per_s']):7,.0f} msg/s, slowest call "
              f"{entry['slowest_during_kombu']}, sweep {entry['sweep_seconds']:.3f} s (slowest call "
              f"{entry['sweep_slowest_call']})", flush=True)
    return {"rounds": [entry for _, entry in rounds], **summarize(rounds)}


def summarize(rounds: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per size, the median rate over all its runs; how flat they are; the slowest calls."""
    by_size: dict[int, dict[str, list[float]]] = {}
    for count, entry in rounds:
        rates = by_size.setdefault(count, {"publish": [], "consume": []})
        rates["publish"] += entry["publish_msgs_per_s"]
        rates["consume"] += entry["consume_msgs_per_s"]
    medians = {count: {kind: statistics.median(values) for kind, values in rates.items()}
               for count, rates in by_size.items()}

    def flat(kind: str) -> float:
        values = [m[kind] for m in medians.values()]
        return min(values) / max(values)

    def flat_against_empty(kind: str) -> float:
        """Per size, the median of each run's rate over its empty-queue run's; slowest over fastest."""
        ratios: dict[int, list[float]] = {}
        for count, entry in rounds:
            pairs = zip(entry[f"{kind}_msgs_per_s"], entry[f"empty_{kind}_msgs_per_s"], strict=True)
            ratios.setdefault(count, []).extend(deep / empty for deep, empty in pairs)
        values = [statistics.median(r) for r in ratios.values()]
        return min(values) / max(values)

    def slowest_ms(key: str) -> float | None:
        calls = [entry[key]["us"] for _, entry in rounds if entry[key]]
        return max(calls) / 1000 if calls else None

    largest = max(medians)
    return {"sizes": {str(count): m for count, m in sorted(medians.items())},
            "publish_flat": flat("publish"), "consume_flat": flat("consume"),
            "publish_flat_against_empty": flat_against_empty("publish"),
            "consume_flat_against_empty": flat_against_empty("consume"),
            "publish_msgs_per_s_largest": medians[largest]["publish"],
            "consume_msgs_per_s_largest": medians[largest]["consume"],
            "slowest_call_ms": slowest_ms("slowest_during_kombu"),
            "sweep_slowest_call_ms": slowest_ms("sweep_slowest_call"),
            "largest": largest}


def run(o: argparse.Namespace) -> dict[str, Any]:
    with Server(o.kind) as server:
        peer = Peer("lua", f"redislua://127.0.0.1:{server.port}/0")
        results = {"kind": o.kind, **cost_in_backlog(server, peer, o.sizes, n=o.n, prefetch=o.prefetch,
                                                     size=o.size, repeat=o.repeat)}
        results["memory_per_message"] = memory_per_message(server, o.memory_n, o.size)
    return results


def markdown(results: dict[str, Any]) -> str:
    rounds = results["rounds"]
    base = results["sizes"][str(min(r["size"] for r in rounds))]
    lines = ["| backlog | kombu publish, msg/s | on an empty queue beside it | consume+ack, msg/s "
             "| on an empty queue beside it | slowest script call during them, µs "
             "| overdue in flight, swept back | sweep, s | its slowest call, µs |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rounds:
        publish = statistics.median(r["publish_msgs_per_s"])
        consume = statistics.median(r["consume_msgs_per_s"])
        lines.append(f"| {r['size']:,} | {publish:,.0f} ({publish / base['publish']:.2f}×) | "
                     f"{statistics.median(r['empty_publish_msgs_per_s']):,.0f} | "
                     f"{consume:,.0f} ({consume / base['consume']:.2f}×) | "
                     f"{statistics.median(r['empty_consume_msgs_per_s']):,.0f} | "
                     f"{(r['slowest_during_kombu'] or {}).get('us', '–')} | "
                     f"{r['made_overdue']:,} / {r['sweep_requeued']:,} | {r['sweep_seconds']:.3f} | "
                     f"{(r['sweep_slowest_call'] or {}).get('us', '–')} |")
    lines.append("")
    lines.append(f"Slowest size over fastest: publish {results['publish_flat']:.2f}, consume+ack "
                 f"{results['consume_flat']:.2f} (ratios above are to the smallest size's median over "
                 f"both of its rounds); each run against the empty-queue run beside it: publish "
                 f"{results['publish_flat_against_empty']:.2f}, consume+ack "
                 f"{results['consume_flat_against_empty']:.2f}.")
    mem = results.get("memory_per_message")
    if mem:
        lines.append("")
        lines.append(f"Memory per queued message (used_memory delta): ours {mem['lua']:,.0f} B, stock "
                     f"{mem['stock']:,.0f} B ({mem['lua'] / mem['stock']:.2f}×).")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="redis")
    p.add_argument("--sizes", default="1000,100000,1000000")
    p.add_argument("--n", type=int, default=3000, help="messages per kombu phase")
    p.add_argument("--prefetch", type=int, default=100)
    p.add_argument("--size", type=int, default=300, help="message body bytes")
    p.add_argument("--repeat", type=int, default=3, help="kombu runs per backlog size (medians)")
    p.add_argument("--memory-n", type=int, default=30000)
    o = p.parse_args()
    o.sizes = [int(s) for s in o.sizes.split(",") if s.strip()]
    results = run(o)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "bench-results" / f"backlog-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"command": "python -m scripts.bench.backlog", "options": vars(o), **results},
                              indent=1, default=str))
    print("\n" + markdown(results) + f"\n\n-> {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
