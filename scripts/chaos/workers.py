"""Chaos worker processes: ``celery -A scripts.chaos.app worker`` in their own process
groups, started (waiting for 'ready.'), signalled, reaped and restarted by the harness."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ChaosWorker:
    name: str
    pool: str
    concurrency: int
    env: dict[str, str]
    log_dir: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    # what runs it in a network namespace of its own (switch.py: ``ip netns exec``, which
    # execs it: the pid, its process group and signals stay the worker's)
    prefix: tuple[str, ...] = ()

    @property
    def hostname(self) -> str:
        return f"{self.name}@chaos"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"worker-{self.name}.log"

    def start(self, ready_timeout: float = 90) -> None:
        command = [
            *self.prefix, sys.executable, "-m", "celery", "-A", "scripts.chaos.app", "worker",
            "--loglevel", "INFO", "--pool", self.pool, "--concurrency", str(self.concurrency),
            "--hostname", self.hostname, "--without-mingle", "--without-gossip",
            "--without-heartbeat", "-E", "-Q", self.env.get("CHAOS_QUEUES", "celery,expiring"),
        ]
        env = dict(os.environ, **self.env, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        with self.log_path.open("ab") as log:
            offset = log.tell()
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=ROOT)
        self.starts += 1
        deadline = time.monotonic() + ready_timeout
        while b" ready." not in self.log_path.read_bytes()[offset:]:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited early; see {self.log_path}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"worker {self.name} not ready; see {self.log_path}")
            time.sleep(0.05)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        """SIGKILL goes to the process group; other signals to the main process only."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            if sig == signal.SIGKILL:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)

    def reap(self, timeout: float) -> float:
        """Wait for the main process to exit (SIGKILL the group after ``timeout``), then
        SIGKILL whatever is left in its group (pool children). Returns seconds waited."""
        assert self.process is not None
        began = time.monotonic()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return time.monotonic() - began

    def kill(self) -> None:
        if self.process is not None:
            self.signal(signal.SIGKILL)
            self.reap(10)

    def stop(self, timeout: float = 30) -> None:
        if self.alive:
            self.signal(signal.SIGTERM)
            self.reap(timeout)
        elif self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
