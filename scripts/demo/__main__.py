"""`make demo` (``python -m scripts.demo``): Celery on celery-redis-lua, on an embedded Valkey
unless a broker URL is given.

Starts real `celery worker` processes and shows: priority order, a countdown
held in the broker, a task redelivered after its worker was SIGKILLed, and a
broadcast reaching two workers. Prints a table per part and cleans up: workers
are stopped by PID, the embedded server is stopped, demo queues are deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT)]  # the package of this checkout, and scripts/

import redis  # noqa: E402
from redis.cluster import RedisCluster  # noqa: E402

from celery_redis_lua import Keyspace, ScriptLibrary  # noqa: E402
from scripts.servers import Cluster, Server, server_version  # noqa: E402

QUEUES = ["demo", "demo-broadcast"]


def table(title: str, header: tuple[str, ...], rows: list[tuple[object, ...]]) -> None:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(f"\n{title}")
    print("  " + line.format(*header))
    print("  " + line.format(*("-" * w for w in widths)))
    for row in rows:
        print("  " + line.format(*(str(c) for c in row)))


class Demo:
    def __init__(self, broker_url: str, ledger: redis.Redis, ledger_url: str, log_dir: Path) -> None:
        self.broker_url, self.ledger, self.log_dir = broker_url, ledger, log_dir
        self.env = dict(os.environ, DEMO_BROKER_URL=broker_url, DEMO_LEDGER_URL=ledger_url,
                        PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT)]))
        os.environ.update(DEMO_BROKER_URL=broker_url, DEMO_LEDGER_URL=ledger_url)
        from scripts.demo.app import app, broadcast_queue, job
        self.app, self.job, self.broadcast_queue = app, job, broadcast_queue

    @contextmanager
    def worker(self, name: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
        log = self.log_dir / f"{name}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "scripts.demo.app", "worker", "-n", f"{name}@demo",
             "--pool", "threads", "-c", "1", "-l", "INFO", "--without-mingle", "--without-gossip",
             *args],
            env=self.env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
            cwd=ROOT)
        try:
            deadline = time.monotonic() + 60
            while b" ready." not in log.read_bytes():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {name} did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.05)
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()

    def entries(self, kind: str) -> list[dict]:
        return [e for e in map(json.loads, self.ledger.lrange("demo:ledger", 0, -1)) if e["kind"] == kind]

    def wait_for(self, predicate, timeout: float = 30):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            if time.monotonic() > deadline:
                raise TimeoutError("the demo waited too long; see the worker logs in " + str(self.log_dir))
            time.sleep(0.05)
        return value

    def priority(self) -> None:
        sent = [("low", 0), ("urgent", 255), ("normal", 5), ("high", 9), ("normal-2", 5), ("low-2", 0)]
        for label, priority in sent:
            self.job.apply_async((label,), priority=priority)
        with self.worker("w1"):
            self.wait_for(lambda: len(self.entries("done")) >= len(sent))
        ran = [e["label"] for e in self.entries("start")]
        given = dict(sent)
        table("1. Priority: six tasks queued before the worker started (concurrency 1, prefetch 1)",
              ("ran", "task", "priority"), [(i + 1, label, given[label]) for i, label in enumerate(ran)])

    def countdown(self) -> None:
        self.ledger.delete("demo:ledger")
        with self.worker("w1"):
            sent = time.time()
            self.job.apply_async(("in-3-seconds",), countdown=3)
            time.sleep(0.5)
            scheduled = self.app.control.inspect(timeout=1).scheduled() or {}
            started = self.wait_for(lambda: self.entries("start"))[0]["at"]
        held = sum(len(v) for v in scheduled.values())
        table("2. Countdown: the ETA waits in the broker, not in the worker", ("what", "value"), [
            ("countdown", "3.0 s"), ("ran after", f"{started - sent:.2f} s"),
            ("tasks the worker held in memory meanwhile (inspect scheduled)", held)])

    def redelivery(self) -> None:
        self.ledger.delete("demo:ledger")
        with self.worker("w1") as first:
            self.job.apply_async(("survivor", 2.0))
            self.wait_for(lambda: self.entries("start"))
            os.killpg(first.pid, signal.SIGKILL)  # the worker dies holding the message
            first.wait()
        killed_at = time.time()
        with self.worker("w2"):
            done = self.wait_for(lambda: self.entries("done"))[0]
        starts = self.entries("start")
        table("3. A worker is SIGKILLed mid-task (acks_late, visibility_timeout 3 s)",
              ("attempt", "worker", "x-delivery-count", "redelivered"),
              [(i + 1, s["worker"], s["delivery_count"], s["redelivered"]) for i, s in enumerate(starts)]
              + [("finished", done["worker"], f"{done['at'] - killed_at:.1f} s after the kill", "")])

    def broadcast(self) -> None:
        self.ledger.delete("demo:ledger")
        with self.worker("w1", "-Q", "demo,demo-broadcast"), self.worker("w2", "-Q", "demo,demo-broadcast"):
            self.job.apply_async(("hello-everyone",), queue=self.broadcast_queue)
            self.wait_for(lambda: len(self.entries("done")) >= 2)
        table("4. Broadcast (a fanout exchange on a Redis stream) reaches every worker",
              ("worker", "task"), sorted((e["worker"], e["label"]) for e in self.entries("done")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default=os.environ.get("CELERY_BROKER_URL"),
                        help="redislua:// or redis:// URL "
                             "(default: $CELERY_BROKER_URL, else an embedded Valkey)")
    parser.add_argument("--cluster", action="store_true",
                        help="on an embedded three-primary Valkey cluster (make demo CLUSTER=1)")
    options = parser.parse_args()
    if options.cluster and options.url:
        parser.error("--cluster starts its own cluster: give no URL with it")
    with ExitStack() as stack:
        broker_client: redis.Redis | RedisCluster
        if options.url:
            ledger_url = options.url.replace("redislua://", "redis://").replace("redisluas://", "rediss://")
            broker_url = "redislua://" + options.url.split("://", 1)[1]
            where = "the given server"
        else:
            server = stack.enter_context(Server("valkey"))
            ledger_url = f"redis://127.0.0.1:{server.port}/0"
            broker_url = f"redislua://127.0.0.1:{server.port}/0"
            where = f"an embedded Valkey on 127.0.0.1:{server.port}"
        ledger = redis.Redis.from_url(ledger_url)
        broker_client = ledger
        if options.cluster:  # the ledger stays on the standalone server started above
            cluster = stack.enter_context(Cluster("valkey"))
            broker_url = f"redislua+cluster://127.0.0.1:{cluster.nodes[0].port}/0"
            broker_client = cluster.client()
            ports = ", ".join(str(node.port) for node in cluster.nodes)
            where = f"an embedded three-primary Valkey cluster (127.0.0.1: {ports})"
        print(f"celery-redis-lua demo: Celery workers on {where} ({server_version(ledger)})")
        if options.cluster:
            for queue in QUEUES:
                node = cluster.owner(Keyspace().queue(queue))
                print(f"  queue {queue!r} lives on the primary 127.0.0.1:{node.port}")
        log_dir = Path(stack.enter_context(__import__("tempfile").TemporaryDirectory(prefix="crl-demo-")))
        demo = Demo(broker_url, ledger, ledger_url, log_dir)
        try:
            demo.priority()
            demo.countdown()
            demo.redelivery()
            demo.broadcast()
        finally:
            ledger.delete("demo:ledger")
            lib = ScriptLibrary(broker_client, Keyspace())
            for queue in QUEUES:
                lib.delete(queue)
        ending = "." if options.url else ", embedded servers stopped."
        print("\nDone: workers stopped, demo queues deleted" + ending)
    return 0


if __name__ == "__main__":
    sys.exit(main())
