"""Celery through Sentinel: tasks flow while the sentinels fail the primary over and while
the primary is SIGKILLed; the worker carries on without a restart, and every task whose
publish returned (durability replicas:1) runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import require_kind
from scripts.servers import SentinelGroup, Server

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for


@pytest.fixture(params=["valkey", "redis"])
def sentinel_broker(request: pytest.FixtureRequest) -> Iterator[tuple[SentinelGroup, Broker]]:
    require_kind(request.param)
    with SentinelGroup(request.param) as group, Server("valkey") as results:
        yield group, Broker(
            broker_url=group.broker_url(),
            result_url=results.url,
            transport_options={"master_name": group.master_name, "durability": "replicas:1",
                               "durability_timeout": 2, "visibility_timeout": 20,
                               "sweep_interval": 1},
        )


class Sender(threading.Thread):
    """Publishes note tasks one by one; remembers which publishes returned."""

    def __init__(self, broker: Broker, count: int) -> None:
        super().__init__(daemon=True)
        self.app = make_producer(broker)
        self.count = count
        self.confirmed: list[str] = []
        self.failed: list[tuple[str, str]] = []

    def run(self) -> None:
        for i in range(self.count):
            label = f"t{i}"
            try:
                self.app.send_task("celery_e2e.app.note", (label,), retry=True,
                                   retry_policy={"max_retries": 20, "interval_start": 0.2,
                                                 "interval_step": 0.2, "interval_max": 0.5})
            except Exception as error:  # NotDurable, or a failover outlasting the retries
                self.failed.append((label, repr(error)))
            else:
                self.confirmed.append(label)
            time.sleep(0.02)


def test_tasks_flow_through_a_failover_and_a_primary_kill(
        sentinel_broker: tuple[SentinelGroup, Broker], log_dir: Path) -> None:
    group, broker = sentinel_broker
    worker = Worker(broker, name="sentinel", pool="threads", concurrency=4, log_dir=log_dir)
    with running(worker):
        pid = worker.process.pid if worker.process else None
        sender = Sender(broker, 300)
        sender.start()
        wait_for(lambda: len(sender.confirmed) >= 60, timeout=60, what="60 tasks published")
        group.failover()
        group.wait_until_settled()
        wait_for(lambda: len(sender.confirmed) >= 150, timeout=90, what="150 tasks published")
        killed, _ = group.kill_primary()
        killed.start()  # it rejoins as a replica of the new primary
        group.wait_until_settled()
        sender.join(180)
        assert not sender.is_alive()
        ran = lambda: {entry["label"] for entry in broker.entries("ran")}  # noqa: E731
        wait_for(lambda: set(sender.confirmed) <= ran(), timeout=120,
                 what="every task whose publish returned ran")
        assert worker.process is not None and worker.process.poll() is None and worker.process.pid == pid
        # The same worker still takes new work after both failovers.
        make_producer(broker).send_task("celery_e2e.app.note", ("after",))
        wait_for(lambda: "after" in ran(), timeout=60, what="a task sent after the failovers ran")
    assert len(sender.confirmed) >= 250, sender.failed[:5]  # most publishes went through
    assert "Unrecoverable error" not in worker.log_path.read_text()
