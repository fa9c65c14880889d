"""A dropped connection must not run a task twice (acks_late).

Found by the chaos harness (long run, Redis AOF, seed 1): after CLIENT KILL, kombu closes
the channel and asks for its unacked messages to be restored. Celery 5.7 keeps running the
task it already started (and, on the threads pool, the ones queued in the executor) and
acks them through their old Message after reconnecting, so handing them all back at close
ran them a second time: counted 79 times as `client_kill` duplicates, and 5 times as
unattributable ones, where the first copy only started after the kill. The transport now
keeps those deliveries held by their Messages (keeper.py): it keeps extending them while Celery holds them,
takes their late ack, and hands back only the ones Celery dropped (prefork discards what
it had only prefetched).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

VISIBILITY = 3
QUEUED = ("queued-1", "queued-2", "queued-3")


@pytest.fixture
def short_broker(broker: Broker) -> Broker:
    broker.transport_options = {"visibility_timeout": VISIBILITY, "sweep_interval": 1}
    return broker


def broker_stats(broker: Broker) -> tuple[int, int, int, int]:
    [stats] = broker.lib().stats(["celery"])
    return stats.ready, stats.delayed, stats.in_flight, stats.dead


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_tasks_held_by_a_worker_run_once_when_its_connection_is_killed(
        short_broker: Broker, servers, log_dir: Path, pool: str) -> None:
    producer: Celery = make_producer(short_broker)
    worker = Worker(short_broker, name="held", pool=pool, concurrency=1, log_dir=log_dir,
                    env={"CRL_ACKS_LATE": "1", "CRL_PREFETCH": "4"})
    with running(worker):
        # Longer than the visibility timeout: the adopted delivery must keep being extended.
        producer.send_task("celery_e2e.app.slow", ("long", 2 * VISIBILITY))
        for label in QUEUED:
            producer.send_task("celery_e2e.app.note", (label,))
        wait_for(lambda: short_broker.entries("started"), timeout=30, what="'long' started")
        wait_for(lambda: broker_stats(short_broker) == (0, 0, 4, 0), timeout=30,
                 what="all four messages held by the worker")

        killed = servers[0].client().client_kill_filter(_type="normal", skipme=True)
        assert killed > 0

        def all_done() -> bool:
            ran = {entry["label"] for entry in short_broker.entries("ran")}
            return (bool(short_broker.entries("finished")) and ran >= set(QUEUED)
                    and broker_stats(short_broker) == (0, 0, 0, 0))

        # Once the broker holds nothing (all acked), no copy is left that could run again.
        wait_for(all_done, timeout=60, what="every task ran and was acked")
    producer.close()

    started = short_broker.entries("started")
    assert [(s["label"], s["delivery_count"], s["redelivered"]) for s in started] == [
        ("long", 0, False)], ("the running task must neither be handed back nor restored:\n"
                              + worker.log_tail(80))
    assert [f["label"] for f in short_broker.entries("finished")] == ["long"]
    runs = sorted(entry["label"] for entry in short_broker.entries("ran"))
    assert runs == list(QUEUED), f"each queued task runs exactly once, got {runs}"
    counts = {entry["label"]: entry["delivery_count"] for entry in short_broker.entries("ran")}
    if pool == "threads":
        # Queued in the thread pool's executor: they run from there, on their first delivery.
        assert set(counts.values()) == {0}
    else:
        # Prefork discards what it had only prefetched; those are handed back, counted.
        assert set(counts.values()) == {1}
