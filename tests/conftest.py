"""Fixtures: throwaway Valkey and Redis servers (standalone and three-primary clusters).

Every server is started here on a free loopback port and dies with the test
process. Script-level tests take the ``lib`` fixture, which runs them on every
server kind, with and without a key prefix. A machine without ``redis-server``
skips the Redis cases with a visible reason; under CI (``CI`` set) that is a
failure instead, so CI always covers Redis 7.0 and Valkey 9.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_redis_lua import Keyspace, ScriptLibrary
from helpers import PLACEMENT
from kombu_support import Broker
from scripts.servers import Cluster, Server, ServerUnavailable, server_binary
from spares import start_ahead, stop_spares

TARGETS = ("valkey", "redis", "valkey-cluster", "redis-cluster")
PREFIXES = ("", "app:")


def require_kind(kind: str) -> None:
    try:
        server_binary(kind)
    except ServerUnavailable as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must cover {kind}: {error}")
        pytest.skip(f"{kind} not available here: {error}")


def _session_servers(make: Callable[[str], Any], kind: str) -> Iterator[Any]:
    require_kind(kind)
    with make(kind) as started:
        yield started


@pytest.fixture(scope="session", autouse=True)
def spare_clusters(request: pytest.FixtureRequest) -> Iterator[None]:
    """Clusters started one test ahead (spares.py): a Valkey one from the start when the run
    has Celery tests on one (that suite runs first and takes one per test); those no test took
    stop with the session."""
    if any("valkey-cluster" in item.nodeid for item in request.session.items):
        start_ahead("valkey")
    yield
    stop_spares()


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[Server]:
    yield from _session_servers(Server, "valkey")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Server]:
    yield from _session_servers(Server, "redis")


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[Cluster]:
    yield from _session_servers(Cluster, "valkey")


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    yield from _session_servers(Cluster, "redis")


@pytest.fixture(params=["valkey", "redis"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A flushed cluster of each kind (the session's), for kombu-level cluster tests."""
    require_kind(request.param)
    started: Cluster = request.getfixturevalue(f"{request.param}_cluster")
    client = started.client()
    client.flushall()
    yield started
    client.flushall()
    client.close()


def cluster_url(cluster: Cluster) -> str:
    """Our transport's URL for ``cluster``."""
    return f"redislua+cluster://127.0.0.1:{cluster.nodes[0].port}/0"


@dataclass
class Target:
    """A server (or cluster) under test and a fresh client for it."""

    name: str
    client: Any
    server: Server | Cluster

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.server, Cluster)

    def flush(self) -> None:
        if self.is_cluster:
            self.client.flushall()  # redis-py sends both to every primary
            self.client.script_flush()
        else:
            self.client.flushall()
            self.client.script_flush()

    def keys(self) -> set[bytes]:
        if self.is_cluster:
            return set(self.client.keys(target_nodes=self.client.ALL_NODES))
        return set(self.client.keys())


def make_target(request: pytest.FixtureRequest, name: str) -> Target:
    server = request.getfixturevalue(name.replace("-", "_") + ("" if "cluster" in name else "_server"))
    client = server.client(socket_timeout=10)
    return Target(name, client, server)


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    target = make_target(request, request.param)
    target.flush()
    yield target
    target.client.close()


@pytest.fixture(params=PREFIXES, ids=["noprefix", "prefix"])
def keyspace(request: pytest.FixtureRequest) -> Keyspace:
    return Keyspace(request.param)


@pytest.fixture
def lib(target: Target, keyspace: Keyspace) -> ScriptLibrary:
    """The script library on every server kind, with and without a key prefix."""
    return ScriptLibrary(target.client, keyspace, visibility_ms=60_000)


@pytest.fixture
def standalone(valkey_server: Server) -> Iterator[redis.Redis]:
    """A flushed client on the session Valkey, for tests that need only one kind."""
    client = valkey_server.client(socket_timeout=10)
    client.flushall()
    yield client
    client.close()


def require_tool(name: str, package: str, why: str) -> str:
    """``name`` from PATH; without it the test is skipped, saying why and what installs it,
    and under CI (which installs it: .ci/run) that is a failure instead."""
    path = shutil.which(name)
    if not path:
        if os.environ.get("CI"):
            pytest.fail(f"CI must {why}: {name} is not on PATH (apt-get install {package})")
        pytest.skip(f"{name} is not on PATH (apt-get install {package}): cannot {why}")
    return path


@pytest.fixture(scope="session")
def redis_cli() -> str:
    """redis-cli from PATH (tests that replay documented sessions need it)."""
    return require_tool("redis-cli", "redis-tools", "run the redis-cli tests")


@pytest.fixture(params=["valkey", "redis"])
def scratch_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A fresh server of each kind, for tests that need an untouched one."""
    require_kind(request.param)
    with Server(request.param) as server:
        yield server


@pytest.fixture(params=[(kind, prefix) for prefix in ("", "app:") for kind in ("valkey", "redis")],
                ids=lambda p: f"{p[0]}-{'prefix' if p[1] else 'noprefix'}")
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    """The transport under test through kombu: each server kind, with and without a prefix."""
    kind, prefix = request.param
    server = request.getfixturevalue(f"{kind}_server")
    client = server.client(socket_timeout=10)
    client.flushall()
    yield Broker(server, prefix, client)
    client.close()


@pytest.fixture(params=["valkey", "redis"])
def kind_broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    """Each server kind once, with a prefix: for kombu-level tests that take seconds."""
    server = request.getfixturevalue(f"{request.param}_server")
    client = server.client(socket_timeout=10)
    client.flushall()
    yield Broker(server, "app:", client)
    client.close()


@pytest.fixture
def conn(broker: Broker) -> Iterator[Connection]:
    with broker.connection() as connection:
        yield connection


# CI's 30-minute budget (`make test`): these run on Valkey there and on Redis too in `make
# test-all` (the Celery end-to-end modules choose in tests/celery_e2e/conftest.py). Each waits
# out expiries, lifetimes or failovers (10-30 s a run), and what it checks is the scripts'
# and the transport's, the same on both servers; the script-level tests run on both in
# `make test`.
SLOW_ON_REDIS = (
    "tests/test_lifecycle.py::test_a_consumed_expiring_queue_keeps_its_bindings_and_its_route",
    "tests/test_lifecycle.py::test_a_queue_with_a_consumer_never_expires_and_late_acks_touch_only",
    "tests/test_lifecycle.py::test_the_keeper_keeps_a_stalled_consumer_s_expiring_queue_alive",
    "tests/test_lifecycle.py::test_an_expiring_fanout_queue_keeps_its_record_under_its_consumer",
    "tests/test_lifecycle.py::test_a_consumer_back_after_its_queue_expired_gets_no_stale_broadcast",
    "tests/celery_e2e/test_sentinel_e2e.py::", "tests/test_sentinel.py::test_the_cli_follows_the_sentinels",
    "tests/test_ttl_expiry.py::test_an_expired_queue_takes_its_messages_and_a_new_one_starts_clean",
)


def prefixed_on_redis(item: pytest.Item) -> bool:
    """A key prefix changes the names the keyspace builds, the same on either server: the
    prefixed runs on Redis (standalone and cluster) are in `make test-all`; `make test` keeps
    them on Valkey, standalone and cluster (the hash tags), and every unprefixed run."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("keyspace") == PREFIXES[1] and str(params.get("target", "")).startswith("redis")


def on_redis_standalone(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.id.split("-")[0] == "redis" and "cluster" not in callspec.id


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: a subset is not held to it
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Count the cluster tests of the suites whose queue placement is checked (helpers.Placement);
    mark the Redis runs of SLOW_ON_REDIS, and the prefixed runs on Redis, slow."""
    for item in items:
        if (item.nodeid.startswith(SLOW_ON_REDIS) and on_redis_standalone(item)) or prefixed_on_redis(item):
            item.add_marker(pytest.mark.slow)
        params = getattr(item, "callspec", None)
        params = params.params if params is not None else {}
        kind = params.get("broker_kind")
        suite = "celery"
        if isinstance(params.get("broker"), tuple):
            kind, suite = params["broker"][0], "kombu"
        if isinstance(kind, str) and kind.endswith("-cluster"):
            PLACEMENT.expect(suite, kind)
