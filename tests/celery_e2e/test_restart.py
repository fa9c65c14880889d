"""The broker restarts (SIGKILL, AOF with fsync always) while a worker consumes and a
producer publishes: both reconnect, and every task runs; none is lost.

Duplicates are possible and explained, never silent: a task whose ack (Celery acks
just before running it) died with the server stays in flight and the sweep hands it out
again after the visibility timeout, marked redelivered; and a publish whose reply was
lost is sent again by Celery's retry policy (a second message with the same task id,
delivery count 0 both times). The test reports which kind each duplicate was.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Server

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

ON_REDIS = True  # its Redis run is in `make test` too (conftest.py)

TASKS = 300
RESTART_AFTER = 120  # published before the broker is restarted
RETRY_POLICY = {"max_retries": 100, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.5}


@pytest.fixture
def aof_broker(broker_kind: str) -> Iterator[tuple[Server, Broker]]:
    """A broker server with AOF (fsync always) that the test restarts, and the ledger."""
    aof = ["--appendonly", "yes", "--appendfsync", "always"]
    with Server(broker_kind, args=aof) as broker_server, Server("valkey") as result_server:
        yield broker_server, Broker(
            broker_url=f"redislua://127.0.0.1:{broker_server.port}/0",
            result_url=f"redis://127.0.0.1:{result_server.port}/0",
            transport_options={"visibility_timeout": 4, "sweep_interval": 1},
        )


class Publisher(threading.Thread):
    """Publishes TASKS slow tasks with small pauses, retrying on connection errors."""

    def __init__(self, app: Celery) -> None:
        super().__init__(daemon=True)
        self.app = app
        self.sent = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for i in range(TASKS):
                self.app.send_task("celery_e2e.app.slow", (f"r{i}", 0.05), retry=True,
                                   retry_policy=RETRY_POLICY)
                self.sent = i + 1
                time.sleep(0.005)  # pacing of the load, not synchronisation
        except BaseException as error:  # reported by the test
            self.error = error


def test_worker_and_producer_survive_a_broker_restart_and_no_task_is_lost(
        aof_broker: tuple[Server, Broker], log_dir: Path) -> None:
    server, broker = aof_broker
    producer = make_producer(broker)
    lib = ScriptLibrary(redis.Redis(port=server.port), Keyspace())
    worker = Worker(broker, name="steady", concurrency=2, log_dir=log_dir)
    publisher = Publisher(producer)
    try:
        with running(worker):
            publisher.start()
            wait_for(lambda: publisher.sent >= RESTART_AFTER or publisher.error, timeout=60,
                     what=f"{RESTART_AFTER} published")
            wait_for(lambda: broker.entries("finished"), timeout=30, what="the worker consuming")
            [before] = lib.stats(["celery"])
            sent_at_restart = publisher.sent
            server.restart()
            lib = ScriptLibrary(redis.Redis(port=server.port), Keyspace())
            [after] = lib.stats(["celery"])
            publisher.join(120)
            assert not publisher.is_alive() and publisher.error is None, publisher.error
            wait_for(lambda: _labels(broker) >= {f"r{i}" for i in range(TASKS)}, timeout=90,
                     what="every task to run")
            # ... and whatever copies remain (restored or republished) run too.
            wait_for(lambda: _drained(lib), timeout=60, what="the queue to drain")
            assert worker.process is not None and worker.process.poll() is None
            log = worker.log_path.read_text(errors="replace")
    finally:
        producer.close()

    # The restart happened under load: the AOF kept the backlog the worker had not taken,
    # and the producer went on publishing through it.
    assert before.ready > 0 and sent_at_restart < TASKS
    assert after.ready + after.in_flight >= before.ready
    # The worker reconnected: the same process ran tasks after the restart.
    assert "Connection to broker lost" in log or "Cannot connect to" in log
    started = broker.entries("started")
    assert len({s["pid"] for s in started}) == 1  # threads pool: the one worker process
    counts = Counter(s["label"] for s in started)
    assert set(counts) == {f"r{i}" for i in range(TASKS)}
    duplicates = {label: n for label, n in counts.items() if n > 1}
    explained = {label: _why(started, label) for label in duplicates}
    print(f"restart: broker before {before}, after {after}; duplicates: {explained or 'none'}")
    assert all(why in ("redelivered", "republished") for why in explained.values()), explained
    [final] = lib.stats(["celery"])
    assert (final.ready, final.delayed, final.in_flight, final.dead) == (0, 0, 0, 0)


def _drained(lib: ScriptLibrary) -> bool:
    [stats] = lib.stats(["celery"])
    return (stats.ready, stats.delayed, stats.in_flight) == (0, 0, 0)


def _labels(broker: Broker) -> set[str]:
    return {s["label"] for s in broker.entries("started")}


def _why(started: list[dict[str, object]], label: str) -> str:
    runs = [s for s in started if s["label"] == label]
    if any(s["redelivered"] for s in runs[1:]):
        return "redelivered"
    if all(s["delivery_count"] == 0 for s in runs):
        return "republished"
    return f"unexplained: {runs}"
