"""Lifetimes with real Celery workers: every pool drains a backlog without waiting out the
blocking poll between prefetch batches; routes through a named exchange and Celery's
events keep flowing for longer than any binding lifetime with queue_expires set; and a
worker restarted under its node name does not run the control commands sent while it was
down. Each failed on the code before its fix."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue

from helpers import server_now_ms, wait_for_server_time
from scripts.servers import Server

from .harness import Broker, Worker, running, wait_for

NOTE = "celery_e2e.app.note"
POOLS = {"prefork": 2, "threads": 2, "solo": 1, "gevent": 4}
BACKLOG = 60
CONTROL_QUEUE_EXPIRES = 10  # Celery's control_queue_expires default, seconds


@pytest.mark.parametrize("pool", list(POOLS))
def test_every_pool_drains_a_backlog_without_waiting_out_the_block(
        broker: Broker, producer: Celery, log_dir: Path, pool: str) -> None:
    """Found by a user: --pool=solo ran 1.5 tasks per second. It ran each prefetch batch in
    the event loop and then sat a whole blocking_timeout (10 s) before the next one. 60
    tasks are 15 prefetch windows on solo, 4-8 on the others, with the default
    blocking_timeout (10 s)."""
    if pool == "gevent":
        pytest.importorskip("gevent", reason="gevent is not installed")
    for i in range(BACKLOG):
        producer.send_task(NOTE, (f"backlog-{i}",))
    worker = Worker(broker, name=f"drain-{pool}", pool=pool, concurrency=POOLS[pool], log_dir=log_dir)
    with running(worker):
        started = time.monotonic()
        wait_for(lambda: len(broker.entries("ran")) >= BACKLOG, timeout=120, what="the backlog")
        took = time.monotonic() - started
    labels = sorted(e["label"] for e in broker.entries("ran"))
    assert labels == sorted(f"backlog-{i}" for i in range(BACKLOG))  # each exactly once
    # One block waited out is 10 s; the code before the fix took 10.0 s on solo here.
    assert took < 5, f"{pool}: {BACKLOG} tasks took {took:.1f} s after the worker was ready"


@contextmanager
def receiving_events(app: Celery) -> Iterator[list[dict[str, Any]]]:
    """A real event receiver (app.events.Receiver) in a thread, as `celery events` runs."""
    events: list[dict[str, Any]] = []
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": events.append})
        receiver.should_stop = False
        # capture() checks should_stop between one-second polls, so the thread ends promptly.
        thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None,
                                                                  wakeup=False), daemon=True)
        thread.start()
        wait_for(lambda: events, timeout=30, what="the first event (a worker heartbeat)")
        try:
            yield events
        finally:
            receiver.should_stop = True
            thread.join(15)


@pytest.mark.slow  # 28 s (it outlives binding lifetimes): make test-all, for CI's budget
def test_routes_and_events_outlive_every_binding_lifetime_with_queue_expires(
        broker: Broker, producer: Celery, log_dir: Path) -> None:
    """Found by a user: with queue_expires set, a queue's binding to a named exchange lived
    max(x-expires, 300 s) and was never refreshed, so tasks routed through that exchange
    (task_routes with an exchange, topic exchanges) were dropped once it went stale. Here
    bindings live max(10 s, 3 s) (the floor lowered by its option) and the run lasts 25 s,
    with a real event receiver listening to the worker's task events throughout."""
    broker.transport_options.update(queue_expires=10, binding_lifetime_floor=3,
                                    visibility_timeout=300)
    producer.conf.broker_transport_options = broker.transport_options
    # The producer knows the route as the worker does (Celery's routing guide): the queue
    # 'routed' is bound to the topic exchange 'jobs'; each task goes out with its own key.
    producer.conf.task_queues = (Queue("routed", Exchange("jobs", "topic"), routing_key="jobs.#"),)
    env = {"CRL_ROUTED": "1"}
    with running(Worker(broker, name="routed", env=env, extra_args=("-E", "-Q", "routed"),
                        log_dir=log_dir)), receiving_events(producer) as events:
        sent = []
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            result = producer.send_task(NOTE, (f"routed-{len(sent)}",), queue="routed",
                                        routing_key=f"jobs.{len(sent)}")
            sent.append(result.id)
            time.sleep(1)  # the pace of the run, not a synchronisation
        wait_for(lambda: len(broker.entries("ran")) >= len(sent), timeout=30, what="every task")
        succeeded = wait_for(
            lambda: (ids := {e["uuid"] for e in events if e.get("type") == "task-succeeded"})
            >= set(sent) and ids, timeout=30, what="a task-succeeded event for every task")
    assert sorted(e["id"] for e in broker.entries("ran")) == sorted(sent)
    assert succeeded >= set(sent)


def test_a_restarted_worker_does_not_run_control_commands_sent_while_it_was_down(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path) -> None:
    """Found by a user: a worker restarted under the same node name ran a control command
    broadcast while it was stopped (its pidbox queue had expired, control_queue_expires
    = 10 s, but the stream's consumer group kept the backlog)."""
    broker_client = servers[0].client()
    worker = Worker(broker, name="ctl", log_dir=log_dir)
    with running(worker):
        wait_for(lambda: producer.control.ping(timeout=1), timeout=30, what="the worker's pong")
        producer.control.broadcast("record_command", arguments={"label": "live"})
        wait_for(lambda: _labels(broker) == ["live"], timeout=30, what="the live command")
    stopped_at = server_now_ms(broker_client)
    producer.control.broadcast("record_command", arguments={"label": "stale"})
    # The worker stays down for longer than its pidbox queue lives.
    wait_for_server_time(broker_client, stopped_at + CONTROL_QUEUE_EXPIRES * 1000 + 500)
    with running(worker):
        wait_for(lambda: producer.control.ping(timeout=1), timeout=30, what="the worker's pong")
        producer.control.broadcast("record_command", arguments={"label": "fresh"})
        wait_for(lambda: "fresh" in _labels(broker), timeout=30, what="the fresh command")
    assert _labels(broker) == ["live", "fresh"]


def _labels(broker: Broker) -> list[str]:
    return [e["label"] for e in broker.entries("control")]


def test_many_greenlets_share_a_small_connection_pool(broker: Broker, producer: Celery,
                                                      log_dir: Path) -> None:
    """Found by the benchmark's gevent phase: 10 greenlets acking at once on the default
    pool of 10 connections, of which each channel's blocking waits held two, failed acks
    with 'Too many connections' and stalled the worker (576 of 600 tasks in 90 s). The
    waits have connections of their own now, and a command waits for a free one."""
    pytest.importorskip("gevent", reason="gevent is not installed")
    broker.transport_options.update(max_connections=3)
    for i in range(BACKLOG * 3):
        producer.send_task(NOTE, (f"greenlet-{i}",))
    worker = Worker(broker, name="greenlets", pool="gevent", concurrency=20, log_dir=log_dir)
    with running(worker):
        wait_for(lambda: len(broker.entries("ran")) >= BACKLOG * 3, timeout=60, what="the backlog")
    expected = sorted(f"greenlet-{i}" for i in range(BACKLOG * 3))
    assert sorted(e["label"] for e in broker.entries("ran")) == expected
    assert "Too many connections" not in worker.log_path.read_text()
