"""task_acks_late=True: a SIGKILLed worker loses nothing, and the heartbeat prevents doubles.

Both tests use a visibility timeout of 3 s and sweep every second, so a message whose
worker died comes back within a few seconds, and one whose worker is alive but slow
would come back too if the visibility heartbeat (extend every 1 s) did not run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_redis_lua import ScriptLibrary

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True  # also on three-primary clusters (conftest.py)
CLUSTER_POOLS_IN_TEST_ALL = ("threads", "solo")  # prefork's cluster run stays in make test

VISIBILITY = 3
SLOW = "celery_e2e.app.slow"
ACKS_LATE = {"CRL_ACKS_LATE": "1", "CRL_PREFETCH": "1"}


@pytest.fixture
def short_broker(broker: Broker) -> Broker:
    broker.transport_options = {"visibility_timeout": VISIBILITY, "sweep_interval": 1}
    return broker


@pytest.fixture
def fast_producer(short_broker: Broker) -> Iterator[Celery]:
    app = make_producer(short_broker)
    yield app
    app.close()


def broker_lib(broker: Broker) -> ScriptLibrary:
    return broker.lib(visibility_ms=VISIBILITY * 1000)


def late_worker(broker: Broker, name: str, pool: str, log_dir: Path) -> Worker:
    return Worker(broker, name=name, pool=pool, concurrency=1, env=dict(ACKS_LATE), log_dir=log_dir)


@pytest.mark.parametrize("pool", ["prefork"])
def test_a_task_of_a_sigkilled_worker_runs_again_marked_as_redelivered(
        short_broker: Broker, fast_producer: Celery, log_dir: Path, pool: str) -> None:
    lib = broker_lib(short_broker)
    first = late_worker(short_broker, "first", pool, log_dir)
    with running(first):
        result = fast_producer.send_task(SLOW, ("victim", 2.0))
        wait_for(lambda: short_broker.entries("started"), timeout=30, what="first 'started'")
        first.kill()  # the whole process group, mid-task
    assert first.process is not None and first.process.returncode == -9
    # Nothing can hand the message back after SIGKILL: it is in flight, not ready, not acked.
    [stats] = lib.stats(["celery"])
    assert (stats.ready, stats.in_flight, stats.dead) == (0, 1, 0)
    assert short_broker.entries("finished") == []

    with running(late_worker(short_broker, "second", pool, log_dir)):
        assert result.get(timeout=30) == "victim"

    started = short_broker.entries("started")
    assert [(s["label"], s["delivery_count"], s["redelivered"]) for s in started] == [
        ("victim", 0, False), ("victim", 1, True)]
    assert started[0]["pid"] != started[1]["pid"]
    finished = short_broker.entries("finished")
    assert [(f["label"], f["pid"]) for f in finished] == [("victim", started[1]["pid"])]
    [stats] = lib.stats(["celery"])
    assert (stats.ready, stats.in_flight, stats.dead) == (0, 0, 0)


# solo: the task runs on the event loop's own thread, so the keeper's thread extends it.
@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_the_heartbeat_keeps_a_task_longer_than_the_visibility_timeout_from_running_twice(
        short_broker: Broker, fast_producer: Celery, log_dir: Path, pool: str) -> None:
    lib = broker_lib(short_broker)
    runtime = 8 / 3 * VISIBILITY  # 8 s: the deadline would lapse twice without the heartbeat
    workers = (late_worker(short_broker, "busy", pool, log_dir),
               late_worker(short_broker, "idle", pool, log_dir))
    with running(*workers):
        result = fast_producer.send_task(SLOW, ("long", runtime))
        wait_for(lambda: short_broker.entries("started"), timeout=30, what="'started'")
        # While it runs, the message stays in flight (never restored to ready), though
        # both workers sweep every second and the idle one has room to take it.
        observed: set[tuple[int, int]] = set()
        deadline = time.monotonic() + runtime + 30
        while not short_broker.entries("finished"):
            assert time.monotonic() < deadline, "the long task never finished"
            [stats] = lib.stats(["celery"])
            observed.add((stats.ready, stats.in_flight))
            time.sleep(0.2)  # sampling interval of the broker state, not synchronisation
        assert result.get(timeout=30) == "long"
        assert observed == {(0, 1)}
        assert all(w.process is not None and w.process.poll() is None for w in workers)

    started = short_broker.entries("started")
    assert [(s["label"], s["delivery_count"], s["redelivered"]) for s in started] == [
        ("long", 0, False)]
    assert len(short_broker.entries("finished")) == 1
    [stats] = lib.stats(["celery"])
    assert (stats.ready, stats.in_flight, stats.dead) == (0, 0, 0)
