"""Confirmed publishes from 1 and from 8 producer threads (issue 41 §1, group commit): server
CPU per publish and publishes per second, ours against stock kombu, RabbitMQ with confirms,
our transport without group commit, ours with each thread's publishes in one
``confirm_together()`` block (``lua-together``, a Celery group's way), and (``--base REV``)
our transport as it was at a git revision, all in one interleaved run, each job in a process
of its own.

    python -m scripts.bench.publishers                      # Valkey (throwaway), 3 repeats
    python -m scripts.bench.publishers --kind redis --base main -n 2000 --repeat 5

Each thread has a kombu connection of its own (as Celery's producer pool gives each thread
one) and publishes ``-n`` messages of ``--size`` bytes to one queue; a barrier starts them
together. Server CPU is the broker's whole process (INFO used_cpu_*; RabbitMQ's beam.smp
from /proc), per publish. The peers take turns, their order rotated each repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kombu import Producer

from scripts.servers import Server

from .peers import ROOT, Peer, amqp_available, bind_queue, body_of_size, delete_queue, unique_queue
from .server_cost import Probe

TOGETHER = {"lua-together"}  # peers whose threads each publish in one confirm_together() block


def publish_from_threads(peer: Peer, threads: int, n: int, size: int,
                         together: bool = False) -> dict[str, Any]:
    """``threads`` producers of ``n`` confirmed publishes each (``together``: each thread's in
    one ``confirm_together()`` block, as a Celery group's): server CPU µs per publish,
    publishes per second, and requests (script calls or commands) per publish."""
    name = unique_queue("p")
    queue = bind_queue(name)
    body = body_of_size(size)
    connections = [peer.connection() for _ in range(threads)]
    probe = Probe(peer)
    try:
        producers = []
        for i, connection in enumerate(connections):
            producer = Producer(connection.channel(), exchange=queue.exchange, routing_key=name,
                                serializer="json")
            producer.publish(body, declare=[queue] if i == 0 else [])  # connected, route looked up
            producers.append(producer)
        start = threading.Barrier(threads + 1)
        block: Any = contextlib.nullcontext
        if together:
            from celery_redis_lua import confirm_together as block

        def run(producer: Producer) -> None:
            start.wait()
            with block():
                for _ in range(n):
                    producer.publish(body)

        workers = [threading.Thread(target=run, args=(p,)) for p in producers]
        for worker in workers:
            worker.start()
        before = probe.snapshot()
        began = time.perf_counter()
        start.wait()
        for worker in workers:
            worker.join()
        elapsed = time.perf_counter() - began
        cost = probe.cost(before, probe.snapshot(), threads * n)
        per = threads * n
        commands = {name: round(c["calls"] / per, 3) for name, c in cost.get("commands", {}).items()}
        return {"cpu_us": cost.get("cpu_us_per_msg", float("nan")), "per_s": threads * n / elapsed,
                "requests": cost.get("requests_per_msg", float("nan")), "commands": commands}
    finally:
        for connection in connections:
            connection.release()
        probe.close()
        delete_queue(peer, name)


def in_a_process(peer: Peer, threads: int, n: int, size: int,
                 checkout: str | None = None) -> dict[str, Any]:
    """The job in a process of its own (no thread or connection of an earlier job runs beside
    it), with celery_redis_lua imported from ``checkout`` when given."""
    job = json.dumps({"url": peer.url, "options": peer.options, "transport": peer.transport,
                      "threads": threads, "n": n, "size": size, "together": peer.name in TOGETHER})
    path = [str(Path(checkout) / "python"), str(ROOT)] if checkout else [str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([sys.executable, "-m", "scripts.bench.publishers", "--one", job], cwd=ROOT, env=env,
                          check=True, capture_output=True, text=True)
    if checkout and checkout not in done.stderr:
        raise RuntimeError(f"the job did not import celery_redis_lua from {checkout}: {done.stderr[-500:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.publishers",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--kind", choices=["valkey", "redis"], default="valkey")
    p.add_argument("--threads", default="1,8", help="comma-separated producer thread counts")
    p.add_argument("-n", type=int, default=1000, help="publishes per thread")
    p.add_argument("--size", type=int, default=300, help="message body bytes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--base", help="a git revision: our transport as it was there, as a peer")
    p.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672//")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a --base peer's job, in its checkout
    o = p.parse_args(argv)
    if o.one:
        job = json.loads(o.one)
        peer = Peer("job", job["url"], job["transport"], options=job["options"])
        import celery_redis_lua
        print(f"celery_redis_lua from {celery_redis_lua.__file__}", file=sys.stderr)
        print(json.dumps(publish_from_threads(peer, job["threads"], job["n"], job["size"], job["together"])))
        return
    levels = [int(t) for t in o.threads.split(",") if t.strip()]
    with Server(o.kind) as server, tempfile.TemporaryDirectory() as scratch:
        base = f"127.0.0.1:{server.port}"
        peers = [Peer("lua", f"redislua://{base}/0"),
                 Peer("lua-no-group", f"redislua://{base}/2", options={"group_commit": False}),
                 Peer("stock", f"redis://{base}/1"), Peer("lua-together", f"redislua://{base}/4")]
        checkout = str(Path(scratch) / "base")
        if o.base:
            subprocess.run(["git", "worktree", "add", "--detach", checkout, o.base], cwd=ROOT, check=True,
                           capture_output=True)
            peers.append(Peer(f"lua@{o.base}", f"redislua://{base}/3"))
        if amqp_available(o.amqp_url) is None:
            peers.append(Peer("rabbit-confirm", o.amqp_url, options={"confirm_publish": True}))
        results: dict[tuple[str, int], list[dict[str, Any]]] = {}
        try:
            for r in range(o.repeat):
                turn = peers[r % len(peers):] + peers[:r % len(peers)]
                for threads in levels:
                    for peer in turn:
                        one = in_a_process(peer, threads, o.n, o.size,
                                           checkout if peer.name.startswith("lua@") else None)
                        results.setdefault((peer.name, threads), []).append(one)
                        print(f"repeat {r + 1} {threads:2d} threads {peer.name:16s} {one['cpu_us']:7.1f} µs "
                              f"{one['per_s']:8.0f}/s", file=sys.stderr)
        finally:
            if o.base:
                subprocess.run(["git", "worktree", "remove", "--force", checkout], cwd=ROOT, check=False)
    print(f"confirmed publishes on {o.kind} (median of {o.repeat}; {o.n} per thread, {o.size}-byte bodies)")
    print(f"{'threads':>7} {'peer':16s} {'server µs/publish':>18} {'x stock':>8} {'publishes/s':>12} "
          f"{'x stock':>8} {'requests/publish':>17}")
    for threads in levels:
        stock = {k: statistics.median(x[k] for x in results[("stock", threads)]) for k in ("cpu_us", "per_s")}
        for peer in peers:
            rows = results[(peer.name, threads)]
            cpu, rate = (statistics.median(x[k] for x in rows) for k in ("cpu_us", "per_s"))
            requests = statistics.median(x["requests"] for x in rows)
            print(f"{threads:>7} {peer.name:16s} {cpu:18.1f} {cpu / stock['cpu_us']:8.2f} {rate:12.0f} "
                  f"{rate / stock['per_s']:8.2f} {requests:17.2f}")


if __name__ == "__main__":
    main()
