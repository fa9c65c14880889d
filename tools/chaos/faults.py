"""Faults on a seeded schedule. Each is logged to the ledger with its time, target and
outcome. Runs in the main thread: servers die with the thread that started them
(PR_SET_PDEATHSIG), so a broker restarted from another thread would die with it."""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

from tools.chaos import ledger
from tools.chaos.profiles import FAULT_KINDS, STOCK_SKIPS, Profile
from tools.chaos.workers import ChaosWorker
from tools.servers import Server

WORKER_SIGNALS = {"worker_kill": signal.SIGKILL, "worker_term": signal.SIGTERM,
                  "worker_quit": signal.SIGQUIT}


def schedule(profile: Profile, seed: int) -> list[tuple[float, str]]:
    """(seconds into the load phase, fault kind); every kind once per shuffled round."""
    rng = random.Random(seed)
    plan: list[tuple[float, str]] = []
    at, bag = profile.first_fault, []
    while at < profile.load_seconds - 5:
        if not bag:
            bag = list(FAULT_KINDS)
            rng.shuffle(bag)
        plan.append((round(at, 2), bag.pop()))
        at += rng.uniform(*profile.fault_gap)
    return plan


@dataclass
class FaultInjector:
    server: Server
    workers: list[ChaosWorker]
    transport: str
    profile: Profile
    ledger_url: str
    seed: int

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed * 31 + 5)

    def admin(self) -> Any:
        return self.server.client(socket_timeout=10)

    def inject(self, kind: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"kind": kind, "t": time.time()}
        if self.transport == "stock" and kind in STOCK_SKIPS:
            entry.update(skipped=STOCK_SKIPS[kind])
        elif kind in WORKER_SIGNALS:
            entry.update(self.worker_fault(kind))
        elif kind == "broker_restart":
            self.server.restart()
            entry["down_seconds"] = round(time.time() - entry["t"], 3)
        elif kind == "client_kill":
            admin = self.admin()
            entry["killed"] = admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            admin.close()
        elif kind == "script_flush":
            admin = self.admin()
            admin.script_flush()
            admin.close()
        elif kind == "broker_pause":
            entry.update(self.pause())
        ledger.record("fault", self.ledger_url, **entry)
        return entry

    def worker_fault(self, kind: str) -> dict[str, Any]:
        worker = self.rng.choice(self.workers)
        sent = time.time()
        worker.signal(WORKER_SIGNALS[kind])
        grace = 10 if kind == "worker_kill" else self.profile.slow_seconds[1] + 20
        waited = worker.reap(grace)
        exit_code = worker.process.returncode if worker.process else None
        worker.start()
        return {"t": sent, "target": worker.hostname, "pool": worker.pool,
                "exit_seconds": round(waited, 3), "down_seconds": round(time.time() - sent, 3),
                "exit_code": exit_code}

    def pause(self) -> dict[str, Any]:
        assert self.server.process is not None
        seconds = self.rng.uniform(*self.profile.pause_seconds)
        pid = self.server.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault itself: the broker is stopped this long
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"paused_seconds": round(seconds, 3)}
