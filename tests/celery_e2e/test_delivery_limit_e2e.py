"""A task that raises Reject(requeue=True) forever stops after delivery_limit attempts and
is kept in the dead-letter stream, with the reason and the task's own payload."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

LIMIT = 3


@pytest.fixture
def limited_broker(broker: Broker) -> Broker:
    broker.transport_options = {"visibility_timeout": 30, "sweep_interval": 1,
                                "delivery_limit": LIMIT}
    return broker


@pytest.fixture
def limited_producer(limited_broker: Broker) -> Iterator[Celery]:
    app = make_producer(limited_broker)
    yield app
    app.close()


def test_reject_requeue_forever_is_dead_lettered_after_delivery_limit_attempts(
        limited_broker: Broker, limited_producer: Celery, log_dir: Path) -> None:
    lib = limited_broker.lib()
    worker = Worker(limited_broker, name="rejecter", concurrency=1,
                    env={"CRL_ACKS_LATE": "1", "CRL_PREFETCH": "1"}, log_dir=log_dir)
    with running(worker):
        doomed = limited_producer.send_task("celery_e2e.app.always_reject", ("doomed",))
        dead = wait_for(lambda: lib.dead_list("celery"), timeout=30, what="a dead letter")
        # The worker goes on: a task published after the dead-lettering still runs.
        after = limited_producer.send_task("celery_e2e.app.note", ("after",))
        assert after.get(timeout=30) == "after"
        log = worker.log_path.read_text(errors="replace")

    rejected = limited_broker.entries("rejected")
    assert [r["label"] for r in rejected] == ["doomed"] * LIMIT
    [letter] = dead
    assert letter.reason == "delivery-limit"
    assert letter.delivery_count == LIMIT
    envelope = json.loads(letter.payload)
    assert envelope["headers"]["id"] == doomed.id
    assert envelope["headers"]["task"] == "celery_e2e.app.always_reject"
    # Dead-lettered, not lingering: nothing ready, delayed or in flight in the queue.
    [stats] = lib.stats(["celery"])
    assert (stats.ready, stats.delayed, stats.in_flight, stats.dead) == (0, 0, 0, 1)
    assert f"message {letter.id} of queue 'celery' reached delivery_limit={LIMIT}" in log
    assert [r["label"] for r in limited_broker.entries("ran")] == ["after"]
