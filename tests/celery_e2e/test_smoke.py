"""A worker runs tasks through the transport and results land in the backend."""

from __future__ import annotations

from .harness import Broker, Worker, running

ON_CLUSTERS = True  # also on three-primary clusters (conftest.py)
ON_REDIS = True  # and its Redis run is in `make test` too


def test_a_worker_runs_tasks_and_stores_results(broker: Broker, producer, log_dir) -> None:
    with running(Worker(broker, log_dir=log_dir)):
        results = [producer.send_task("celery_e2e.app.add", (i, i)) for i in range(20)]
        assert [r.get(timeout=30) for r in results] == [2 * i for i in range(20)]
