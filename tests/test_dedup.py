"""Deduplication at publish (issue 39 §1): simple, throttle and debounce, held in the queue's
state hash by the publish script and released by whatever settles the holder; the reply,
the INFO line and the counter say which message kept the place; 16 producer processes at
once on a server and on a cluster."""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
from contextlib import closing
from typing import Any

import pytest
import redis

from celery_redis_lua import Dedup, Keyspace, Policy, Published, ScriptError, ScriptLibrary
from celery_redis_lua.protocol.call import Call
from celery_redis_lua.protocol.dedup import BadDedup, from_envelope
from conftest import Target
from helpers import server_now_ms, wait_for_server_time, wait_until
from scripts.servers import Cluster, Server

K = Keyspace()


def stored(lib: ScriptLibrary, queue: str) -> dict[str, bytes]:
    return {k.decode(): v for k, v in lib.client.hgetall(lib.keys.message(queue)).items()}


def holds(lib: ScriptLibrary, queue: str) -> dict[str, str]:
    """The dedup holds of a queue: field -> 'HOLDER UNTIL MODE ID'."""
    return {k.decode(): v.decode() for k, v in lib.client.hgetall(lib.keys.state(queue)).items()
            if k.startswith(b"dedup:")}


def test_simple_drops_a_second_message_while_the_first_waits_or_runs(
        lib: ScriptLibrary, caplog: pytest.LogCaptureFixture) -> None:
    first = lib.publish("q", "one", dedup=Dedup("report:42"))
    assert isinstance(first, Published) and not first.deduplicated and first.replaced is None
    with caplog.at_level(logging.INFO, logger="celery_redis_lua"):
        again = lib.publish("q", "two", dedup=Dedup("report:42"))
    assert (again, again.deduplicated) == (first, True)  # the holder's id: nothing stored
    assert "dedup id 'report:42' was dropped (simple): message " + first in caplog.text
    assert stored(lib, "q") == {first: b"one"}
    other = lib.publish("q", "other", dedup=Dedup("report:43"))  # another id: stored
    delivered = lib.consume(["q"], 2).deliveries
    assert [d.id for d in delivered] == [first, other]
    assert lib.publish("q", "three", dedup=Dedup("report:42")).deduplicated  # it runs: still held
    assert lib.ack("q", [first]) == 1
    after = lib.publish("q", "four", dedup=Dedup("report:42"))  # acked: the hold went with it
    assert not after.deduplicated and after > first
    assert int(lib.client.hget(lib.keys.meta("q"), "deduplicated:simple")) == 2
    assert lib.metrics(["q"])[0].deduplicated == {"simple": 2}


@pytest.mark.parametrize("settle", ["reject", "cancel", "purge", "sweep", "expired"])
def test_every_way_a_holder_goes_releases_its_hold(standalone: redis.Redis, settle: str) -> None:
    lib = ScriptLibrary(standalone, K, Policy(visibility_ms=60_000, delivery_limit=1))
    held = lib.publish("q", json.dumps({"headers": {"id": "t1"}}), task_id="t1", dedup=Dedup("d"),
                       ttl_ms=1 if settle == "expired" else None)
    if settle == "reject":
        lib.consume(["q"], 1)
        lib.reject("q", [held], requeue=False)
    elif settle == "cancel":
        lib.cancel("q", "t1")
    elif settle == "purge":
        lib.purge("q")
    elif settle == "sweep":  # its delivery lapsed at the delivery limit: dead-lettered
        lib.with_policy(visibility_ms=1).consume(["q"], 1)
        wait_for_server_time(standalone, server_now_ms(standalone) + 2)
        lib.sweep(["q"])
    else:  # its TTL passed: consume dead-letters it
        wait_for_server_time(standalone, server_now_ms(standalone) + 2)
        assert lib.consume(["q"], 1).expired == 1
    assert holds(lib, "q") == {}
    assert not lib.publish("q", "next", dedup=Dedup("d")).deduplicated


def test_throttle_drops_for_its_ttl_after_the_first_whatever_became_of_it(standalone: redis.Redis) -> None:
    lib = ScriptLibrary(standalone, K, visibility_ms=60_000)
    first = lib.publish("q", "one", dedup=Dedup("ping", "throttle", 200))
    lib.consume(["q"], 1)
    assert lib.ack("q", [first]) == 1  # done: the window stays
    assert lib.publish("q", "two", dedup=Dedup("ping", "throttle", 200)) == first
    assert stored(lib, "q") == {}
    wait_until(lambda: not lib.publish("q", "three", dedup=Dedup("ping", "throttle", 200)).deduplicated,
               timeout=5, interval=0.02)
    assert list(stored(lib, "q").values()) == [b"three"]
    # The sweep ends a window that nobody published into again: no hold is left behind.
    lib.purge("q")
    wait_for_server_time(standalone, server_now_ms(standalone) + 210)
    lib.sweep(["q"])
    assert holds(lib, "q") == {}
    assert set(standalone.keys()) == {b"meta:{q}"}


def test_debounce_keeps_the_newest_of_those_waiting(standalone: redis.Redis) -> None:
    lib = ScriptLibrary(standalone, K, visibility_ms=60_000)
    eta = server_now_ms(standalone) + 60_000
    first = lib.publish("q", "v1", eta_ms=eta, dedup=Dedup("index", "debounce"))
    second = lib.publish("q", "v2", dedup=Dedup("index", "debounce"))  # replaces the countdown
    assert (second.replaced, second.deduplicated) == (first, False)
    assert stored(lib, "q") == {second: b"v2"}
    assert standalone.zcard(K.delayed("q")) == 0 and standalone.zcard(K.queue("q")) == 1
    delivered = lib.consume(["q"], 1).deliveries
    third = lib.publish("q", "v3", dedup=Dedup("index", "debounce"))  # v2 runs: v3 waits behind it
    assert third.replaced is None
    fourth = lib.publish("q", "v4", dedup=Dedup("index", "debounce"))
    assert fourth.replaced == third
    assert lib.ack("q", [delivered[0].id]) == 1  # v2's ack leaves v4's hold alone
    assert list(holds(lib, "q").values()) == [f"{fourth} - debounce index"]
    assert int(standalone.hget(K.meta("q"), "deduplicated:debounce")) == 2


def test_debounce_replaces_a_retry_waiting_message_and_keeps_retrying_right(standalone: redis.Redis) -> None:
    from celery_redis_lua.protocol.retry import DelayedRetry
    lib = ScriptLibrary(standalone, K, visibility_ms=60_000)
    lib.declare("q", retry=DelayedRetry("all", 60_000, 60_000))
    first = lib.publish("q", "v1", task_id="t1", dedup=Dedup("x", "debounce"))
    lib.consume(["q"], 1)
    lib.reject("q", [first], requeue=True)  # waits a minute for its retry
    assert int(standalone.hget(K.meta("q"), "retrying")) == 1
    second = lib.publish("q", "v2", dedup=Dedup("x", "debounce"))
    assert second.replaced == first
    assert int(standalone.hget(K.meta("q"), "retrying")) == 0
    assert not standalone.hexists(K.state("q"), "task:t1")  # the replaced message's index went


@pytest.mark.parametrize(("args", "error"), [
    (["", "simple", ""], "dedup_id must be 1..512 bytes, got 0"),
    (["x" * 513, "simple", ""], "dedup_id must be 1..512 bytes, got 513"),
    (["d", "once", ""], "dedup_mode must be simple, throttle or debounce, got 'once'"),
    (["d", "simple", "0"], "dedup_ttl_ms must be an integer in 1..315360000000 or '', got '0'"),
    (["d", "simple", "1.5"], "dedup_ttl_ms must be an integer in 1..315360000000 or '', got '1.5'"),
    (["d", "throttle", ""], "dedup_ttl_ms is required with dedup_mode throttle"),
])
def test_a_bad_dedup_argument_is_refused_by_name_and_nothing_is_written(standalone: redis.Redis,
                                                                        args: list[str], error: str) -> None:
    lib = ScriptLibrary(standalone, K, visibility_ms=60_000)
    keys = K.queue_keys("q")
    with pytest.raises(ScriptError, match=error):
        lib.runner.run(Call("publish", keys, ["{}", 0, "", "", 60_000, "", "", "", *args], str))
    assert standalone.keys() == []


def test_the_python_side_refuses_bad_settings_before_any_call() -> None:
    with pytest.raises(BadDedup, match="needs a ttl"):
        Dedup("x", "throttle")
    with pytest.raises(BadDedup, match="mode must be one of"):
        Dedup("x", "once")
    with pytest.raises(BadDedup, match=r"1\.\.512 bytes"):
        Dedup("")


def test_an_envelope_names_its_dedup_by_header_or_by_the_task_option() -> None:
    body = json.dumps([[1, 2], {"b": 1, "a": 2}, {}])
    message = {"body": body, "content-type": "application/json",
               "headers": {"id": "tid", "task": "tasks.add"}, "properties": {}}
    assert from_envelope(message) is None
    with pytest.raises(BadDedup, match="needs a ttl"):
        from_envelope({**message, "properties": {"dedup": "throttle"}})
    simple = from_envelope({**message, "properties": {"dedup": True}})
    reordered = json.dumps([[1, 2], {"a": 2, "b": 1}, {"callbacks": None}])
    assert simple == from_envelope({**message, "body": reordered, "properties": {"dedup": "simple"}})
    assert simple is not None and simple.id.startswith("tasks.add:") and simple.mode == "simple"
    option = {"key": "task_id", "mode": "throttle", "ttl": 1.5}
    assert from_envelope({**message, "properties": {"dedup": option}}) == Dedup("tid", "throttle", 1500)
    assert from_envelope({**message, "headers": {**message["headers"], "x-dedup-id": "mine",
                                                 "x-dedup-mode": "debounce", "x-dedup-ttl": 30_000}}) \
        == Dedup("mine", "debounce", 30_000)
    with pytest.raises(BadDedup, match="give one"):
        from_envelope({**message, "properties": {"dedup": {"id": "a", "key": "args"}}})
    with pytest.raises(BadDedup, match="'x-dedup-ttl' must be an integer of ms"):
        from_envelope({**message, "headers": {"x-dedup-id": "a", "x-dedup-ttl": "soon"}})
    with pytest.raises(BadDedup, match="task option 'dedup'"):
        from_envelope({**message, "properties": {"dedup": {"mode": "simple", "window": 3}}})


# -- 16 producer processes at once ---------------------------------------------------------------

PRODUCERS, EACH = 16, 1000


def _produce(address: tuple[str, int], cluster: bool, mode: str, ttl_ms: int | None, who: int) -> list[Any]:
    """One producer process: EACH publishes of one dedup id, each reply (id, flags)."""
    client: Any = (redis.RedisCluster(host=address[0], port=address[1]) if cluster
                   else redis.Redis(host=address[0], port=address[1]))
    with closing(client):
        lib = ScriptLibrary(client, K, visibility_ms=60_000)
        replies = []
        for n in range(EACH):
            reply = lib.publish("hot", f"{who}-{n}", dedup=Dedup("same", mode, ttl_ms))
            replies.append((str(reply), reply.deduplicated, reply.replaced, f"{who}-{n}"))
        return replies


def run_producers(address: tuple[str, int], cluster: bool, mode: str, ttl_ms: int | None) -> list[Any]:
    with multiprocessing.get_context("fork").Pool(PRODUCERS) as pool:
        results = pool.starmap(_produce, [(address, cluster, mode, ttl_ms, who) for who in range(PRODUCERS)])
    return [reply for replies in results for reply in replies]


def address_of(target: Server | Cluster) -> tuple[tuple[str, int], bool]:
    if isinstance(target, Cluster):
        return ("127.0.0.1", target.nodes[0].port), True
    return ("127.0.0.1", target.port), False


@pytest.fixture
def hot(request: pytest.FixtureRequest) -> Any:
    """A flushed Valkey, or Valkey cluster (the parameter)."""
    from conftest import make_target
    target: Target = make_target(request, request.param)
    target.flush()
    yield target
    target.client.close()


# The simple run on a cluster is in make test, the throttle and debounce runs there in make
# test-all (CI time).
BOTH = pytest.mark.parametrize("hot", ["valkey", "valkey-cluster"], indirect=True)
ONE = pytest.mark.parametrize("hot", ["valkey", pytest.param("valkey-cluster", marks=pytest.mark.slow)],
                              indirect=True)


@BOTH
def test_sixteen_producers_at_once_simple_stores_exactly_one(hot: Target) -> None:
    replies = run_producers(*address_of(hot.server), "simple", None)
    lib = ScriptLibrary(hot.client, K)
    kept = [r for r in replies if not r[1]]
    assert len(kept) == 1, f"{len(kept)} stored of {len(replies)}"
    assert {r[0] for r in replies} == {kept[0][0]}  # every dropped one names the one kept
    assert stored(lib, "hot") == {kept[0][0]: kept[0][3].encode()}
    assert int(hot.client.hget(K.meta("hot"), "deduplicated:simple")) == PRODUCERS * EACH - 1


@ONE
def test_sixteen_producers_at_once_throttle_stores_one_per_window(hot: Target) -> None:
    ttl = 100
    replies = run_producers(*address_of(hot.server), "throttle", ttl)
    kept = sorted(r[0] for r in replies if not r[1])
    stored_at = [int(i[:13], 16) // 1000 for i in kept]  # an id is server microseconds, then a counter
    gaps = [b - a for a, b in itertools.pairwise(stored_at)]
    assert len(kept) > 1 and all(gap >= ttl for gap in gaps), gaps  # never two in one window
    assert {r[0] for r in replies} == set(kept)  # every dropped one names a window's message
    assert all(gap < 2 * ttl for gap in gaps), gaps  # and the next window began as this one ended
    lib = ScriptLibrary(hot.client, K)
    assert sorted(stored(lib, "hot")) == kept


@ONE
def test_sixteen_producers_at_once_debounce_keeps_the_last(hot: Target) -> None:
    replies = run_producers(*address_of(hot.server), "debounce", None)
    lib = ScriptLibrary(hot.client, K)
    newest = max(replies, key=lambda r: r[0])  # ids grow with the server's clock: the last run
    assert stored(lib, "hot") == {newest[0]: newest[3].encode()}
    replaced = [r[2] for r in replies if r[2] is not None]
    assert len(replaced) == PRODUCERS * EACH - 1 == len(set(replaced))  # each one replaced once
    assert int(hot.client.hget(K.meta("hot"), "deduplicated:debounce")) == PRODUCERS * EACH - 1
