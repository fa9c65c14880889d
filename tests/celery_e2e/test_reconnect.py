"""After CLIENT KILL, Celery reconnects and registers the new transport with its event
loop; the old one must not take the new connection's readers away (socket fds are
reused), or the worker sits idle until a blocking wait is declared overdue (~40 s)."""

from __future__ import annotations

import time
from pathlib import Path

from celery import Celery

from .harness import Broker, Worker, running, wait_for


def test_worker_consumes_promptly_after_its_connections_are_killed(
        broker: Broker, producer: Celery, log_dir: Path, servers) -> None:
    admin = servers[0].client()
    with running(Worker(broker, pool="threads", log_dir=log_dir)) as (worker,):
        for round_ in range(4):
            # Kill once the worker is in its blocking wait: a kill that lands earlier only
            # takes idle pool connections, which redis-py reopens without Celery noticing.
            wait_for(lambda: any("b" in c["flags"] for c in admin.client_list()),
                     timeout=30, what="the worker blocked in its wait")
            killed = admin.client_kill_filter(_type="normal", skipme=True)
            assert killed > 0
            wait_for(lambda r=round_: worker.log_path.read_bytes().count(b"Connected to") >= r + 2,
                     timeout=30, what="the worker reconnected")
            sent = time.time()
            producer.send_task("celery_e2e.app.note", (f"after-kill-{round_}",))
            entry = wait_for(lambda r=round_: [e for e in broker.entries("ran")
                                               if e["label"] == f"after-kill-{r}"],
                             timeout=60, what=f"the task of round {round_}")[0]
            # Before the fix half the rounds waited ~38 s (blocking_timeout 10 +
            # health_check_interval 25 + 5); a live consumer takes well under a second.
            assert entry["at"] - sent < 8, f"round {round_}: started {entry['at'] - sent:.1f} s late"
