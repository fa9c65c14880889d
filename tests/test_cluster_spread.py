"""The script library on three-primary clusters, with queues on all three nodes.

Every script keeps to the slot of the keys it declares, so nothing here may raise a
CROSSSLOT or non-local-key error; a multi-queue call spanning nodes is split by slot in
Python. The server is the guard: declared keys of two slots are refused before the script
runs, and a ``#!lua`` script touching an undeclared key of another slot fails even when
that slot lives on the same node (a script without the shebang would get away with it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redis_lua import Keyspace, QueueStats, ScriptLibrary, load_scripts
from conftest import Target, make_target
from helpers import is_message_id, names_on_each_node, server_now_ms, wait_for_server_time

CLUSTERS = ("valkey-cluster", "redis-cluster")


@pytest.fixture(params=CLUSTERS)
def cluster(request: pytest.FixtureRequest) -> Iterator[Target]:
    target = make_target(request, request.param)
    target.flush()
    yield target
    target.client.close()


def node_client(client: Any, key: str) -> redis.Redis:
    return client.get_redis_connection(client.get_node_from_key(key))


def node_keys(client: Any, key: str) -> set[bytes]:
    return set(node_client(client, key).keys())


def test_queues_on_every_node_run_every_operation(cluster: Target, keyspace: Keyspace) -> None:
    client = cluster.client
    lib = ScriptLibrary(client, keyspace, visibility_ms=300)
    patient = ScriptLibrary(client, keyspace, visibility_ms=60_000)
    queues = names_on_each_node(client, keyspace)
    nodes = {client.get_node_from_key(keyspace.queue(q)).name for q in queues}
    assert len(nodes) == len(client.get_primaries()) == 3

    for q in queues:
        lib.declare(q, max_priority=9)
        for n, priority in enumerate((0, 9, 5, 1)):
            lib.publish(q, f"{q}-{n}", priority=priority)

    consumed = lib.consume(queues, 100).deliveries  # one call spanning three nodes
    by_queue = {q: [d for d in consumed if d.queue == q] for q in queues}
    for q in queues:
        assert [d.payload for d in by_queue[q]] == [f"{q}-{n}".encode() for n in (1, 2, 3, 0)]
        assert all(d.delivery_count == 0 for d in by_queue[q])

    eta = server_now_ms(client) + 200
    for q in queues:
        lib.publish(q, f"{q}-late", eta_ms=eta)

    for q in queues:  # each node holds its own queue's keys, and only those
        held = node_keys(client, keyspace.queue(q))
        assert {keyspace.wake(q).encode(), keyspace.meta(q).encode(), keyspace.index(q).encode(),
                keyspace.delayed(q).encode(), keyspace.message(q).encode(),
                keyspace.state(q).encode()} <= held
        assert all(b"{" + q.encode() + b"}" in key for key in held)
        assert len({client.keyslot(key) for key in held}) == 1  # one slot per queue
        assert node_client(client, keyspace.queue(q)).dbsize() > 0

    for q in queues:
        acked, requeued, extended, _abandoned = by_queue[q]
        assert lib.ack(q, [acked.id]) == 1
        assert lib.reject(q, [requeued.id], requeue=True).requeued == 1
        before = client.zscore(keyspace.index(q), extended.id)
        assert patient.extend(q, [extended.id]) == 1
        assert client.zscore(keyspace.index(q), extended.id) > before

    last_deadline = max(int(client.zscore(keyspace.index(q), by_queue[q][3].id)) for q in queues)
    wait_for_server_time(client, max(eta, last_deadline) + 1)
    report = lib.sweep(queues)
    assert (report.promoted, report.requeued, report.limit_reached, report.expired,
            report.orphans) == (3, 3, 0, 0, 0)
    assert lib.stats(queues) == [QueueStats(q, 3, 0, 1, 0) for q in queues]

    for q in queues:
        rejected = lib.reject(q, [by_queue[q][2].id], requeue=False)
        assert rejected.dead_lettered == 1
    again = lib.consume(queues, 100).deliveries
    assert sorted((d.payload, d.delivery_count) for d in again) == sorted(
        (f"{q}-{n}".encode(), count) for q in queues for n, count in (("2", 1), ("late", 0), ("0", 1)))
    for q in queues:
        assert lib.ack(q, [d.id for d in again if d.queue == q]) == 3
    assert lib.stats(queues) == [QueueStats(q, 0, 0, 0, 1) for q in queues]
    for q in queues:
        assert [d.payload for d in lib.dead_list(q)] == [f"{q}-3".encode()]
        assert node_client(client, keyspace.dead(q)).exists(keyspace.dead(q)) == 1


def test_a_blocking_wait_wakes_and_consumes_on_every_node(cluster: Target, keyspace: Keyspace) -> None:
    """A consumer blocks on the queue's wake list on the node of its slot; a publish wakes it
    (BLPOP pops the token, never the message) and consume takes the message there."""
    client = cluster.client
    lib = ScriptLibrary(client, keyspace, visibility_ms=60_000)
    for q in names_on_each_node(client, keyspace, stem="wake"):
        message_id = lib.publish(q, f"{q}-payload")
        woken = node_client(client, keyspace.wake(q)).blpop([keyspace.wake(q)], 1)
        assert woken == (keyspace.wake(q).encode(), b"1")
        assert client.zrange(keyspace.queue(q), 0, -1) == [message_id.encode()]  # never popped
        consumed = lib.consume([q], 10)
        assert [(d.id, d.payload) for d in consumed.deliveries] == [(message_id, f"{q}-payload".encode())]
        assert (consumed.wake_in_ms, consumed.expired) == (None, 0)
        assert lib.ack(q, [message_id]) == 1
        assert node_keys(client, keyspace.queue(q)) == {keyspace.meta(q).encode()}


def test_a_wake_token_taken_by_a_stopping_consumer_goes_back_on_every_node(
        cluster: Target, keyspace: Keyspace) -> None:
    """A consumer that stops right after its BLPOP took the token gives it back on its node
    (unpop), so another consumer wakes; the message never moved."""
    client = cluster.client
    lib = ScriptLibrary(client, keyspace, visibility_ms=60_000)
    for q in names_on_each_node(client, keyspace, stem="unpop"):
        message_id = lib.publish(q, f"{q}-payload")
        assert node_client(client, keyspace.wake(q)).blpop([keyspace.wake(q)], 1) is not None
        assert client.llen(keyspace.wake(q)) == 0
        assert lib.unpop(q) == 1
        assert client.lrange(keyspace.wake(q), 0, -1) == [b"1"]
        assert lib.unpop(q) == 0  # one token is enough
        [delivery] = lib.consume([q], 10).deliveries
        assert (delivery.id, delivery.delivery_count) == (message_id, 0)


def test_pipelined_calls_work_on_a_cluster(cluster: Target, keyspace: Keyspace) -> None:
    """ScriptRunner.run_many is how a transport batches publishes; it must work when the
    calls go to queues on three different nodes."""
    lib = ScriptLibrary(cluster.client, keyspace, visibility_ms=60_000)
    queues = names_on_each_node(cluster.client, keyspace, stem="pipe")
    ids = lib.run_many([lib.calls.publish(q, f"{q}-{i}") for q in queues for i in range(2)])
    assert len(ids) == 6 and all(is_message_id(i) for i in ids)
    for n, q in enumerate(queues):  # each queue has its own id sequence, on its own node
        first, second = ids[2 * n:2 * n + 2]
        assert first < second
        assert cluster.client.hget(keyspace.meta(q), "last_id") == second.encode()
    assert [s.ready for s in lib.stats(queues)] == [2, 2, 2]


def two_slots_on_one_node(client: Any, keys: Keyspace) -> tuple[str, str]:
    """Two queue names in different slots that the same node serves."""
    first = "cross0"
    node = client.get_node_from_key(keys.queue(first)).name
    for i in itertools.count(1):
        name = f"cross{i}"
        if (client.get_node_from_key(keys.queue(name)).name == node
                and keys.slot(name) != keys.slot(first)):
            return first, name
    raise AssertionError("unreachable")


def test_declared_keys_of_two_slots_are_refused(cluster: Target, keyspace: Keyspace) -> None:
    client = cluster.client
    a, b = two_slots_on_one_node(client, keyspace)
    node = node_client(client, keyspace.queue(a))
    publish = load_scripts()["publish"]
    node.script_load(publish.source)
    mixed = [keyspace.queue(a), keyspace.delayed(b), keyspace.index(a), keyspace.meta(b),
             keyspace.dead(a), keyspace.message(b), keyspace.state(a)]
    with pytest.raises(redis.exceptions.ResponseError, match=r"CROSSSLOT|same slot"):
        node.evalsha(publish.sha1, 7, *mixed, "payload", 0, "", "", 60_000)
    assert node.dbsize() == 0  # refused before anything was written


def test_shebang_makes_undeclared_keys_of_another_slot_an_error(cluster: Target, keyspace: Keyspace) -> None:
    client = cluster.client
    a, b = two_slots_on_one_node(client, keyspace)
    node = node_client(client, keyspace.queue(a))
    body = "return redis.call('EXISTS', ARGV[1])"
    with pytest.raises(redis.exceptions.ResponseError, match="do not hash to the same slot"):
        node.eval("#!lua\n" + body, 1, keyspace.queue(a), keyspace.queue(b))
    # The same body without the shebang slips through, because both slots sit on this node:
    # that is the stray access the shebang turns into an error.
    assert node.eval(body, 1, keyspace.queue(a), keyspace.queue(b)) == 0
    assert all(s.source.startswith(b"#!lua") for s in load_scripts().values())
