"""Cost in the backlog (issue 15): kombu publish and consume+ack rates of our transport with
1,000, 100,000 and 1,000,000 messages already queued, the slowest script call the server
logged meanwhile (SLOWLOG, every call logged), a sweep over the whole backlog, and the memory
per queued message against kombu's stock Redis transport.

``python -m tools.bench.backlog [--sizes 1000,100000,1000000] [--kind redis]`` on a
throwaway server of its own; the backlog is filled with pipelined publish calls (1,000 per
round trip), then each phase runs kombu_level on a second queue of the same server while
the backlog sits in the first. Prints a markdown table; writes bench-results/backlog-*.json.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from kombu import Connection

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.contract import load_scripts
from tools.servers import Server

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


def run(o: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"sizes": {}, "kind": o.kind}
    with Server(o.kind) as server:
        client = server.client()
        lib = ScriptLibrary(client, Keyspace())
        payload = envelope(o.size)
        peer = Peer("lua", f"redislua://127.0.0.1:{server.port}/0")
        client.config_set("slowlog-max-len", SLOWLOG_LEN)
        kombu_level.run(peer, o.n, o.prefetch, o.size)  # a warm-up: the first run pays for imports
        queued = 0
        for size in o.sizes:
            began = time.perf_counter()
            fill(lib, BACKLOG, size - queued, payload)
            queued = size
            filled_s = time.perf_counter() - began
            client.config_set("slowlog-log-slower-than", 0)
            client.slowlog_reset()
            kombu = kombu_level.run(peer, o.n, o.prefetch, o.size)
            during = slowest_call(client)
            made_overdue = overdue(client, BACKLOG, min(size, IN_FLIGHT))
            client.slowlog_reset()
            began = time.perf_counter()
            report = lib.sweep([BACKLOG], max_rounds=1000)
            sweep_s = time.perf_counter() - began
            swept = slowest_call(client)
            results["sizes"][size] = {
                "fill_seconds": filled_s, "publish_msgs_per_s": kombu["publish"]["msgs_per_s"],
                "consume_msgs_per_s": kombu["consume"]["msgs_per_s"], "slowest_during_kombu": during,
                "sweep_seconds": sweep_s, "sweep_slowest_call": swept, "sweep_requeued": report.requeued,
                "made_overdue": made_overdue,
                "used_memory": int(client.info("memory")["used_memory"])}
            print(f"backlog {size:>9,}: publish {kombu['publish']['msgs_per_s']:7,.0f} msg/s, "
                  f"consume+ack {kombu['consume']['msgs_per_s']:7,.0f} msg/s, slowest call {during}, "
                  f"sweep {sweep_s:.3f} s (slowest call {swept})", flush=True)
        client.config_set("slowlog-log-slower-than", 10000)
        results["memory_per_message"] = memory_per_message(server, o.memory_n, o.size)
    return results


def markdown(results: dict[str, Any]) -> str:
    sizes = results["sizes"]
    base = sizes[min(sizes, key=int)]
    lines = ["| backlog | kombu publish, msg/s | consume+ack, msg/s | slowest script call during them, µs "
             "| overdue in flight, swept back | sweep, s | its slowest call, µs |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for size, r in sizes.items():
        pub = r["publish_msgs_per_s"] / base["publish_msgs_per_s"]
        con = r["consume_msgs_per_s"] / base["consume_msgs_per_s"]
        lines.append(f"| {int(size):,} | {r['publish_msgs_per_s']:,.0f} ({pub:.2f}×) | "
                     f"{r['consume_msgs_per_s']:,.0f} ({con:.2f}×) | "
                     f"{(r['slowest_during_kombu'] or {}).get('us', '–')} | "
                     f"{r['made_overdue']:,} / {r['sweep_requeued']:,} | {r['sweep_seconds']:.3f} | "
                     f"{(r['sweep_slowest_call'] or {}).get('us', '–')} |")
    mem = results["memory_per_message"]
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
    p.add_argument("--memory-n", type=int, default=30000)
    o = p.parse_args()
    o.sizes = [int(s) for s in o.sizes.split(",") if s.strip()]
    results = run(o)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "bench-results" / f"backlog-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"command": "python -m tools.bench.backlog", "options": vars(o), **results},
                              indent=1, default=str))
    print("\n" + markdown(results) + f"\n\n-> {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
