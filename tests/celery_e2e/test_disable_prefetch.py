"""Celery 5.6's worker_disable_prefetch with real workers: two `--pool=prefork -c 1` workers and
a backlog of two long tasks, the first worker started alone: it takes one task, and the second
worker runs the other while the first is busy. Without the setting (or with a consume that
takes a batch past Celery's slot check) the first worker reserves both and runs them one after
the other."""

from __future__ import annotations

from pathlib import Path

from celery import Celery

from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True  # also on a three-primary cluster (conftest.py)

SECONDS = 6.0  # long enough for the second worker to start while the first is busy


def test_a_worker_with_disabled_prefetch_leaves_the_second_task_to_another(
        broker: Broker, producer: Celery, log_dir: Path) -> None:
    options = {"pool": "prefork", "concurrency": 1, "env": {"CRL_DISABLE_PREFETCH": "1"}, "log_dir": log_dir}
    for label in ("first", "second"):  # queued before any worker: the first one sees both
        producer.send_task("celery_e2e.app.slow", (label, SECONDS))
    first, second = Worker(broker, name="first", **options), Worker(broker, name="second", **options)
    with running(first):
        wait_for(lambda: broker.entries("started"), timeout=30, what="the first worker starts a task")
        with running(second):
            wait_for(lambda: len(broker.entries("finished")) == 2, timeout=60, what="both tasks finish")
    started = broker.entries("started")
    assert len({entry["pid"] for entry in started}) == 2, started  # one task per worker
    assert abs(started[1]["at"] - started[0]["at"]) < SECONDS, started  # side by side, not in turn
