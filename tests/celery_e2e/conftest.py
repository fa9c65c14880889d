"""Fixtures for the Celery end-to-end tests: fresh servers per test, a producer app."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_redis_lua  # noqa: F401  (registers redislua://)
from conftest import require_kind
from helpers import PLACEMENT
from scripts.servers import Cluster, Server
from spares import fresh_cluster

from .harness import Broker

# Every module runs on Valkey and on Redis 7.0. CI's 30-minute budget (`make test`) holds the
# Redis run of the modules that set ON_REDIS = True (what a Redis server could change for
# Celery: the smoke, a broker restart with AOF, stock kombu sharing the database, other
# languages' producers); the other Redis runs are in `make test-all`. The scripts themselves
# run on both servers in `make test` (tests/test_*.py), and those decide the behaviour.
KINDS: list[Any] = ["valkey", "redis"]
REDIS_IN_TEST_ALL: list[Any] = ["valkey", pytest.param("redis", marks=pytest.mark.slow)]
# A module that sets ON_CLUSTERS = True runs on three-primary clusters too (the suite that
# shows Celery works on a cluster); the others restart or inspect one server. The Redis
# cluster run is in `make test-all` (CI time); test_cluster_e2e runs on both in `make test`.
CLUSTER_KINDS: list[Any] = ["valkey-cluster", pytest.param("redis-cluster", marks=pytest.mark.slow)]


@pytest.hookimpl(tryfirst=True)  # before -m deselects what is marked slow
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """CI's budget: a module's CLUSTER_POOLS_IN_TEST_ALL names the pools whose cluster runs go
    to `make test-all` (the pool is the worker's: the cluster changes nothing between pools, and
    one pool's cluster run stays in `make test`)."""
    for item in items:
        params = getattr(item, "callspec", None)
        pools = getattr(getattr(item, "module", None), "CLUSTER_POOLS_IN_TEST_ALL", ())
        if params is not None and str(params.params.get("broker_kind", "")).endswith("-cluster") \
                and params.params.get("pool") in pools:
            item.add_marker(pytest.mark.slow)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "broker_kind" in metafunc.fixturenames:
        kinds = KINDS if getattr(metafunc.module, "ON_REDIS", False) else REDIS_IN_TEST_ALL
        kinds = kinds + (CLUSTER_KINDS if getattr(metafunc.module, "ON_CLUSTERS", False) else [])
        metafunc.parametrize("broker_kind", kinds, indirect=True)


@pytest.fixture
def broker_kind(request: pytest.FixtureRequest) -> str:
    require_kind(request.param.removesuffix("-cluster"))
    return str(request.param)


@pytest.fixture(scope="session", autouse=True)
def placement() -> Iterator[None]:
    yield
    assert not PLACEMENT.unmet("celery")


@pytest.fixture
def servers(broker_kind: str) -> Iterator[tuple[Any, Server]]:
    """A broker server (or cluster) of the kind under test, and a Valkey for results and the
    ledger. Both have ``client()``; a cluster's is a RedisCluster."""
    kind = broker_kind.removesuffix("-cluster")
    broker_server = fresh_cluster(kind) if broker_kind.endswith("-cluster") else Server(kind).start()
    try:
        with Server("valkey") as result_server:
            try:
                yield broker_server, result_server
            finally:
                retire_producers()
                if isinstance(broker_server, Cluster):
                    PLACEMENT.record("celery", broker_kind, broker_server)
    finally:
        broker_server.stop()


@pytest.fixture
def broker(servers: tuple[Any, Server]) -> Broker:
    broker_server, result_server = servers
    if isinstance(broker_server, Cluster):
        url = f"redislua+cluster://127.0.0.1:{broker_server.nodes[0].port}/0"
    else:
        url = f"redislua://127.0.0.1:{broker_server.port}/0"
    return Broker(
        broker_url=url,
        result_url=f"redis://127.0.0.1:{result_server.port}/0",
        transport_options={"visibility_timeout": 30, "sweep_interval": 1},
    )


def make_producer(broker: Broker) -> Celery:
    """A Celery app that only sends tasks by name (the worker's app defines them)."""
    app = Celery("crl-producer", broker=broker.broker_url, backend=broker.result_url,
                 set_as_current=False)
    app.conf.broker_transport_options = broker.transport_options
    app.conf.broker_connection_retry_on_startup = True
    # A result finalized after its server stopped (a test's leftovers, collected in a later
    # test) gives up at once instead of retrying for 20 s inside the garbage collector.
    app.conf.result_backend_transport_options = {
        "retry_policy": {"max_retries": 1, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.1}}
    _PRODUCERS.add(app)
    return app


# Every producer a test made, so that its result subscriptions end while the servers still run.
_PRODUCERS: weakref.WeakSet[Celery] = weakref.WeakSet()


def retire_producers() -> None:
    """End the producers' result subscriptions before their servers stop.

    An AsyncResult left alive unsubscribes when the garbage collector finalizes it; against
    a stopped result server Celery then retries for 20 s inside the collector, in whatever
    later test it runs, and the tracebacks it formats there re-enter ``ast`` (Python 3.11's
    traceback carets), which breaks an ``ast.parse`` that test was running.
    """
    gc.collect()  # finalize the test's results while their server still answers
    for app in list(_PRODUCERS):
        consumer = getattr(app.backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
            consumer.subscribed_to.clear()  # a result finalized later has nothing to unsubscribe
        app.close()
    _PRODUCERS.clear()


@pytest.fixture
def producer(broker: Broker) -> Iterator[Celery]:
    app = make_producer(broker)
    yield app
    app.close()


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(params=REDIS_IN_TEST_ALL)  # CI's budget: a Redis cluster in make test-all
def cluster_broker(request: pytest.FixtureRequest) -> Iterator[tuple[Broker, Cluster]]:
    """A fresh three-primary cluster of each kind, with a Valkey for results."""
    require_kind(request.param)
    cluster = fresh_cluster(request.param)
    try:
        with Server("valkey") as results:
            try:
                yield (Broker(broker_url=f"redislua+cluster://127.0.0.1:{cluster.nodes[0].port}/0",
                              result_url=f"redis://127.0.0.1:{results.port}/0",
                              transport_options={"visibility_timeout": 30, "sweep_interval": 1}), cluster)
            finally:
                retire_producers()
    finally:
        cluster.stop()
