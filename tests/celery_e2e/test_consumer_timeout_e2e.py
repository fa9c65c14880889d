"""x-consumer-timeout with a real worker (issue 39 §4): a task that never returns is delivered
again once per timeout (the keeper stops keeping its message alive, the sweep takes it back,
counted as a delivery), until the delivery limit dead-letters it; the worker logs the queue
and the message id each time. The worker stays up and connected throughout."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from celery import Celery

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

LIMIT = 3
TIMEOUT_MS = 2000


@pytest.fixture
def timed_broker(broker: Broker) -> Broker:
    broker.transport_options = {"visibility_timeout": 6, "sweep_interval": 0.5, "delivery_limit": LIMIT}
    return broker


@pytest.fixture
def timed_producer(timed_broker: Broker) -> Iterator[Celery]:
    app = make_producer(timed_broker)
    yield app
    app.close()


def test_a_task_that_never_returns_is_delivered_once_per_timeout_until_the_delivery_limit(
        timed_broker: Broker, timed_producer: Celery, log_dir: Path) -> None:
    lib = timed_broker.lib()
    lib.declare("celery", consumer_timeout_ms=TIMEOUT_MS)  # the worker's declare keeps it
    worker = Worker(timed_broker, name="hung", concurrency=LIMIT + 1,
                    env={"CRL_ACKS_LATE": "1", "CRL_PREFETCH": "1"}, log_dir=log_dir)
    with running(worker):
        timed_producer.send_task("celery_e2e.app.slow", ("hung", 3600))
        [letter] = wait_for(lambda: lib.dead_list("celery"), timeout=60, what="the dead letter")
        log = worker.log_path.read_text(errors="replace")
        worker.kill()  # its threads sleep for an hour
    started = timed_broker.entries("started")
    assert [s["delivery_count"] for s in started] == list(range(LIMIT))
    gaps = [b["at"] - a["at"] for a, b in pairwise(started)]
    # Each delivery is kept alive for the timeout (not the 6 s visibility timeout), and goes
    # back within a sweep interval or two of it.
    assert all(TIMEOUT_MS / 1000 <= gap < TIMEOUT_MS / 1000 + 3 for gap in gaps), gaps
    assert (letter.reason, letter.delivery_count) == ("delivery-limit", LIMIT)
    warned = log.count(f"message {letter.id} of queue 'celery' is held past the queue's x-consumer-timeout")
    assert warned >= LIMIT - 1, log[-3000:]
