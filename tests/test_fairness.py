"""Fair queues (issue 39 §3): a fairness key per message; within a priority the publish
script scores a ready message of a fair queue by its key's start tag max(V, F[key]) and
consume moves the virtual clock V along what it takes, so keys with something ready take
turns and a quiet tenant is not held behind another's flood. Requeued, restored, promoted
and replayed messages of a fair queue are ready at V; a drained queue forgets its keys."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_redis_lua import Keyspace, ScriptError, ScriptLibrary
from celery_redis_lua.protocol.call import Call
from celery_redis_lua.protocol.envelope import BadEnvelope, publish_arguments
from celery_redis_lua.protocol.fairness import BadFairnessKey, checked
from helpers import server_now_ms, wait_for_server_time
from scripts.bench import fairness as bench
from scripts.servers import Server

F = 10**13
K = Keyspace()


def fair_fields(lib: ScriptLibrary, queue: str) -> dict[str, int]:
    meta = lib.client.hgetall(lib.keys.meta(queue))
    return {k.decode(): int(v) for k, v in meta.items() if k == b"fair" or k.startswith(b"fair:")}


def time_part(lib: ScriptLibrary, queue: str, message_id: str) -> int:
    score = lib.client.zscore(lib.keys.queue(queue), message_id)
    assert score is not None, f"{message_id} is not ready"
    return int(score) % F


def test_keys_take_turns_and_a_drained_queue_forgets_them(lib: ScriptLibrary) -> None:
    """t1 sends three, then t2 one and an unkeyed one (the key ''): all three keys start at
    V, t1's later ones after; once nothing is ready, the 'fair' fields are gone."""
    t0 = server_now_ms(lib.client)
    for n in range(3):
        lib.publish("q", f"t1-{n}", fairness_key="t1")
    lib.publish("q", "t2-0", fairness_key="t2")
    lib.publish("q", "plain")
    fields = fair_fields(lib, "q")
    v = fields["fair"]
    assert t0 <= v <= server_now_ms(lib.client)
    assert fields == {"fair": v, "fair:t1": v + 3, "fair:t2": v + 1, "fair:": v + 1}
    taken = lib.consume(["q"], 10).deliveries
    assert [d.payload for d in taken] == [b"t1-0", b"t2-0", b"plain", b"t1-1", b"t1-2"]
    assert fair_fields(lib, "q") == {}  # drained: the next key starts afresh at now
    assert lib.ack("q", [d.id for d in taken]) == 5


def test_the_virtual_clock_follows_what_consume_takes(lib: ScriptLibrary) -> None:
    """A quiet key arriving after a flood's first deliveries starts where consume is, not
    behind the flood's later tags, and not ahead of what was taken."""
    flood = [lib.publish("q", f"flood-{n}", fairness_key="flood") for n in range(6)]
    v = fair_fields(lib, "q")["fair"]
    assert [time_part(lib, "q", i) for i in flood] == [v + n for n in range(6)]
    assert [d.payload for d in lib.consume(["q"], 3).deliveries] == [b"flood-0", b"flood-1", b"flood-2"]
    assert fair_fields(lib, "q")["fair"] == v + 2
    quiet = lib.publish("q", "quiet", fairness_key="quiet")
    assert time_part(lib, "q", quiet) == v + 2
    assert [d.payload for d in lib.consume(["q"], 2).deliveries] == [b"quiet", b"flood-3"]


def test_what_becomes_ready_again_starts_at_the_virtual_clock(standalone: redis.Redis) -> None:
    """Requeued (reject), restored (the sweep), promoted (a countdown) and replayed messages of
    a fair queue are ready at V, not at now (which a lagging V would put behind every key)."""
    lib = ScriptLibrary(standalone, K, visibility_ms=60_000)
    lib.declare("q")
    backlog = [lib.publish("q", f"b-{n}", fairness_key="b") for n in range(5)]
    eta = server_now_ms(standalone) + 20
    countdown = lib.publish("q", "countdown", eta_ms=eta, fairness_key="c")
    first = lib.consume(["q"], 2).deliveries
    v = fair_fields(lib, "q")["fair"]
    assert v == time_part(lib, "q", backlog[2]) - 1
    lib.reject("q", [first[0].id], requeue=True)
    assert time_part(lib, "q", first[0].id) == v
    short = lib.with_policy(visibility_ms=1)
    assert short.extend("q", [first[1].id]) == 1
    wait_for_server_time(standalone, max(eta, server_now_ms(standalone) + 2))
    lib.sweep(["q"])  # restores the lapsed one and promotes the countdown, both at V
    assert time_part(lib, "q", first[1].id) == v
    assert time_part(lib, "q", countdown) == v
    lib.reject("q", [d.id for d in lib.consume(["q"], 1).deliveries], requeue=False)  # dead-lettered
    assert [str(i) for i in lib.dead_replay("q", count=1)] and len(lib.dead_list("q")) == 0
    replayed = [i.decode() for i in standalone.zrange(lib.keys.queue("q"), 0, -1)
                if i.decode() not in {*backlog, countdown}]
    assert [time_part(lib, "q", i) for i in replayed] == [fair_fields(lib, "q")["fair"]]


def test_priorities_still_go_first_in_a_fair_queue(lib: ScriptLibrary) -> None:
    """Fairness orders within a priority: the flood's priority-9 messages go before a quiet
    key's priority 0, and the quiet key's priority 9 before the flood's third. The keys' state
    is per queue, not per priority: the quiet key's priority-0 message took tag V, so its
    priority-9 one starts at V + 1, tied with the flood's second (which has the smaller id)."""
    for n in range(3):
        lib.publish("q", f"flood-9-{n}", priority=9, fairness_key="flood")
    lib.publish("q", "quiet-0", fairness_key="quiet")
    lib.publish("q", "quiet-9", priority=9, fairness_key="quiet")
    taken = [d.payload for d in lib.consume(["q"], 5).deliveries]
    assert taken == [b"flood-9-0", b"flood-9-1", b"quiet-9", b"flood-9-2", b"quiet-0"]


def test_a_queue_without_keys_stays_as_it_was(lib: ScriptLibrary) -> None:
    """No key ever: no 'fair' field, scores by the clock, consume as before."""
    t0 = server_now_ms(lib.client)
    ids = [lib.publish("q", f"m{n}") for n in range(3)]
    t1 = server_now_ms(lib.client)
    assert all(t0 <= time_part(lib, "q", i) <= t1 for i in ids)
    assert fair_fields(lib, "q") == {}
    assert [d.payload for d in lib.consume(["q"], 3).deliveries] == [b"m0", b"m1", b"m2"]


def test_a_bad_key_is_refused_by_name_and_nothing_is_written(standalone: redis.Redis) -> None:
    lib = ScriptLibrary(standalone, K, visibility_ms=60_000)
    with pytest.raises(ScriptError, match="fairness_key must be at most 256 bytes, got 257"):
        args = ["{}", 0, "", "", 60_000, "", "", "", "", "", "", "k" * 257]
        lib.runner.run(Call("publish", K.queue_keys("q"), args, str))
    assert standalone.keys() == []
    for key in ("", "k" * 257):  # the Python layer refuses an empty key too: None says "no key"
        with pytest.raises(BadFairnessKey, match=r"1\.\.256 bytes"):
            lib.publish("q", "x", fairness_key=key)
    assert standalone.keys() == []


def test_an_empty_key_argument_means_none_as_in_a_batch(standalone: redis.Redis) -> None:
    """Publish 14: ARGV 12 '' is no key (as an empty task id is no task id), so that a batch's
    messages share one 12-argument layout whether or not they have a key."""
    lib = ScriptLibrary(standalone, K, visibility_ms=60_000)
    args = ["{}", 0, "", "", 60_000, "", "", "", "", "", "", ""]
    message_id = lib.runner.run(Call("publish", K.queue_keys("q"), args, lambda reply: reply.decode()))
    assert fair_fields(lib, "q") == {}
    assert lib.consume(["q"], 1).deliveries[0].id == message_id


def test_an_envelope_names_its_key_by_header_or_by_the_task_option() -> None:
    message: dict[str, Any] = {"headers": {"id": "tid", "task": "tasks.add"}, "properties": {}}
    assert publish_arguments(message, None).fairness_key is None
    assert publish_arguments({**message, "properties": {"fairness_key": "tenant-42"}}, None).fairness_key \
        == "tenant-42"
    headed = {**message, "headers": {**message["headers"], "x-fairness-key": "h"},
              "properties": {"fairness_key": "option"}}
    assert publish_arguments(headed, None).fairness_key == "h"  # the header wins
    with pytest.raises(BadEnvelope, match=r"task option 'fairness_key' must be a string of 1\.\.256 bytes"):
        publish_arguments({**message, "properties": {"fairness_key": 42}}, None)
    with pytest.raises(BadEnvelope, match="header 'x-fairness-key'"):
        publish_arguments({**message, "headers": {"x-fairness-key": "é" * 129}}, None)
    assert checked("é" * 128) == "é" * 128  # 256 bytes


# -- the flood ---------------------------------------------------------------------------------


def test_a_flood_does_not_hold_back_the_quiet_tenants(valkey_server: Server) -> None:
    """5,000 of one tenant (100 per consume step) and 9 x 20 quiet ones spread over the drain,
    a worker taking 10 per step: with keys the quiet p99 wait is within 2x of theirs with no
    flood; without keys they wait behind the flood (hundreds of steps)."""
    with valkey_server.client(socket_timeout=60) as client:
        results = bench.compare(client, flood=5000, per_quiet=20)
    alone, today, fair = (results[n]["p99"] for n in ("no flood", "flood, no keys", "flood, keys"))
    assert fair <= 2 * alone, results
    assert today > 50 * alone, results


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_a_flood_of_100_000_does_not_hold_back_the_quiet_tenants(kind: str,
                                                                 request: pytest.FixtureRequest) -> None:
    """The issue's figure: 100,000 of one tenant and 9 x 100 quiet (python -m scripts.bench.fairness)."""
    server: Server = request.getfixturevalue(f"{kind}_server")
    with server.client(socket_timeout=60) as client:
        results = bench.compare(client, flood=100_000, per_quiet=100)
    alone, fair = results["no flood"]["p99"], results["flood, keys"]["p99"]
    assert fair <= 2 * alone, results
    assert results["flood, no keys"]["p99"] > 100 * alone, results
