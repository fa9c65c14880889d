"""Message TTL and queue expiry.

Message TTL is a deadline in the message's state (``expires_at``), counted while the
message waits: from publish, or from its ETA when it is delayed; not while it is in
flight. A message whose deadline passed is dead-lettered with reason 'expired' instead of
delivered (consume, claim), or by the sweep when its index entry falls due. Queue expiry
(RabbitMQ's x-expires) is a PEXPIRE on all eight keys of the queue at once, messages
included, refreshed by publish, declare, consume, claim, extend, reject and the sweep,
floored at 10 s. Ids follow the server's clock, so a queue declared again under the same
name never reuses one.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_redis_lua import Keyspace, Policy, ScriptError, ScriptLibrary
from conftest import require_kind
from helpers import (
    is_message_id,
    message_exists,
    message_state,
    server_now_ms,
    wait_for_server_time,
    wait_until,
)
from scripts.servers import Server

MIN_EXPIRES_MS = 10_000


def pttls(client: Any, names: list[str]) -> list[int]:
    return [int(client.pttl(name)) for name in names]


def expires_at(lib: ScriptLibrary, queue: str, message_id: str) -> int | None:
    state = message_state(lib.client, lib.keys, queue, message_id)
    assert state is not None, f"{message_id} is not in {queue}"
    return None if state[3] == "-" else int(state[3])


def dead_reasons(lib: ScriptLibrary, queue: str) -> list[tuple[str, str]]:
    return [(d.id, d.reason) for d in lib.dead_list(queue)]


def test_an_expired_message_is_dead_lettered_and_the_next_one_delivered(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    before = server_now_ms(client)
    doomed = lib.publish("ttl", "doomed", ttl_ms=150)
    live = lib.publish("ttl", "live")
    deadline = expires_at(lib, "ttl", doomed)
    assert deadline is not None and before + 150 <= deadline <= server_now_ms(client) + 150
    assert expires_at(lib, "ttl", live) is None
    # The sweep looks at a ready message at its TTL deadline at the latest.
    assert int(client.zscore(keys.index("ttl"), doomed)) == deadline

    wait_for_server_time(client, deadline + 1)
    assert client.zrange(keys.queue("ttl"), 0, 0) == [doomed.encode()]  # first in line
    consumed = lib.consume(["ttl"], 1)
    assert [(d.id, d.payload) for d in consumed.deliveries] == [(live, b"live")]
    assert consumed.expired == 1
    assert dead_reasons(lib, "ttl") == [(doomed, "expired")]
    assert lib.dead_list("ttl")[0].payload == b"doomed"
    assert not message_exists(client, keys, "ttl", doomed)
    assert client.zscore(keys.index("ttl"), doomed) is None
    assert lib.size("ttl") == 0


def test_the_sweep_dead_letters_a_message_that_expires_unconsumed(lib: ScriptLibrary) -> None:
    """Nobody consumes: the index entry falls due at the TTL and the sweep takes the
    message out, reported with its reason, instead of keeping it forever."""
    doomed = lib.publish("idle", "doomed", ttl_ms=100, priority=4)
    keeper = lib.publish("idle", "keeper")
    wait_for_server_time(lib.client, expires_at(lib, "idle", doomed) + 1)
    report = lib.sweep(["idle"])
    assert (report.expired, report.limit_reached, report.backlog) == (1, 0, 0)
    assert [(d.id, d.reason, d.payload) for d in report.dropped_messages] == [(doomed, "expired", b"doomed")]
    assert dead_reasons(lib, "idle") == [(doomed, "expired")]
    assert lib.dead_list("idle")[0].priority == 4
    assert [s.ready for s in lib.stats(["idle"])] == [1]
    assert lib.consume(["idle"], 5).deliveries[0].id == keeper


def test_without_dead_letters_an_expired_message_is_deleted(target: Any, keyspace: Keyspace) -> None:
    lib = ScriptLibrary(target.client, keyspace, Policy(visibility_ms=60_000, dead_letter_maxlen=0))
    doomed = lib.publish("gone", "doomed", ttl_ms=50)
    wait_for_server_time(lib.client, expires_at(lib, "gone", doomed) + 1)
    consumed = lib.consume(["gone"], 1)
    assert (consumed.deliveries, consumed.expired) == ([], 1)
    assert lib.dead_list("gone") == []
    assert target.keys() == {keyspace.meta("gone").encode()}


def test_a_delayed_message_s_ttl_counts_from_its_eta(lib: ScriptLibrary) -> None:
    """Found by a user: a countdown longer than message_ttl never ran (the TTL ran from
    publish). Now it counts from the ETA: the message is delivered at its ETA."""
    client = lib.client
    eta = server_now_ms(client) + 300
    message_id = lib.publish("later", "countdown", eta_ms=eta, ttl_ms=200)
    assert client.zscore(lib.keys.delayed("later"), message_id) == eta
    assert expires_at(lib, "later", message_id) == eta + 200
    wait_for_server_time(client, eta + 10)  # past publish + TTL, within ETA + TTL
    consumed = lib.consume(["later"], 1)
    assert [(d.id, d.payload) for d in consumed.deliveries] == [(message_id, b"countdown")]
    assert consumed.expired == 0


def test_the_ttl_does_not_run_out_while_a_message_is_in_flight(lib: ScriptLibrary) -> None:
    """Found by a user: a worker holding a message past its TTL lost it when it requeued
    (the hash had expired under it). In flight it stays whole; a requeued message keeps
    its deadline (as in RabbitMQ) and, past it, is dead-lettered 'expired', not lost."""
    client = lib.client
    held = lib.publish("work", "long task", ttl_ms=100)
    [delivery] = lib.consume(["work"], 1).deliveries
    wait_for_server_time(client, expires_at(lib, "work", held) + 50)
    assert message_state(client, lib.keys, "work", held)[0] == "unacked"
    assert lib.sweep(["work"]).expired == 0  # its index entry is its visibility deadline now
    assert lib.reject("work", [held], requeue=True, counts=[delivery.delivery_count]).requeued == 1

    consumed = lib.consume(["work"], 1)
    assert (consumed.deliveries, consumed.expired) == ([], 1)
    assert [(d.id, d.reason, d.delivery_count) for d in lib.dead_list("work")] == [(held, "expired", 1)]

    acked = lib.publish("work", "acked late", ttl_ms=100)
    lib.consume(["work"], 1)
    wait_for_server_time(client, expires_at(lib, "work", acked) + 50)
    assert lib.ack("work", [acked]) == 1  # still there to be acked


def test_a_timed_out_delivery_past_its_ttl_is_dead_lettered_expired(target: Any, keyspace: Keyspace) -> None:
    """A worker died holding it, and its TTL passed meanwhile: the sweep dead-letters it
    ('expired') rather than dropping it as an orphan without a trace."""
    lib = ScriptLibrary(target.client, keyspace, visibility_ms=150)
    message_id = lib.publish("dies", "held by a dead worker", ttl_ms=100)
    lib.consume(["dies"], 1)
    wait_for_server_time(target.client, int(target.client.zscore(keyspace.index("dies"), message_id)) + 1)
    report = lib.sweep(["dies"])
    assert (report.requeued, report.expired, report.orphans) == (0, 1, 0)
    assert [(d.id, d.reason, d.delivery_count) for d in lib.dead_list("dies")] == [(message_id, "expired", 1)]


def test_queue_message_ttl_applies_and_the_shorter_ttl_wins(lib: ScriptLibrary) -> None:
    lib.declare("short", message_ttl_ms=5_000)
    now = server_now_ms(lib.client)
    own_shorter = lib.publish("short", "a", ttl_ms=1_000)
    queue_shorter = lib.publish("short", "b", ttl_ms=60_000)
    queue_only = lib.publish("short", "c")
    later = server_now_ms(lib.client)
    assert now + 1_000 <= expires_at(lib, "short", own_shorter) <= later + 1_000
    assert now + 5_000 <= expires_at(lib, "short", queue_shorter) <= later + 5_000
    assert now + 5_000 <= expires_at(lib, "short", queue_only) <= later + 5_000
    own_only = lib.publish("plain", "d", ttl_ms=60_000)
    assert now + 60_000 <= expires_at(lib, "plain", own_only) <= server_now_ms(lib.client) + 60_000


def test_declare_keeps_stored_arguments_and_refuses_other_ones(lib: ScriptLibrary) -> None:
    """Found by a user: a producer's declare without arguments stripped the worker's
    x-max-priority, TTL and expiry. As in RabbitMQ: no arguments keeps them; other
    arguments are an error naming the difference."""
    first = lib.declare("args", expires_ms=20_000, message_ttl_ms=5_000, max_priority=10)
    assert (first.expires_ms, first.message_ttl_ms, first.max_priority) == (20_000, 5_000, 10)
    kept = lib.declare("args")
    assert (kept.expires_ms, kept.message_ttl_ms, kept.max_priority) == (20_000, 5_000, 10)
    assert lib.client.hget(lib.keys.meta("args"), "message_ttl") == b"5000"
    with pytest.raises(ScriptError) as refused:
        lib.declare("args", expires_ms=30_000, message_ttl_ms=5_000, max_priority=10)
    assert "x-expires stored 20000, declared 30000" in str(refused.value)
    assert "'args'" in str(refused.value)
    with pytest.raises(ScriptError) as partial:
        lib.declare("args", max_priority=10)
    assert "x-expires stored 20000, declared none" in str(partial.value)
    assert "x-message-ttl stored 5000, declared none" in str(partial.value)
    assert lib.declare("args", expires_ms=20_000, message_ttl_ms=5_000, max_priority=10).max_priority == 10
    # A queue made by a publish has no arguments yet: the first declaration sets them.
    lib.publish("implicit", "x")
    assert lib.declare("implicit", max_priority=5).max_priority == 5
    assert lib.publish("implicit", "y", priority=9)  # capped at 5 from now on


def _fill(lib: ScriptLibrary, queue: str) -> str:
    """Give the queue all eight keys: ready, in-flight, delayed and dead-lettered messages.
    Returns the id of the in-flight message."""
    lib.publish(queue, "first")
    lib.publish(queue, "second")
    lib.publish(queue, "third")
    lib.publish(queue, "later", eta_ms=server_now_ms(lib.client) + 3_600_000)
    in_flight, dead = lib.consume([queue], 2).deliveries
    lib.reject(queue, [dead.id], requeue=False)
    return in_flight.id


def test_declare_with_expires_sets_one_deadline_on_all_eight_keys(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    _fill(lib, "exp")
    names = list(keys.queue_keys("exp"))
    assert client.exists(*names) == 8
    assert pttls(client, names) == [-1] * 8  # no expiry before the declaration

    counts = lib.declare("exp", expires_ms=20_000)
    assert (counts.ready, counts.delayed, counts.in_flight, counts.expires_ms) == (1, 1, 1, 20_000)
    for ttl in pttls(client, names):
        assert 15_000 < ttl <= 20_000
    # One absolute time: the queue's messages expire with it, never after it.
    assert len({client.pexpiretime(name) for name in names}) == 1


def test_expires_has_a_floor_of_ten_seconds(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    _fill(lib, "floor")
    lib.declare("floor", expires_ms=1_000)
    assert client.hget(keys.meta("floor"), "expires") == str(MIN_EXPIRES_MS).encode()
    for ttl in pttls(client, list(keys.queue_keys("floor"))):
        assert MIN_EXPIRES_MS - 5_000 < ttl <= MIN_EXPIRES_MS


def test_activity_refreshes_the_expiry_of_all_eight_keys(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    in_flight = _fill(lib, "fresh")
    names = list(keys.queue_keys("fresh"))
    lib.declare("fresh", expires_ms=1_000)  # floored to 10 s

    def drop_then(operation: Any) -> None:
        before = wait_until(
            lambda: (t := pttls(client, names)) and all(0 < v < MIN_EXPIRES_MS - 100 for v in t) and t,
            timeout=5, interval=0.02)
        operation()
        after = pttls(client, names)
        # A PTTL only falls with time; a higher reading means the TTL was set again.
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)

    drop_then(lambda: lib.publish("fresh", "fourth"))
    drop_then(lambda: lib.declare("fresh"))
    drop_then(lambda: lib.extend("fresh", [in_flight]))
    drop_then(lambda: lib.extend("fresh", []))  # no ids: only the expiry is refreshed
    drop_then(lambda: lib.consume(["fresh"], 1))
    drop_then(lambda: lib.sweep(["fresh"]))
    assert client.exists(*names) == 8


def test_a_dead_letter_written_after_the_declaration_expires_with_its_queue(lib: ScriptLibrary) -> None:
    """Found by a user: dead:{Q} never expired, even when its queue did."""
    client, keys = lib.client, lib.keys
    lib.declare("dl", expires_ms=20_000)
    message_id = lib.publish("dl", "rejected later")
    lib.consume(["dl"], 1)
    assert client.exists(keys.dead("dl")) == 0
    lib.reject("dl", [message_id], requeue=False)
    assert 0 < client.pttl(keys.dead("dl")) <= 20_000


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_an_expired_queue_takes_its_messages_and_a_new_one_starts_clean(kind: str) -> None:
    """Found by a user: a queue with x-expires expired, the hashes of its unconsumed
    messages stayed for good, and a queue declared later under the same name restarted its
    ids at 1, wrote into a leftover hash, inherited its TTL, and a message published to the
    plain queue silently disappeared (expires=1 s, message_ttl=12 s, one message, wait
    10.5 s, redeclare without TTL, publish: nothing to consume)."""
    require_kind(kind)
    with Server(kind) as server:
        client = server.client()
        lib = ScriptLibrary(client, Keyspace(), visibility_ms=60_000)
        lib.declare("tmp", expires_ms=1_000, message_ttl_ms=12_000)
        old = lib.publish("tmp", "unconsumed")
        wait_until(lambda: not client.keys("*"), timeout=15, interval=0.1, what="the queue expired")

        lib.declare("tmp")  # the queue again, without any argument
        new = lib.publish("tmp", "plain")
        assert new > old  # ids follow the server clock: never reused
        assert expires_at(lib, "tmp", new) is None  # nothing inherited
        assert [(d.id, d.payload) for d in lib.consume(["tmp"], 5).deliveries] == [(new, b"plain")]


def test_a_late_ack_from_before_a_delete_cannot_touch_the_new_queue(lib: ScriptLibrary) -> None:
    """Found by a user: the queue expired under its consumer, the next publish reused id
    ...0001 and the old delivery's ack deleted the new message. Ids never restart."""
    old = lib.publish("again", "old")
    [held] = lib.consume(["again"], 1).deliveries
    assert lib.delete("again").messages == 1
    new = lib.publish("again", "new")
    assert new != held.id and new > old
    assert lib.ack("again", [held.id]) == 0  # the late ack finds nothing of its own
    assert lib.reject("again", [held.id], requeue=True, counts=[0]).requeued == 0
    assert [d.payload for d in lib.consume(["again"], 5).deliveries] == [b"new"]


def test_ids_stay_in_publish_order_within_one_millisecond(lib: ScriptLibrary) -> None:
    ids = lib.run_many([lib.calls.publish("burst", f"m{i}")
                        for i in range(300)])
    assert ids == sorted(ids) and len(set(ids)) == 300
    assert all(is_message_id(i) for i in ids)
    got = lib.consume(["burst"], 300).deliveries
    assert [d.payload for d in got] == [f"m{i}".encode() for i in range(300)]
