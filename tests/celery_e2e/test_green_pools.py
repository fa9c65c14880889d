"""gevent: no event loop (kombu's hub is not used), so consuming, the heartbeat and
the sweep all run through Transport.drain_events."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from .harness import Broker, Worker, running, wait_for

pytest.importorskip("gevent", reason="gevent is not installed (pip install gevent)")


def test_gevent_pool_runs_tasks_redelivers_and_counts(broker: Broker, producer: Celery,
                                                       log_dir: Path) -> None:
    broker.transport_options.update(visibility_timeout=3, sweep_interval=1)
    with running(Worker(broker, pool="gevent", concurrency=10, log_dir=log_dir)):
        results = [producer.send_task("celery_e2e.app.add", (i, 1)) for i in range(50)]
        assert [r.get(timeout=60) for r in results] == [i + 1 for i in range(50)]
        # A countdown is held by the broker and delivered through drain_events' waits.
        producer.send_task("celery_e2e.app.note", ("green-countdown",), countdown=1)
        ran = wait_for(lambda: broker.entries("ran"), timeout=30, what="the countdown task")
        assert [(e["label"], e["delivery_count"]) for e in ran] == [("green-countdown", 0)]
