"""celery_redis_lua.where and cancel against a real worker: a cancelled countdown never runs,
a running task cannot be cancelled and finishes, and where follows a task from ready to
in flight to gone."""

from __future__ import annotations

from pathlib import Path

import redis
from celery import Celery

import celery_redis_lua
from helpers import server_now_ms

from .harness import Broker, Worker, running, wait_for


def test_a_cancelled_countdown_never_runs(broker: Broker, producer: Celery, servers, log_dir: Path) -> None:
    worker = Worker(broker, name="cancel", log_dir=log_dir)
    with running(worker):
        doomed = producer.send_task("celery_e2e.app.note", ("cancelled",), countdown=3)
        kept = producer.send_task("celery_e2e.app.note", ("kept",), countdown=3)
        assert celery_redis_lua.where(producer, doomed.id).state == "delayed"
        done = celery_redis_lua.cancel(producer, doomed.id)
        assert (done.outcome, done.was, done.queue) == ("cancelled", "delayed", "celery")
        client = redis.Redis(port=servers[0].port)
        due = server_now_ms(client) + 3_000
        wait_for(lambda: "kept" in {e["label"] for e in broker.entries("ran")}, timeout=30,
                 what="the other countdown ran")
        wait_for(lambda: server_now_ms(client) > due + 2_000, timeout=30, what="2 s past the ETA")
        producer.send_task("celery_e2e.app.note", ("marker",))  # the worker keeps consuming ...
        wait_for(lambda: "marker" in {e["label"] for e in broker.entries("ran")}, timeout=30)
        ran = [e["label"] for e in broker.entries("ran")]
        assert "cancelled" not in ran  # ... and never got the cancelled one
        assert celery_redis_lua.where(producer, doomed.id).reason == "cancelled"
        assert celery_redis_lua.where(producer, kept.id).state == "absent"  # ran and was acked


def test_a_running_task_is_left_alone(broker: Broker, producer: Celery, log_dir: Path) -> None:
    worker = Worker(broker, name="busy", log_dir=log_dir, env={"CRL_ACKS_LATE": "1"})
    with running(worker):
        task = producer.send_task("celery_e2e.app.slow", ("long", 3))
        wait_for(lambda: broker.entries("started"), timeout=30, what="the task started")
        assert celery_redis_lua.where(producer, task.id).state == "in_flight"
        done = celery_redis_lua.cancel(producer, task.id)
        assert (done.outcome, done.queue) == ("in_flight", "celery")
        wait_for(lambda: broker.entries("finished"), timeout=60, what="the task finished")
        wait_for(lambda: celery_redis_lua.where(producer, task.id).state == "absent", timeout=30,
                 what="acked")
    assert [e["label"] for e in broker.entries("finished")] == ["long"]
