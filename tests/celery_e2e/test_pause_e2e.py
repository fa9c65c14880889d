"""Pause and resume with real Celery workers: a paused queue delivers nothing to a worker
that was running nor to one started during the pause; resume delivers everything at once.
On a standalone server and a three-primary cluster (the conftest's broker kinds)."""

from __future__ import annotations

import time
from pathlib import Path

from celery import Celery

import celery_redis_lua

from .harness import Broker, Worker, running, wait_for

TASKS = 6
ON_CLUSTERS = True


def test_a_paused_queue_runs_nothing_until_resumed(broker: Broker, producer: Celery, log_dir: Path) -> None:
    first = Worker(broker, name="before", log_dir=log_dir)
    later = Worker(broker, name="during", log_dir=log_dir)
    with running(first):
        producer.send_task("celery_e2e.app.note", ("warm-up",))
        wait_for(lambda: broker.entries("ran"), timeout=30, what="the worker consumes")
        assert celery_redis_lua.pause(producer, "celery", "release 42") is True
        for i in range(TASKS):
            producer.send_task("celery_e2e.app.note", (f"held-{i}",))
        producer.send_task("celery_e2e.app.note", ("countdown",), countdown=1)
        with running(later):  # started during the pause: it gets nothing either
            lib = broker.lib()
            def stored() -> int:
                [stats] = lib.stats(["celery"])
                return stats.ready + stats.delayed

            wait_for(lambda: stored() == TASKS + 1, timeout=30, what="everything stored")
            held_since = time.monotonic()
            while time.monotonic() - held_since < 2:  # the countdown falls due in this window too
                assert [e["label"] for e in broker.entries("ran")] == ["warm-up"]
                time.sleep(0.1)
            assert lib.metrics(["celery"])[0].paused == "release 42"
            assert celery_redis_lua.resume(producer, "celery") is True
            wait_for(lambda: len(broker.entries("ran")) == TASKS + 2, timeout=30,
                     what="everything ran after the resume")
    ran = sorted(e["label"] for e in broker.entries("ran"))
    assert ran == sorted(["warm-up", "countdown", *(f"held-{i}" for i in range(TASKS))])
