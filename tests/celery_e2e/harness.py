"""Real Celery worker processes for the end-to-end tests.

A :class:`Worker` runs ``celery -A celery_e2e.app worker`` in its own process
group, with the broker and result backend URLs in its environment, and is
stopped by PID (SIGTERM, SIGKILL, ...) with ``wait()``. Its log is kept in a
file so a failing test can show it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster

from celery_redis_lua import Keyspace, ScriptLibrary
from helpers import wait_until

TESTS_DIR = Path(__file__).resolve().parents[1]


@dataclass
class Broker:
    """Where workers and producers of one test connect."""

    broker_url: str  # redislua://...
    result_url: str  # redis://... (the ledger and result backend)
    transport_options: dict[str, Any] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CRL_BROKER_URL=self.broker_url,
            CRL_RESULT_URL=self.result_url,
            CRL_TRANSPORT_OPTIONS=json.dumps(self.transport_options),
            PYTHONPATH=os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def client(self) -> Any:
        """A plain client on the broker (a RedisCluster for a ``redislua+cluster://`` URL)."""
        if self.broker_url.startswith("redislua+cluster://"):
            return RedisCluster.from_url(self.broker_url.replace("redislua+cluster://", "redis://", 1))
        return redis.Redis.from_url(self.broker_url.replace("redislua://", "redis://", 1))

    def lib(self, **policy: Any) -> ScriptLibrary:
        """The script library on the broker, e.g. ``lib(visibility_ms=3000)``."""
        return ScriptLibrary(self.client(), Keyspace(), **policy)

    def ledger(self) -> redis.Redis:
        return redis.Redis.from_url(self.result_url)

    def entries(self, kind: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.ledger().lrange(f"ledger:{kind}", 0, -1)]


@dataclass
class Worker:
    broker: Broker
    name: str = "w1"
    pool: str = "threads"
    concurrency: int = 2
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = Path("/tmp")
    gossip: bool = False  # True: the worker consumes events (its own celeryev.<uuid> queue)
    process: subprocess.Popen[bytes] | None = None
    _start_of_run: int = 0  # where this start's lines begin in the log (a restart appends)

    @property
    def hostname(self) -> str:
        return f"{self.name}@%h"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"worker-{self.name}.log"

    def start(self, ready_timeout: float = 60) -> Worker:
        return self.launch().wait_ready(ready_timeout)

    def launch(self) -> Worker:
        """Start the process; :meth:`wait_ready` waits for its "ready." (several workers
        launched first start side by side: their imports are most of a start)."""
        command = [
            sys.executable, "-m", "celery", "-A", "celery_e2e.app", "worker",
            "--loglevel", "INFO", "--pool", self.pool, "--concurrency", str(self.concurrency),
            "--hostname", self.hostname, "--without-mingle",
            *([] if self.gossip else ["--without-gossip"]), *self.extra_args,
        ]
        log = self.log_path.open("ab")
        self._start_of_run = log.tell()
        self.process = subprocess.Popen(
            command, env=self.broker.env(**self.env), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=TESTS_DIR,
        )
        return self

    def wait_ready(self, ready_timeout: float = 60) -> Worker:
        assert self.process is not None
        deadline = time.monotonic() + ready_timeout
        while b" ready." not in self.log_path.read_bytes()[self._start_of_run:]:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited early:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"worker {self.name} not ready:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def signal(self, sig: int) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig) if sig == signal.SIGKILL else self.process.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self, timeout: float = 30, signalled: bool = False) -> None:
        """Warm shutdown (SIGTERM), waited for up to ``timeout``; then SIGKILL. ``signalled``:
        the SIGTERM was sent already (running() stops its workers side by side)."""
        if self.process is None or self.process.poll() is not None:
            return
        if not signalled:
            self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (the main process and its pool children)."""
        if self.process is None:
            return
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running(*workers: Worker) -> Iterator[tuple[Worker, ...]]:
    """Start workers side by side, each ready before the body runs; always stop them side by
    side (and on failure, show them)."""
    started: list[Worker] = []
    try:
        for worker in workers:
            started.append(worker.launch())
        for worker in workers:
            worker.wait_ready()
        yield workers
    except BaseException:
        for worker in started:
            print(f"--- log of worker {worker.name} ---\n{worker.log_tail()}")
        raise
    finally:
        for worker in started:
            if worker.process is not None and worker.process.poll() is None:
                worker.signal(signal.SIGTERM)
        for worker in started:
            worker.stop(signalled=True)


def wait_for(predicate: Any, timeout: float = 30, interval: float = 0.05, what: str = "condition") -> Any:
    """helpers.wait_until with the pace of process-level tests."""
    return wait_until(predicate, timeout, interval, what)
