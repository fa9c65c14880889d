"""Redelivery backoff with a real Celery worker: a task that always raises Reject(requeue=True)
on a queue with delayed retry 'failed' is delivered again after min(min * count, max), the
spacing measured from the task's own timestamps, until the delivery limit dead-letters it. On
a standalone server and a three-primary cluster (the conftest's broker kinds)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True
MIN_S, MAX_S, LIMIT = 1.0, 2.0, 5
TOLERANCE = 0.10  # the bound: within 10% of the formula


def test_a_rejected_task_comes_back_after_the_backoff_delay(broker: Broker, log_dir: Path) -> None:
    broker.transport_options.update(delayed_retry_type="failed", delayed_retry_min=MIN_S,
                                    delayed_retry_max=MAX_S, delivery_limit=LIMIT)
    producer = make_producer(broker)
    # Reject acts on an unacked message: the task acks late (Celery's rule, not ours).
    with running(Worker(broker, name="retrier", env={"CRL_ACKS_LATE": "1"}, log_dir=log_dir)):
        producer.send_task("celery_e2e.app.always_reject", ("poison",))
        lib = broker.lib()
        wait_for(lambda: lib.dead_list("celery"), timeout=60, what="the delivery limit dead-letters it")
    times = [entry["at"] for entry in broker.entries("rejected")]
    assert len(times) == LIMIT, times  # one delivery per attempt, none early, none lost
    gaps = [later - earlier for earlier, later in pairwise(times)]
    expected = [min(MIN_S * count, MAX_S) for count in range(1, LIMIT)]  # 1, 2, 2, 2 s
    for gap, want in zip(gaps, expected, strict=True):
        assert want * (1 - TOLERANCE) <= gap <= want * (1 + TOLERANCE), (gaps, expected)
    [letter] = lib.dead_list("celery")
    assert (letter.reason, letter.delivery_count) == ("delivery-limit", LIMIT)
    [metrics] = lib.metrics(["celery"])
    assert (metrics.delayed, metrics.retrying, metrics.redelivered) == (0, 0, LIMIT - 1)
