"""Celery's own ``app.control.revoke()`` reaches the broker (issue 39 §2), with no patch to
Celery: countdown tasks revoked while every worker is down never run once workers start (a
stock transport's workers never hear that broadcast, celery/celery#8888); the others run.
A task revoked while it runs, whose worker is then SIGKILLed, is not run again. The revoked
messages are dead letters with reason 'revoked'."""

from __future__ import annotations

from pathlib import Path

from celery import Celery

from celery_redis_lua.tools.envelope import task_of

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

COUNT = 1000
ON_CLUSTERS = True  # also on a three-primary cluster (conftest.py): the queues are found on every node


def test_countdowns_revoked_while_every_worker_is_down_never_run(
        broker: Broker, producer: Celery, log_dir: Path) -> None:
    lib = broker.lib()
    sent = [producer.send_task("celery_e2e.app.note", (f"t{i}",), countdown=2) for i in range(COUNT)]
    assert lib.stats(["celery"])[0].delayed == COUNT  # no worker is up: they wait in the broker
    revoked = {result.id for result in sent[::2]}
    producer.control.revoke(sorted(revoked))  # one broadcast, heard by no worker
    letters = lib.dead_list("celery", count=COUNT)
    assert {task_of(letter.payload)[1] for letter in letters} == revoked
    assert {letter.reason for letter in letters} == {"revoked"}
    assert lib.metrics(["celery"])[0].dropped.get("revoked") == COUNT // 2
    with running(Worker(broker, name="after-revoke", concurrency=4, log_dir=log_dir)):
        wait_for(lambda: len(broker.entries("ran")) >= COUNT // 2, timeout=120, what="the others run")
        producer.send_task("celery_e2e.app.note", ("marker",), countdown=2)  # past every ETA
        wait_for(lambda: any(e["label"] == "marker" for e in broker.entries("ran")), timeout=30,
                 what="a later countdown runs")
    ran = [e["id"] for e in broker.entries("ran") if e["label"] != "marker"]
    assert sorted(ran) == sorted(result.id for result in sent[1::2])  # each once, none revoked
    [stats] = lib.stats(["celery"])
    assert (stats.ready, stats.delayed, stats.in_flight, stats.dead) == (0, 0, 0, COUNT // 2)


def test_a_revoked_task_whose_worker_is_sigkilled_mid_run_is_not_run_again(
        broker: Broker, log_dir: Path) -> None:
    broker.transport_options = {"visibility_timeout": 3, "sweep_interval": 0.5}
    producer = make_producer(broker)
    lib = broker.lib()
    first = Worker(broker, name="killed", concurrency=1, env={"CRL_ACKS_LATE": "1"}, log_dir=log_dir)
    with running(first):
        task = producer.send_task("celery_e2e.app.slow", ("doomed", 60))
        wait_for(lambda: broker.entries("started"), timeout=30, what="the task starts")
        producer.control.revoke(task.id)  # no terminate: it runs on, its message in flight
        first.kill()
    assert lib.stats(["celery"])[0].in_flight == 1
    with running(Worker(broker, name="after-kill", concurrency=1, env={"CRL_ACKS_LATE": "1"},
                        log_dir=log_dir)):
        [letter] = wait_for(lambda: lib.dead_list("celery"), timeout=30, what="the dead letter")
        producer.send_task("celery_e2e.app.note", ("marker",))
        wait_for(lambda: broker.entries("ran"), timeout=30, what="the worker goes on")
    assert (letter.reason, task_of(letter.payload)[1]) == ("revoked", task.id)
    assert [s["label"] for s in broker.entries("started")] == ["doomed"]  # once, never again
    producer.close()
