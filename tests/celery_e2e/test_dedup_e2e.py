"""Deduplication through Celery itself: the task option ``dedup`` (apply_async/send_task, or a
task's route in task_routes) reaches the publish script as a message property, and a real
worker runs the task once however often it was sent while the first waited; once it ran, the
next send runs again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from celery import Celery

import celery_redis_lua

from .harness import Broker, Worker, running, wait_for


def labels(broker: Broker) -> list[str]:
    return [e["label"] for e in broker.entries("ran")]


def test_a_task_sent_again_while_it_waits_runs_once(broker: Broker, producer: Celery, log_dir: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    producer.conf.task_routes = {"celery_e2e.app.add": {"dedup": {"mode": "throttle", "ttl": 60}}}
    with caplog.at_level(logging.INFO, logger="celery_redis_lua"):
        sent = [producer.send_task("celery_e2e.app.note", ("report",), dedup="simple") for _ in range(5)]
        other = producer.send_task("celery_e2e.app.note", ("other",), dedup="simple")  # other arguments
        routed = [producer.send_task("celery_e2e.app.add", (2, 2)) for _ in range(3)]  # by its route
    assert caplog.text.count("was dropped (simple): message") == 4
    assert caplog.text.count("was dropped (throttle): message") == 2
    assert [celery_redis_lua.where(producer, r.id).state for r in sent] == ["ready"] + ["absent"] * 4
    assert celery_redis_lua.where(producer, other.id).state == "ready"
    assert [celery_redis_lua.where(producer, r.id).state for r in routed] == ["ready", "absent", "absent"]
    worker = Worker(broker, name="dedup", log_dir=log_dir)
    with running(worker):  # the ledger and the stored results polled (a result's pubsub can miss)
        wait_for(lambda: sorted(labels(broker)) == ["other", "report"], timeout=30, what="both notes ran")
        wait_for(lambda: routed[0].ready(), timeout=30, what="the routed add ran")
        assert routed[0].result == 4
        wait_for(lambda: celery_redis_lua.where(producer, sent[0].id).state == "absent", timeout=30,
                 what="the first report acked")
        producer.send_task("celery_e2e.app.note", ("report",), dedup="simple")  # its hold went with the ack
        wait_for(lambda: labels(broker).count("report") == 2, timeout=30, what="the report sent again ran")
        throttled = producer.send_task("celery_e2e.app.add", (2, 2))  # its 60 s window holds on
        assert celery_redis_lua.where(producer, throttled.id).state == "absent"
    assert sorted(labels(broker)) == ["other", "report", "report"]
