"""1,000 tasks through a real worker, each run exactly once, results in the backend.

For the default prefork pool and for ``--pool=threads``, on Valkey and Redis: the
ledger holds every label exactly once (no duplicates, none missing), the result
backend holds a SUCCESS result for every task id with the task's return value,
and the broker ends empty (nothing ready, delayed, in flight or dead), so no
duplicate can still be on its way.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Server

from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True  # also on three-primary clusters (conftest.py)

QUEUE = "celery"
TASKS = 1000
SAMPLE = range(0, TASKS, 50)  # results also fetched through AsyncResult.get


def backend_results(result_server: Server) -> dict[str, dict[str, object]]:
    """task id -> stored result meta, for every result key in the backend."""
    client = result_server.client()
    keys = list(client.scan_iter(match="celery-task-meta-*", count=1000))
    metas = [json.loads(raw) for raw in client.mget(keys)] if keys else []
    return {meta["task_id"]: meta for meta in metas}


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_thousand_tasks_run_exactly_once_with_results(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path,
        pool: str) -> None:
    broker_server, result_server = servers
    lib = ScriptLibrary(broker_server.client(), Keyspace())
    labels = [f"t{i:04d}" for i in range(TASKS)]
    worker = Worker(broker, name=f"tp-{pool}", pool=pool, concurrency=2, log_dir=log_dir)
    with running(worker):
        # Published while the worker consumes, through one producer connection.
        with producer.producer_or_acquire() as publisher:
            results = [producer.send_task("celery_e2e.app.note", (label,), producer=publisher)
                       for label in labels]
        wait_for(lambda: len(broker.entries("ran")) >= TASKS, timeout=120,
                 what=f"{TASKS} tasks to run")
        sampled = {labels[i]: results[i].get(timeout=30) for i in SAMPLE}
        wait_for(lambda: len(backend_results(result_server)) >= TASKS, timeout=30,
                 what="every result stored")
        stats = wait_for(lambda: (s := lib.stats([QUEUE])[0]).in_flight == 0 and s, timeout=30,
                         what="every message acked")
    ran = Counter(entry["label"] for entry in broker.entries("ran"))
    duplicates = {label: n for label, n in ran.items() if n > 1}
    assert not duplicates, f"tasks ran more than once: {duplicates}"
    assert set(ran) == set(labels), f"missing: {sorted(set(labels) - set(ran))[:10]}"
    assert len(broker.entries("ran")) == TASKS
    # Every run was a first delivery: nothing was handed back or timed out on the way.
    assert {(e["delivery_count"], e["redelivered"]) for e in broker.entries("ran")} == {(0, False)}
    assert sampled == {labels[i]: labels[i] for i in SAMPLE}
    stored = backend_results(result_server)
    assert set(stored) == {r.id for r in results}
    by_id = {r.id: label for r, label in zip(results, labels, strict=True)}
    assert all(meta["status"] == "SUCCESS" and meta["result"] == by_id[task_id]
               for task_id, meta in stored.items())
    # The ledger's task ids are exactly the published ones, each once.
    assert sorted(e["id"] for e in broker.entries("ran")) == sorted(by_id)
    # Nothing left anywhere in the broker: no late duplicate can come from it.
    assert (stats.ready, stats.delayed, stats.in_flight, stats.dead) == (0, 0, 0, 0)
