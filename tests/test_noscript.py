"""Scripts are a cache, not state: every call path recovers from NOSCRIPT.

After SCRIPT FLUSH (single call and pipeline), after a server restart (same
client, reconnect), on one flushed cluster node, and in a cluster pipeline
where only some calls meet a flushed node. Pipelines re-run only the calls that
failed with NOSCRIPT: a re-run of a call that already ran would publish a
message twice, so the tests count exactly what landed in the queues, and check that the
ids each call returned are the last ones the queue issued (meta's ``last_id``): a hidden
second run would have issued one more.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redis_lua import Call, Keyspace, ScriptError, ScriptLibrary
from celery_redis_lua.protocol.contract import load_scripts
from conftest import require_kind as require
from helpers import is_message_id, names_on_each_node
from scripts.servers import Server

SHA = {name: script.sha1 for name, script in load_scripts().items()}


def loaded(client: Any, name: str, node: Any = None) -> bool:
    """Whether the server (or the given cluster node) has script ``name`` cached."""
    if node is not None:
        client = client.get_redis_connection(node)
    return bool(client.script_exists(SHA[name])[0])


def publish_call(lib: ScriptLibrary, queue: str, payload: str, priority: int | str = 0) -> Call[str]:
    return lib.calls.publish(queue, payload, priority=priority)


def drain(lib: ScriptLibrary, queue: str) -> list[bytes]:
    return [d.payload for d in lib.consume([queue], 100).deliveries]


def issued_once(lib: ScriptLibrary, queue: str, ids: list[str], after: str | None = None) -> None:
    """``ids`` (in call order) are valid message ids, strictly increasing and above
    ``after``, and the queue issued no id after the last of them: every call ran once."""
    assert all(is_message_id(i) for i in ids), ids
    chain = ([after] if after else []) + ids
    assert chain == sorted(set(chain)), chain
    assert lib.client.hget(lib.keys.meta(queue), "last_id") == ids[-1].encode()


# --- SCRIPT FLUSH, every server kind ----------------------------------------------------------


def test_single_call_recovers_after_script_flush(lib: ScriptLibrary, target: Any) -> None:
    first = lib.publish("nsq", "before")
    assert loaded(target.client, "publish")
    target.client.script_flush()
    assert not loaded(target.client, "publish")

    second = lib.publish("nsq", "after")

    assert loaded(target.client, "publish")
    issued_once(lib, "nsq", [second], after=first)  # ran exactly once
    assert drain(lib, "nsq") == [b"before", b"after"]


def test_run_many_after_flush_runs_each_call_exactly_once(lib: ScriptLibrary, target: Any) -> None:
    warm_up = lib.publish("nsq", "warm-up")  # publish is cached now
    target.client.script_flush()

    ids = lib.run_many([publish_call(lib, "nsq", f"m{i}") for i in range(3)])

    issued_once(lib, "nsq", ids, after=warm_up)
    assert lib.size("nsq") == 4  # warm-up + exactly 3, not 6
    assert drain(lib, "nsq") == [b"warm-up", b"m0", b"m1", b"m2"]


def test_run_many_reruns_only_the_calls_that_met_noscript(lib: ScriptLibrary, target: Any) -> None:
    """publish is cached, size is not: only size is re-run, after every publish ran once."""
    target.client.script_flush()
    lib.runner.load(["publish"])
    assert not loaded(target.client, "size")
    batch = [
        publish_call(lib, "nsq", "a"),
        lib.calls.size("nsq"),
        publish_call(lib, "nsq", "b"),
        publish_call(lib, "nsq", "c"),
    ]

    first, size, second, third = lib.run_many(batch)

    assert size == 3  # the re-run of size saw all three publishes, each once
    issued_once(lib, "nsq", [first, second, third])
    assert lib.size("nsq") == 3
    assert drain(lib, "nsq") == [b"a", b"b", b"c"]


# --- script errors inside a pipeline ------------------------------------------------------------


def test_script_error_in_run_many_is_raised_and_the_other_calls_still_ran(lib: ScriptLibrary) -> None:
    batch = [publish_call(lib, "nsq", "ok1"), publish_call(lib, "nsq", "bad", priority="high"),
             publish_call(lib, "nsq", "ok2")]

    with pytest.raises(ScriptError) as raised:
        lib.run_many(batch)  # scripts were flushed by the fixture: NOSCRIPT first, then the error

    assert raised.value.script == "publish"
    assert str(raised.value) == "celery-redis-lua: publish: priority must be an integer in 0..255, got 'high'"
    # A pipeline is not a transaction: the good calls ran, once each.
    assert drain(lib, "nsq") == [b"ok1", b"ok2"]


def test_script_error_in_run_many_is_returned_in_place(lib: ScriptLibrary, target: Any) -> None:
    seed = lib.publish("nsq", "seed")
    target.client.script_flush()
    batch = [publish_call(lib, "nsq", "ok1"), publish_call(lib, "nsq", "", priority=1),
             lib.calls.size("nsq"), publish_call(lib, "nsq", "ok2")]

    first, error, size, second = lib.run_many(batch, raise_on_error=False)

    assert isinstance(error, ScriptError)
    assert "publish: payload is missing or empty" in str(error)
    assert size == 2  # seed + ok1; the bad call wrote nothing
    issued_once(lib, "nsq", [first, second], after=seed)
    # No message (payload or state) of the failed call: only the three good ones are stored.
    assert sorted(lib.client.hkeys(lib.keys.state("nsq"))) == [i.encode() for i in (seed, first, second)]
    assert lib.client.hlen(lib.keys.message("nsq")) == 3
    assert drain(lib, "nsq") == [b"seed", b"ok1", b"ok2"]


# --- server restart ---------------------------------------------------------------------------


@pytest.fixture(params=["valkey", "redis"])
def own_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    require(request.param)
    with Server(request.param) as server:
        yield server


def test_same_client_recovers_after_a_restart(own_server: Server) -> None:
    client = own_server.client(socket_timeout=5)
    lib = ScriptLibrary(client, Keyspace("r:"), visibility_ms=60_000)
    before = lib.publish("rq", "before restart")
    assert loaded(client, "publish")

    own_server.restart()  # no persistence: data and script cache are gone
    probe = own_server.client()
    assert not loaded(probe, "publish")
    assert probe.dbsize() == 0

    message_id = lib.publish("rq", "after restart")  # the same client: reconnect + NOSCRIPT
    # The data (and meta's last_id) is gone, but ids follow the server's clock: the new
    # queue's first id is still above every id issued before the restart.
    issued_once(lib, "rq", [message_id], after=before)
    assert loaded(probe, "publish")
    assert drain(lib, "rq") == [b"after restart"]

    own_server.restart()
    ids = lib.run_many([publish_call(lib, "rq", f"p{i}") for i in range(3)])  # pipeline path
    issued_once(lib, "rq", ids, after=message_id)
    assert drain(lib, "rq") == [b"p0", b"p1", b"p2"]
    probe.close()
    client.close()


# --- cluster: one node flushed ------------------------------------------------------------------


@pytest.fixture(params=["valkey", "redis"])
def cluster_lib(request: pytest.FixtureRequest) -> Iterator[ScriptLibrary]:
    cluster = request.getfixturevalue(f"{request.param}_cluster")
    client = cluster.client(socket_timeout=10)
    client.flushall()
    client.script_flush()
    yield ScriptLibrary(client, Keyspace("c:"), visibility_ms=60_000)
    client.close()


def flush_node_of(lib: ScriptLibrary, queue: str) -> Any:
    """SCRIPT FLUSH on the primary that holds ``queue`` only; returns that node."""
    client: redis.cluster.RedisCluster = lib.client
    node = client.get_node_from_key(lib.keys.queue(queue))
    client.get_redis_connection(node).script_flush()
    return node


def test_cluster_call_routed_to_a_flushed_node_recovers(cluster_lib: ScriptLibrary) -> None:
    lib, client = cluster_lib, cluster_lib.client
    queues = names_on_each_node(client, lib.keys)
    first = {queue: lib.publish(queue, f"{queue}-1") for queue in queues}
    flushed = flush_node_of(lib, queues[1])
    others = [client.get_node_from_key(lib.keys.queue(q)) for q in (queues[0], queues[2])]
    assert not loaded(client, "publish", flushed)
    assert all(loaded(client, "publish", node) for node in others)

    message_id = lib.publish(queues[1], f"{queues[1]}-2")

    issued_once(lib, queues[1], [message_id], after=first[queues[1]])
    assert loaded(client, "publish", flushed)
    assert drain(lib, queues[1]) == [f"{queues[1]}-1".encode(), f"{queues[1]}-2".encode()]


def test_cluster_pipeline_with_some_calls_on_a_flushed_node(cluster_lib: ScriptLibrary) -> None:
    lib, client = cluster_lib, cluster_lib.client
    queues = names_on_each_node(client, lib.keys)
    seeds = {}
    for queue in queues:
        seeds[queue] = lib.publish(queue, "seed")
        lib.size(queue)
    flushed = flush_node_of(lib, queues[2])
    assert not loaded(client, "publish", flushed)

    batch = [publish_call(lib, q, f"{q}-{i}") for i in range(3) for q in queues]
    batch += [lib.calls.size(q) for q in queues]
    replies = lib.run_many(batch)

    assert replies[-3:] == [4, 4, 4]  # seed + 3 on every node, nothing twice
    published = list(zip(batch[:9], replies[:9], strict=True))
    by_queue = {q: [r for c, r in published if c.keys[0] == lib.keys.queue(q)] for q in queues}
    for queue, ids in by_queue.items():
        assert len(ids) == 3, by_queue
        issued_once(lib, queue, ids, after=seeds[queue])
    for queue in queues:
        assert drain(lib, queue) == [b"seed", *(f"{queue}-{i}".encode() for i in range(3))]
    assert loaded(client, "publish", flushed)


def test_cluster_pipeline_error_on_flushed_node_returned_in_place(cluster_lib: ScriptLibrary) -> None:
    lib, client = cluster_lib, cluster_lib.client
    queues = names_on_each_node(client, lib.keys)
    seeds = {queue: lib.publish(queue, "seed") for queue in queues}
    flush_node_of(lib, queues[0])

    batch = [publish_call(lib, queues[0], "bad", priority=256), publish_call(lib, queues[0], "ok"),
             publish_call(lib, queues[1], "ok")]
    error, first, second = lib.run_many(batch, raise_on_error=False)

    assert isinstance(error, ScriptError)
    assert "priority must be an integer in 0..255, got '256'" in str(error)
    issued_once(lib, queues[0], [first], after=seeds[queues[0]])
    issued_once(lib, queues[1], [second], after=seeds[queues[1]])
    assert drain(lib, queues[0]) == [b"seed", b"ok"]
    assert drain(lib, queues[1]) == [b"seed", b"ok"]
