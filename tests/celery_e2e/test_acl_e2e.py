"""Celery end to end as the least-privilege users of docs/deployment.md: a worker as the worker
user (with and without CLIENT UNBLOCK), tasks sent as the producer user. An idle worker's
warm shutdown does not wait out blocking_timeout either way."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_redis_lua.protocol.acl import setuser
from scripts.servers import Server

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

PREFIX = "app:"
PASSWORD = "least-Pw1"
BLOCKING_TIMEOUT = 30


@pytest.fixture
def users(servers: tuple[Server, Server]) -> Iterator[Server]:
    broker_server = servers[0]
    admin = broker_server.client()
    for user, role, unblock in (("worker", "worker", True), ("producer", "producer", True),
                                ("nounblock", "worker", False)):
        admin.execute_command(*setuser(user, role, PREFIX, password=PASSWORD, unblock=unblock))
    yield broker_server


def broker_as(server: Server, results: Server, user: str) -> Broker:
    return Broker(broker_url=f"redislua://{user}:{PASSWORD}@127.0.0.1:{server.port}/0",
                  result_url=results.url,
                  transport_options={"global_keyprefix": PREFIX, "blocking_timeout": BLOCKING_TIMEOUT,
                                     "visibility_timeout": 30, "sweep_interval": 1})


@pytest.mark.parametrize("worker_user", ["worker", "nounblock"])
def test_celery_runs_as_least_privilege_users(users: Server, servers: tuple[Server, Server],
                                              log_dir: Path, worker_user: str) -> None:
    results = servers[1]
    worker = Worker(broker_as(users, results, worker_user), name=worker_user, pool="threads",
                    concurrency=2, log_dir=log_dir, extra_args=["--without-heartbeat"])
    producer = make_producer(broker_as(users, results, "producer"))
    with running(worker):
        for i in range(20):
            producer.send_task("celery_e2e.app.note", (f"t{i}",), priority=i % 10)
        wait_for(lambda: len(worker.broker.entries("ran")) == 20, timeout=60, what="20 tasks ran")
        time.sleep(1)  # idle now: the worker's waits are blocked on the server
        began = time.monotonic()
        worker.signal(signal.SIGTERM)
        worker.wait(BLOCKING_TIMEOUT)
        took = time.monotonic() - began
    print(f"idle warm shutdown as {worker_user!r}: {took:.2f} s")
    assert took < BLOCKING_TIMEOUT / 3, f"shutdown took {took:.1f} s: it waited out a blocking wait"
    log = worker.log_path.read_text()
    assert "NOPERM" not in log and "Unrecoverable error" not in log
