"""Priority order through a real worker: highest first, publish order within a priority.

Every task is published before the worker starts, so the whole backlog is in the
ready ZSET when the worker's first consume runs. With concurrency 1 and prefetch 1
(CRL_PREFETCH=1) the worker holds one message at a time, so the order of the
ledger's 'ran' entries is exactly the order in which the broker handed them out:
priority 255 first, then 9, 5, 0, and within each priority the publish order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Server

from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True  # also on three-primary clusters (conftest.py)

QUEUE = "celery"
# Mixed on purpose: equal priorities far apart, the extremes 0 and 255, and a
# lowest-priority task published first (a FIFO broker would run it first).
PRIORITIES = [0, 5, 9, 255, 5, 0, 9, 1, 255, 0, 5, 200, 1, 9, 0, 255, 5]


def expected_order(labels: list[str], priorities: list[int]) -> list[str]:
    """Highest priority first; Python's sort is stable, so publish order within one."""
    ranked = sorted(zip(labels, priorities, strict=True), key=lambda pair: -pair[1])
    return [label for label, _ in ranked]


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_backlog_runs_highest_priority_first_then_in_publish_order(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path,
        pool: str) -> None:
    lib = ScriptLibrary(servers[0].client(), Keyspace())
    labels = [f"p{i:02d}-prio{p}" for i, p in enumerate(PRIORITIES)]
    for label, priority in zip(labels, PRIORITIES, strict=True):
        producer.send_task("celery_e2e.app.note", (label,), priority=priority)
    assert lib.stats([QUEUE])[0].ready == len(labels)  # the whole backlog waits in the broker

    worker = Worker(broker, name=f"prio-{pool}", pool=pool, concurrency=1,
                    env={"CRL_PREFETCH": "1"}, log_dir=log_dir)
    with running(worker):
        wait_for(lambda: len(broker.entries("ran")) >= len(labels), timeout=60,
                 what="every task to run")
    ran = [entry["label"] for entry in broker.entries("ran")]
    want = expected_order(labels, PRIORITIES)
    assert ran[0] == want[0] == "p03-prio255"  # the first message taken is the highest
    assert ran == want
