"""Issue 31 item 2: an ack the server refuses for a moment is sent again until it lands.

A server that is briefly unable to take writes answers an ack with an error, not a lost
connection: ``READONLY`` from a standalone primary demoted with ``REPLICAOF`` (no Sentinel),
``CLUSTERDOWN`` from a cluster while a primary fails over (``cluster-require-full-coverage
yes``, the default). The ack must be kept and sent again once the server takes writes, so
the acked message is never delivered again. Through plain kombu, one consumer that stays
connected throughout.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue
from kombu.message import Message

from celery_redis_lua import Keyspace, ScriptLibrary
from conftest import require_kind
from helpers import wait_until
from scripts.servers import Cluster, Server, free_port

NAME = "settled"
QUEUE = Queue(NAME, Exchange(NAME, "direct"), routing_key=NAME)
# A demotion refuses writes for milliseconds here; a cluster for the failover's CLUSTERDOWN
# window (about a second): a retried ack must land before the message's deadline lapses.
STANDALONE_VISIBILITY = 2.0
CLUSTER_VISIBILITY = 4.0


# An ack waits this long to be sent (the consumer's loop does not run meanwhile): the test
# reads the server's count of refused scripts after ack() and before the ack goes.
ACK_DELAY = 0.5


def options(visibility: float) -> dict[str, float]:
    return {"visibility_timeout": visibility, "sweep_interval": 0.2, "ack_flush_delay": ACK_DELAY}


def refused_scripts(node: redis.Redis) -> int:
    """EVALSHA calls ``node`` refused without running them: READONLY (a replica refuses a
    script that may write) and CLUSTERDOWN are rejections; NOSCRIPT is not counted here."""
    return int(node.info("commandstats").get("cmdstat_evalsha", {}).get("rejected_calls", 0))


def ack_refused(message: Message, node: redis.Redis, what: str) -> None:
    """Ack ``message`` and wait until ``node`` refused a script after that. On today's code
    that can only be the ack (an acked delivery is no longer extended); a keeper that holds
    the delivery until its ack lands may have its extension refused too, which is as good."""
    message.ack()
    before = refused_scripts(node)
    wait_until(lambda: refused_scripts(node) > before, timeout=10, what=what)


def take_one(conn: Connection, got: list[Message]) -> None:
    conn.Producer().publish({"n": 1}, exchange=QUEUE.exchange, routing_key=NAME, declare=[QUEUE])
    deadline = time.monotonic() + 10
    while not got:
        assert time.monotonic() < deadline, "no delivery"
        with contextlib.suppress(socket.timeout):
            conn.drain_events(timeout=1)


def consume_until_settled(conn: Connection, got: list[Message], settled: Callable[[], bool],
                          visibility: float) -> None:
    """Run the consumer's loop until the broker no longer holds the message (its ack landed)
    or it was delivered again; a delivery's deadline lapses ``visibility`` s after its last
    extension and the sweep runs every 0.2 s, so a dropped ack shows within a few seconds."""
    deadline = time.monotonic() + visibility + 10
    while len(got) == 1 and not settled():
        assert time.monotonic() < deadline, "the message was neither acked nor delivered again"
        with contextlib.suppress(socket.timeout, *conn.connection_errors):
            conn.drain_events(timeout=0.2)


def collector(got: list[Message]) -> Callable[[Any, Message], None]:
    """A callback that keeps the first delivery unacked (the test acks it) and acks any later
    one, so nothing is left in flight for the exit hooks to hand back to a stopped server."""
    def on_message(body: Any, message: Message) -> None:
        got.append(message)
        if len(got) > 1:
            message.ack()
    return on_message


def redelivered(got: list[Message]) -> list[tuple[Any, Any]]:
    return [(m.payload, m.headers.get("x-delivery-count")) for m in got[1:]]


# -- a standalone primary demoted with REPLICAOF -----------------------------------------------

def test_an_ack_refused_by_a_demoted_primary_lands_once_it_is_promoted_back(scratch_server: Server) -> None:
    server = scratch_server
    admin = server.client(socket_timeout=10)
    lib = ScriptLibrary(admin, Keyspace())

    def settled() -> bool:
        [stats] = lib.stats([NAME])
        return (stats.ready, stats.in_flight, stats.delayed) == (0, 0, 0)

    got: list[Message] = []
    url = f"redislua://127.0.0.1:{server.port}/0"
    with (Connection(url, transport_options=options(STANDALONE_VISIBILITY)) as conn,
          Consumer(conn, [QUEUE], callbacks=[collector(got)])):
        take_one(conn, got)
        try:
            # Demoted: a replica of a primary that is not there keeps its data and refuses writes.
            admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
            with pytest.raises(redis.ReadOnlyError):
                lib.publish("elsewhere", "{}")
            ack_refused(got[0], admin, "the ack refused with READONLY")
        finally:
            admin.execute_command("REPLICAOF", "NO", "ONE")
        consume_until_settled(conn, got, settled, STANDALONE_VISIBILITY)
    assert redelivered(got) == [], "the acked message was delivered again (payload, x-delivery-count)"
    assert settled()


# -- a cluster whose primary fails over ------------------------------------------------------


@pytest.fixture(params=["valkey", "redis"])
def replicated(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Three primaries with a replica each, failing over 1 s after a primary stops answering;
    cluster-require-full-coverage is left at its default (yes)."""
    require_kind(request.param)
    with Cluster(request.param, replicas=1, node_timeout_ms=1000) as cluster:
        yield cluster


def cluster_state(node: redis.Redis) -> str:
    info = node.execute_command("CLUSTER", "INFO").decode()
    return dict(line.split(":", 1) for line in info.split("\r\n") if ":" in line)["cluster_state"]


def test_an_ack_refused_while_a_primary_fails_over_lands_once_the_cluster_is_up(replicated: Cluster) -> None:
    owner = replicated.owner(Keyspace().queue(NAME))  # stays up: it answers CLUSTERDOWN
    failing = next(node for node in replicated.primaries() if node.port != owner.port)
    standby = replicated.replica_of(failing)
    at_owner = owner.client(socket_timeout=5)
    lib = ScriptLibrary(replicated.client(), Keyspace())

    def settled() -> bool:
        [stats] = lib.stats([NAME])
        return (stats.ready, stats.in_flight, stats.delayed) == (0, 0, 0)

    got: list[Message] = []
    url = f"redislua+cluster://127.0.0.1:{owner.port}/0"
    with (Connection(url, transport_options=options(CLUSTER_VISIBILITY)) as conn,
          Consumer(conn, [QUEUE], callbacks=[collector(got)])):
        take_one(conn, got)
        # The primary dies; its replica holds back (cluster-replica-no-failover) until the ack
        # has been refused, so the failover's CLUSTERDOWN window lasts as long as the test
        # needs. (A SIGSTOPped replica would not do: redis-py's topology refresh asks it
        # CLUSTER SLOTS and hangs.)
        standby.client(socket_timeout=5).config_set("cluster-replica-no-failover", "yes")
        failing.kill()
        try:
            wait_until(lambda: cluster_state(at_owner) == "fail", timeout=20, what="CLUSTERDOWN")
            ack_refused(got[0], at_owner, "the ack refused with CLUSTERDOWN")
        finally:
            standby.client(socket_timeout=5).config_set("cluster-replica-no-failover", "no")
        wait_until(lambda: cluster_state(at_owner) == "ok" and replicated.role(standby)["role"] == "master",
                   timeout=30, what="the replica promoted and the cluster up")
        consume_until_settled(conn, got, settled, CLUSTER_VISIBILITY)
    assert redelivered(got) == [], "the acked message was delivered again (payload, x-delivery-count)"
    assert settled()
