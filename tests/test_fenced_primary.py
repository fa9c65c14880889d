"""Issue 40 §3: a fenced primary (``min-replicas-to-write 1`` with no replica in reach) refuses
every write with ``NOREPLICAS Not enough good replicas to write.``; the transport handles it
as it handles ``READONLY`` from a demoted primary: retried, never dropped.

A real standalone server started with ``min-replicas-to-write 1`` and no replica, so every
script that may write (publish, declare, consume, ack) and the wake-list BLPOP are refused
before they run; ``CONFIG SET min-replicas-to-write 0`` from another client lifts the fence,
as a replica catching up would. Through plain kombu. A publish (and its declare) waits the
fence out in the channel for up to ``fence_timeout`` (10 s by default), then raises a
connection error that kombu's retry policy may retry.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Queue
from kombu.message import Message

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.fence import NoReplicasError
from conftest import require_kind
from helpers import wait_until
from scripts.servers import Cluster, Server
from test_ack_retry import (
    NAME,
    QUEUE,
    ack_refused,
    collector,
    options,
    redelivered,
    refused_scripts,
    take_one,
)

# The recipe of docs/deployment.md: writes need one replica that acked within 10 s.
FENCE = ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "10"]
VISIBILITY = 10.0  # longer than the fence lasts here: an ack retried meanwhile is still due
# kombu's ensure() for the publish: retried every 50-200 ms, for up to about 20 s.
RETRY = {"max_retries": 100, "interval_start": 0.05, "interval_step": 0.05, "interval_max": 0.2}


@pytest.fixture(params=["valkey", "redis"])
def fenced(request: pytest.FixtureRequest) -> Iterator[Server]:
    require_kind(request.param)
    with Server(request.param, args=FENCE) as server:
        yield server


def fence(server: Server, on: bool) -> None:
    server.client(socket_timeout=10).config_set("min-replicas-to-write", 1 if on else 0)


def url(server: Server) -> str:
    return f"redislua://127.0.0.1:{server.port}/0"


def test_a_publish_refused_by_a_fenced_primary_is_retried_until_the_fence_lifts(fenced: Server) -> None:
    admin = fenced.client(socket_timeout=10)
    outcome: list[BaseException | None] = []
    with Connection(url(fenced), transport_options={"visibility_timeout": VISIBILITY}) as conn:
        def publish() -> None:
            try:
                conn.Producer().publish({"n": 1}, exchange=QUEUE.exchange, routing_key=NAME,
                                        declare=[QUEUE], retry=True, retry_policy=RETRY)
            except BaseException as error:  # the test reads it
                outcome.append(error)
            else:
                outcome.append(None)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        # Refused more than once: the publish (its declare first) was tried again.
        wait_until(lambda: outcome or refused_scripts(admin) >= 3, timeout=10,
                   what="the publish refused with NOREPLICAS, then tried again")
        assert not outcome, f"the publish ended while the primary was fenced: {outcome[0]!r}"
        fence(fenced, on=False)
        publisher.join(30)
        assert outcome == [None], "the publish did not land once the fence lifted"
    [stats] = ScriptLibrary(admin, Keyspace()).stats([NAME])
    assert (stats.ready, stats.in_flight) == (1, 0), "the publish must be stored exactly once"


def test_an_ack_and_the_consumes_refused_by_a_fenced_primary_land_once_it_lifts(fenced: Server) -> None:
    admin = fenced.client(socket_timeout=10)
    lib = ScriptLibrary(admin, Keyspace())

    def settled() -> bool:
        [stats] = lib.stats([NAME])
        return (stats.ready, stats.in_flight, stats.delayed) == (0, 0, 0)

    fence(fenced, on=False)
    got: list[Message] = []
    with (Connection(url(fenced), transport_options=options(VISIBILITY)) as conn,
          Consumer(conn, [QUEUE], callbacks=[collector(got)])):
        take_one(conn, got)
        fence(fenced, on=True)
        ack_refused(got[0], admin, "the ack refused with NOREPLICAS")
        # The consumer's loop goes on meanwhile: its consumes (and BLPOPs) are refused too,
        # each a connection error for kombu (a reconnect, as after READONLY through Sentinel).
        errors: list[BaseException] = []
        refused = refused_scripts(admin)
        deadline = time.monotonic() + 10
        while refused_scripts(admin) < refused + 2:
            assert time.monotonic() < deadline, "no consume was refused during the fence"
            try:
                conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
            except conn.connection_errors as error:
                errors.append(error)
        assert got[1:] == [], "nothing may be delivered while the primary refuses writes"
        fence(fenced, on=False)
        wait_until(lambda: drain_quietly(conn) or settled(), timeout=VISIBILITY,
                   what="the ack sent during the fence to land")
        # The same consumer takes what is published after the fence.
        conn.Producer().publish({"n": 2}, exchange=QUEUE.exchange, routing_key=NAME)
        wait_until(lambda: drain_quietly(conn) or len(got) > 1, timeout=10,
                   what="a delivery after the fence")
    assert [(m.payload, m.headers.get("x-delivery-count")) for m in got[1:]] == [({"n": 2}, 0)], \
        f"the acked message came back: {redelivered(got)}"
    assert any("NOREPLICAS" in str(error) for error in errors), errors


def drain_quietly(conn: Connection) -> None:
    """One turn of the consumer's loop; a refusal or a timeout is the next turn's business."""
    with contextlib.suppress(TimeoutError, *conn.connection_errors):
        conn.drain_events(timeout=0.2)


def test_a_reject_refused_by_a_fenced_primary_lands_once_it_lifts(fenced: Server) -> None:
    """reject(requeue=True) goes at once; refused, it waits in the outbox and is sent again: the
    message comes back once, counted, after the fence lifts (not after the visibility timeout)."""
    admin = fenced.client(socket_timeout=10)
    fence(fenced, on=False)
    got: list[Message] = []
    with (Connection(url(fenced), transport_options=options(VISIBILITY)) as conn,
          Consumer(conn, [QUEUE], callbacks=[collector(got)])):
        take_one(conn, got)
        fence(fenced, on=True)
        before = refused_scripts(admin)
        got[0].reject(requeue=True)
        wait_until(lambda: refused_scripts(admin) > before, timeout=10, what="the reject refused")
        fence(fenced, on=False)
        wait_until(lambda: drain_quietly(conn) or len(got) > 1, timeout=VISIBILITY / 2,
                   what="the rejected message delivered again well before its visibility timeout")
        lib = ScriptLibrary(admin, Keyspace())
        wait_until(lambda: drain_quietly(conn) or lib.stats([NAME])[0].in_flight == 0, timeout=10,
                   what="the second delivery acked")
    assert [(m.payload, m.headers.get("x-delivery-count")) for m in got] == [({"n": 1}, 0), ({"n": 1}, 1)]


def test_with_fence_timeout_0_a_refused_publish_raises_at_once(fenced: Server) -> None:
    """The option's floor: no wait in the channel (kombu's own retry policy, if any, decides)."""
    options = {"visibility_timeout": VISIBILITY, "fence_timeout": 0}
    with Connection(url(fenced), transport_options=options) as conn, pytest.raises(NoReplicasError):
        conn.Producer().publish({"n": 1}, exchange=QUEUE.exchange, routing_key=NAME, declare=[QUEUE])
    assert refused_scripts(fenced.client(socket_timeout=10)) == 1, "refused once, not tried again"


@contextlib.contextmanager
def fenced_shard(messages: bool = True) -> Iterator[tuple[Cluster, ScriptLibrary, str, str, Any]]:
    """A three-primary Valkey cluster, a queue on one primary ("healthy"), one on another
    whose primary is about to be fenced (min-replicas-to-write 1 with no replica: every
    write refused, NOREPLICAS); each declared, with 3 messages unless ``messages`` is False.
    Yields the cluster, a library, both names and the fenced primary's client; the fence is
    lifted on the way out."""
    require_kind("valkey")
    keys = Keyspace()
    with Cluster("valkey") as cluster:
        client = cluster.client()
        lib = ScriptLibrary(client, keys, visibility_ms=60_000)

        def primary_port(queue: str) -> int:
            return int(client.nodes_manager.get_node_from_slot(client.keyslot(keys.queue(queue))).port)

        healthy = "q0"
        fenced_queue = next(q for q in (f"q{i}" for i in range(1, 64))
                            if primary_port(q) != primary_port(healthy))
        for queue in (healthy, fenced_queue):
            lib.declare(queue)
            for i in range(3 if messages else 0):
                lib.publish(queue, b"{}", task_id=f"{queue}-{i}")
        fenced = next(node for node in cluster.nodes if node.port == primary_port(fenced_queue)).client()
        try:
            yield cluster, lib, healthy, fenced_queue, fenced
        finally:
            fenced.config_set("min-replicas-to-write", 0)


def test_a_fenced_shard_does_not_stop_the_other_shards_queues() -> None:
    """On a cluster a consume asks each slot's primary in turn. One primary fenced (NOREPLICAS)
    used to raise out of the whole consume: the messages already taken from the other
    primaries were left in flight with nobody holding them (back only after the visibility
    timeout), and every queue stopped until the shard took writes again. Now the other
    shards' messages are returned; the refusal is raised only when nothing else was taken."""
    with fenced_shard() as (_, lib, healthy, fenced_queue, fenced):
        fenced.config_set("min-replicas-to-write", 1)
        for n, order in enumerate(([fenced_queue, healthy], [healthy, fenced_queue])):
            if n:
                for i in range(3):
                    lib.publish(healthy, b"{}", task_id=f"{healthy}-again-{i}")
            taken = lib.consume(order, 10)  # the fenced slot asked first, then last
            assert [d.queue for d in taken.deliveries] == [healthy] * 3
        stats = lib.stats([healthy])[0]
        assert (stats.in_flight, stats.ready) == (6, 0)  # every one taken was handed out
        with pytest.raises(NoReplicasError):  # nothing else to take: the refusal is raised
            lib.consume([healthy, fenced_queue], 10)
        fenced.config_set("min-replicas-to-write", 0)
        assert len(lib.consume([fenced_queue], 10).deliveries) == 3  # the fence lifted: all there


@pytest.mark.timeout(90)
def test_a_worker_s_other_primaries_go_on_while_one_is_fenced() -> None:
    """The channel's half: a kombu consumer of two queues on two primaries, one fenced. Its
    consume and its BLPOP on the fenced slot are refused; that slot is left alone a moment and
    asked again (protocol/waits.py refuse()), while the other primary's queue is delivered
    without a reconnect: a refusal raised to kombu reconnected the whole channel, every queue
    stopping with it. Once the fence lifts, the fenced queue's messages come within seconds."""
    with fenced_shard(messages=False) as (cluster, _, healthy, fenced_queue, fenced):
        got: list[tuple[str, float]] = []
        url = f"redislua+cluster://127.0.0.1:{cluster.nodes[0].port}/0"
        with Connection(url, transport_options={"blocking_timeout": 1}) as conn:
            producer = conn.Producer()
            for queue in (healthy, fenced_queue):
                for i in range(3):
                    producer.publish({"i": i}, routing_key=queue, declare=[Queue(queue)])
            consumer = Consumer(conn, [Queue(healthy), Queue(fenced_queue)],
                                callbacks=[lambda _, m: (got.append((m.delivery_info["routing_key"],
                                                                     time.monotonic())), m.ack())])
            with consumer:  # declared (a write): the fence comes after
                fenced.config_set("min-replicas-to-write", 1)

                def drain_until(done: Callable[[], bool], seconds: float) -> None:
                    deadline = time.monotonic() + seconds
                    while not done():
                        assert time.monotonic() < deadline, f"timed out; got {got}"
                        with contextlib.suppress(TimeoutError):
                            conn.drain_events(timeout=0.2)  # a refusal raised here fails the test

                drain_until(lambda: len(got) >= 3, 15)
                for i in range(3):  # published while the fence holds: a woken wait, not a poll
                    producer.publish({"i": i}, routing_key=healthy)
                drain_until(lambda: len(got) >= 6, 15)
                assert {queue for queue, _ in got} == {healthy}
                fenced.config_set("min-replicas-to-write", 0)
                lifted = time.monotonic()
                drain_until(lambda: len(got) >= 9, 15)
                assert [queue for queue, _ in got[6:]] == [fenced_queue] * 3
                assert got[6][1] - lifted <= 3, "the fenced slot was asked again within its pause"


@pytest.mark.timeout(90)
def test_a_reconnecting_worker_declares_its_queues_again_past_a_fenced_shard() -> None:
    """Celery declares its queues at every reconnect, and a declare writes: a fenced shard
    refused it, the channel waited fence_timeout (10 s), raised, and the worker reconnected
    to do the same again, consuming none of its queues while one shard was fenced (chaos seed
    1005). A declare this process made before with the same arguments now goes on at once
    past the refusal (protocol/fence.py redeclare), and the other primary's queue is served."""
    with fenced_shard(messages=False) as (cluster, _, healthy, fenced_queue, fenced):
        url = f"redislua+cluster://127.0.0.1:{cluster.nodes[0].port}/0"
        queues = [Queue(healthy), Queue(fenced_queue)]
        with Connection(url) as conn:  # the worker before the fence: declares, publishes
            for queue in queues:
                conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue])
        fenced.config_set("min-replicas-to-write", 1)
        got: list[str] = []
        with Connection(url, transport_options={"blocking_timeout": 1}) as conn:  # reconnected
            started = time.monotonic()
            with Consumer(conn, queues, callbacks=[lambda _, m: (got.append(m.delivery_info["routing_key"]),
                                                                  m.ack())]):
                assert time.monotonic() - started < 3, "the declares waited out the fence"
                deadline = time.monotonic() + 10
                while not got:
                    assert time.monotonic() < deadline, "the healthy queue was not served"
                    with contextlib.suppress(TimeoutError):
                        conn.drain_events(timeout=0.2)
        assert got == [healthy]
