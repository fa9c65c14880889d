"""Celery level: no-op tasks through a real ``celery worker`` process.

Throughput: the producer (this process, ``app.send_task`` as ``task.delay`` does)
publishes N tasks as fast as it can while the worker runs; tasks/s is N over the
time from the first publish to the last task start. Open loop: tasks are sent on a
fixed schedule (R per second for S seconds) and each carries its *scheduled* send
time, so a producer that falls behind shows up as latency (no coordinated
omission); latency is scheduled send -> task start, as percentiles. Drain: the tasks are
queued before the worker starts, and the worker's rate and CPU per task are taken in its
steady state, with no producer on the machine.

Workers run ``--without-heartbeat --without-gossip --without-mingle`` (the same for
every peer), in their own process group, and are stopped by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from . import hdr
from .app import make_app
from .peers import ROOT, Peer, delete_queue, unique_queue
from .server_cost import Probe

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Worker:
    """A ``celery worker`` for one peer, pool and ack mode, consuming one fresh queue."""

    def __init__(self, peer: Peer, pool: str, concurrency: int, acks_late: bool, *,
                 minimal: bool = True) -> None:
        self.peer, self.pool, self.concurrency, self.acks_late = peer, pool, concurrency, acks_late
        self.minimal = minimal  # without heartbeat, gossip and mingle
        self.queue = unique_queue("c")
        self.dir = Path(tempfile.mkdtemp(prefix="crl-bench-"))
        self.ledger, self.ready, self.log = self.dir / "ledger", self.dir / "ready", self.dir / "worker.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._offset, self._lines = 0, b""
        self.timings: dict[str, float] = {}  # start_s (to 'ready'), stop_s (SIGTERM to exit)

    def app(self) -> Any:
        return make_app(self.peer.url, self.peer.transport, self.queue, self.acks_late, self.peer.options)

    def start(self) -> Worker:
        env = dict(os.environ, BENCH_BROKER_URL=self.peer.url, BENCH_TRANSPORT=self.peer.transport or "",
                   BENCH_TRANSPORT_OPTIONS=json.dumps(self.peer.options or {}),
                   BENCH_QUEUE=self.queue, BENCH_ACKS_LATE="1" if self.acks_late else "0",
                   BENCH_LEDGER=str(self.ledger), BENCH_READY=str(self.ready), PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "celery", "-A", "scripts.bench.app", "worker",
                   f"--pool={self.pool}", "-c", str(self.concurrency), "-Q", self.queue,
                   "-n", f"bench-{uuid.uuid4().hex[:6]}@%h", "-l", "warning"]
        if self.minimal:
            command += ["--without-heartbeat", "--without-gossip", "--without-mingle"]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        began = time.monotonic()
        deadline = began + READY_TIMEOUT
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.peer.name} worker did not get ready:\n{self.log_tail()}")
            time.sleep(0.05)
        self.timings["start_s"] = round(time.monotonic() - began, 2)
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the group this worker leads (its pool children)
            process.wait(timeout=STOP_TIMEOUT)
            self.timings["killed"] = 1
        self.timings["stop_s"] = round(time.monotonic() - began, 2)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        delete_queue(self.peer, self.queue)
        if exc_type is None:  # keep the log of a failed run
            shutil.rmtree(self.dir, ignore_errors=True)

    def wait_for(self, tag: str, count: int, timeout: float) -> list[tuple[float, float]]:
        """(sent, started) of the tasks with ``tag``, once ``count`` of them have run."""
        deadline = time.monotonic() + timeout
        found: list[tuple[float, float]] = []
        prefix = tag.encode() + b" "
        while True:
            if self.ledger.exists():
                with self.ledger.open("rb") as f:
                    f.seek(self._offset)
                    chunk = f.read()
                self._offset += len(chunk)
                self._lines += chunk
            *complete, self._lines = self._lines.split(b"\n")
            for line in complete:
                if line.startswith(prefix):
                    _, sent, started = line.split()
                    found.append((float(sent), float(started)))
            if len(found) >= count:
                return found
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.peer.name} worker died:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.peer.name}: {len(found)}/{count} tasks ran in {timeout:.0f} s")
            time.sleep(0.02)


def throughput(worker: Worker, app: Any, n: int, probe: Probe) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    before = probe.snapshot()
    first = time.monotonic()
    with worker.peer.block():
        for _ in range(n):
            app.send_task("bench.noop", args=(tag, time.monotonic()))
    published = time.monotonic()
    ran = worker.wait_for(tag, n, timeout=60 + n / 20)
    after = probe.snapshot()
    last = max(started for _, started in ran)
    return {"n": n, "seconds": last - first, "tasks_per_s": n / (last - first),
            "publish_per_s": n / (published - first),
            "latency_us": hdr.summary((started - sent) * 1e6 for sent, started in ran),
            "server": probe.cost(before, after, n)}


def open_loop(worker: Worker, app: Any, rate: float, seconds: float, probe: Probe) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    count = max(1, round(rate * seconds))
    before = probe.snapshot()
    start = time.monotonic() + 0.05
    behind = 0.0
    for i in range(count):
        scheduled = start + i / rate
        now = time.monotonic()
        if scheduled > now:
            time.sleep(scheduled - now)  # pacing the schedule, not waiting for a condition
        else:
            behind = max(behind, now - scheduled)
        app.send_task("bench.noop", args=(tag, scheduled))
    ran = worker.wait_for(tag, count, timeout=60 + count / 20)
    after = probe.snapshot()
    return {"rate": rate, "seconds": seconds, "n": count, "producer_max_behind_ms": behind * 1e3,
            "latency_us": hdr.summary((started - sent) * 1e6 for sent, started in ran),
            "server": probe.cost(before, after, count)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _worker_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of a worker's main process and of its pool children (prefork)."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return _cpu_seconds(pid), sum(_cpu_seconds(c) for c in children)


def drain(peer: Peer, pool: str, acks_late: bool, n: int, concurrency: int) -> dict[str, Any]:
    """Steady state without a producer: ``n`` tasks are queued before the worker starts, and
    the rate and the worker's CPU per task are taken over the middle 60% of the drain (its
    start and its tail left out). The main process does the broker work (consume, ack, the
    jobs to the pool's pipes); its CPU per task over its children's (the same work with every
    broker) tells the transport's share apart on a host whose speed wanders between runs."""
    worker = Worker(peer, pool, concurrency, acks_late)
    app = worker.app()
    tag = uuid.uuid4().hex[:8]
    try:
        for _ in range(n):
            app.send_task("bench.noop", args=(tag, time.monotonic()))
    finally:
        app.close()
    with worker:
        assert worker.process is not None
        pid = worker.process.pid
        before = len(worker.wait_for(tag, int(n * 0.2), timeout=60 + n / 20))
        began, (main0, children0) = time.monotonic(), _worker_cpu(pid)
        window = len(worker.wait_for(tag, int(n * 0.8) - before, timeout=60 + n / 20))
        seconds, (main1, children1) = time.monotonic() - began, _worker_cpu(pid)
        worker.wait_for(tag, n - before - window, timeout=60 + n / 20)
    main_us, children_us = (main1 - main0) * 1e6 / window, (children1 - children0) * 1e6 / window
    return {"n": n, "window": window, "seconds": seconds, "tasks_per_s": window / seconds,
            "main_cpu_us_per_task": main_us, "children_cpu_us_per_task": children_us,
            "main_over_children": main_us / children_us if children_us else None}


def run(peer: Peer, pool: str, acks_late: bool, n: int, concurrency: int,
        open_loop_rate: float | None = None, open_loop_seconds: float = 10.0) -> dict[str, Any]:
    """One worker: a throughput run, then (optionally) an open-loop run on the same worker."""
    probe = Probe(peer)
    worker = Worker(peer, pool, concurrency, acks_late)
    app = worker.app()
    try:
        with worker:
            tag = "warmup"
            app.send_task("bench.noop", args=(tag, time.monotonic()))
            worker.wait_for(tag, 1, timeout=30)
            result: dict[str, Any] = {"pool": pool, "concurrency": concurrency, "acks_late": acks_late,
                                      "throughput": throughput(worker, app, n, probe)}
            if open_loop_rate:
                result["open_loop"] = open_loop(worker, app, open_loop_rate, open_loop_seconds, probe)
    finally:
        app.close()
        probe.close()
    result["worker"] = worker.timings
    return result
