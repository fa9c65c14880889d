"""Idle warm shutdown: seconds from SIGTERM to exit of an idle worker (what a rolling deploy
waits for), on ``--pool=threads`` and ``--pool=prefork``, with Celery's default bootsteps
(heartbeat, mingle, gossip) and without them."""

from __future__ import annotations

import time
from typing import Any

from .celery_level import Worker
from .peers import Peer

# An idle worker between deploys: long enough for every periodic timer to have started.
IDLE_SECONDS = 2.0
POOLS = ("threads", "prefork")


def run(peer: Peer, concurrency: int = 2) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for pool in POOLS:
        for minimal in (False, True):
            worker = Worker(peer, pool, concurrency, acks_late=False, minimal=minimal)
            app = worker.app()
            try:
                with worker:
                    app.send_task("bench.noop", args=("warmup", time.monotonic()))
                    worker.wait_for("warmup", 1, timeout=30)
                    time.sleep(IDLE_SECONDS)  # the scenario itself: the worker sits idle
                    worker.stop()
            finally:
                app.close()
            result[f"{pool}{'_minimal' if minimal else ''}_s"] = worker.timings["stop_s"]
    return result


def text(result: dict[str, Any]) -> str:
    return "  ".join(f"{pool} {result[f'{pool}_s']:.2f}/{result[f'{pool}_minimal_s']:.2f} s"
                     for pool in POOLS) + "  (default/minimal bootsteps)"
