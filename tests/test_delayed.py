"""Delayed delivery: a message with an ETA (absolute unix ms, server clock) is not
consumable before it and is consumable at it; the sweep promotes due ones too; a
delayed publish leaves a wake marker that wakes a blocked BZMPOP but is never delivered.
What a BZMPOP popped but nobody will claim goes back in line with unpop: same score,
delivery count unchanged, nothing put back that another consumer holds or that is gone,
and the wake marker only while something is still delayed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redis_lua import Consumed, Keyspace, ScriptLibrary
from conftest import Target
from helpers import message_state, server_now_ms, wait_for_server_time, wait_until
from tools.servers import Server

WAKE = b"~wake"
WAKE_SCORE = 256 * 10**13
DELAY_MS = 300


def test_not_consumable_before_eta_and_consumable_at_it(lib: ScriptLibrary, target: Target) -> None:
    eta = server_now_ms(target.client) + DELAY_MS
    message_id = lib.publish("later", "hello", eta_ms=eta)

    early = lib.consume(["later"], 10)
    assert early.deliveries == []
    assert early.wake_in_ms is not None and 0 < early.wake_in_ms <= DELAY_MS
    assert target.client.zscore(lib.keys.delayed("later"), message_id) == eta
    assert message_state(target.client, lib.keys, "later", message_id) == ("delayed", 0, 0, "-")

    wait_for_server_time(target.client, eta)
    due = lib.consume(["later"], 10)
    assert [(d.id, d.delivery_count, d.payload) for d in due.deliveries] == [(message_id, 0, b"hello")]
    assert due.wake_in_ms is None  # nothing delayed any more
    assert target.client.exists(lib.keys.delayed("later")) == 0
    assert lib.consume(["later"], 10).deliveries == []


def test_delayed_higher_priority_waits_behind_a_ready_one(lib: ScriptLibrary, target: Target) -> None:
    eta = server_now_ms(target.client) + DELAY_MS
    urgent_later = lib.publish("mix", "urgent-later", priority=9, eta_ms=eta)
    ready = lib.publish("mix", "ready-now", priority=0)

    # Published earlier and more important, but not due: only the ready one comes out.
    first = lib.consume(["mix"], 10)
    assert [d.id for d in first.deliveries] == [ready]
    assert first.wake_in_ms is not None and 0 < first.wake_in_ms <= DELAY_MS

    wait_for_server_time(target.client, eta)
    plain = lib.publish("mix", "plain", priority=0)
    # Once due, its priority counts again: it goes before a ready priority-0 message.
    assert [d.id for d in lib.consume(["mix"], 10).deliveries] == [urgent_later, plain]


def test_sweep_promotes_due_delayed_messages(lib: ScriptLibrary, target: Target) -> None:
    now = server_now_ms(target.client)
    eta = now + DELAY_MS
    due_ids = [lib.publish("swept", f"due{i}", priority=i, eta_ms=eta) for i in range(2)]
    far = lib.publish("swept", "far", eta_ms=now + 3_600_000)

    assert lib.sweep(["swept"]).promoted == 0
    wait_for_server_time(target.client, eta)
    report = lib.sweep(["swept"])
    assert (report.promoted, report.requeued, report.limit_reached, report.expired) == (2, 0, 0, 0)

    client = target.client
    assert [m.decode() for m in client.zrange(lib.keys.delayed("swept"), 0, -1)] == [far]
    for priority, message_id in enumerate(due_ids):
        # Ready as of its ETA, at its priority; indexed so that a lost pop comes back.
        assert client.zscore(lib.keys.queue("swept"), message_id) == (255 - priority) * 10**13 + eta
        assert client.zscore(lib.keys.index("swept"), message_id) is not None
        assert message_state(client, lib.keys, "swept", message_id) == ("ready", 0, priority, "-")
    assert lib.size("swept") == 2
    assert [d.id for d in lib.consume(["swept"], 10).deliveries] == due_ids[::-1]


def test_eta_in_the_past_is_ready_now(lib: ScriptLibrary, target: Target) -> None:
    past = lib.publish("past", "a", eta_ms=server_now_ms(target.client) - 10_000)
    ancient = lib.publish("past", "b", eta_ms=1)
    assert target.client.exists(lib.keys.delayed("past")) == 0
    assert target.client.zscore(lib.keys.queue("past"), WAKE) is None
    assert lib.size("past") == 2
    consumed = lib.consume(["past"], 10)
    assert [d.id for d in consumed.deliveries] == [past, ancient]
    assert consumed.wake_in_ms is None


def test_wake_marker_is_queued_but_never_delivered(lib: ScriptLibrary, target: Target) -> None:
    client, queue_key = target.client, lib.keys.queue("wq")
    eta = server_now_ms(client) + 3_600_000
    delayed = lib.publish("wq", "later", eta_ms=eta)

    # The marker sits in the queue zset above every ready score, so BZMPOP MIN would
    # pop it only from an otherwise empty queue; size() does not count it.
    assert client.zscore(queue_key, WAKE) == WAKE_SCORE
    assert client.zcard(queue_key) == 1
    assert lib.size("wq") == 0
    ready = lib.publish("wq", "now", priority=255)
    assert lib.size("wq") == 1

    consumed = lib.consume(["wq"], 10)
    assert [d.id for d in consumed.deliveries] == [ready]
    assert consumed.wake_in_ms is not None and consumed.wake_in_ms > 3_500_000
    # consume removed the marker and did not index it; the delayed message is untouched.
    assert client.zscore(queue_key, WAKE) is None
    assert client.zscore(lib.keys.index("wq"), WAKE) is None
    assert client.zscore(lib.keys.delayed("wq"), delayed) == eta
    assert lib.consume(["wq"], 10).deliveries == []


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    server: Server = request.getfixturevalue(f"{request.param}_server")
    client = server.client(socket_timeout=10)
    client.flushall()
    client.close()
    yield server


def test_delayed_publish_wakes_a_blocked_bzmpop(server: Server) -> None:
    client = server.client(socket_timeout=10)
    lib = ScriptLibrary(client, Keyspace("app:"), visibility_ms=60_000)
    queue_key = lib.keys.queue("blocked")
    popped: list[Any] = []

    def block() -> None:
        # Its own connection, with a read timeout above the block.
        blocker = server.client(socket_timeout=8)
        try:
            popped.append(blocker.execute_command("BZMPOP", 5, 1, queue_key, "MIN"))
        finally:
            blocker.close()

    thread = threading.Thread(target=block, daemon=True)
    thread.start()
    wait_until(lambda: int(client.info("clients")["blocked_clients"]) >= 1)

    eta = server_now_ms(client) + 3_600_000
    delayed = lib.publish("blocked", "later", eta_ms=eta)
    thread.join(timeout=10)
    assert not thread.is_alive()

    assert popped and popped[0] is not None, "BZMPOP timed out instead of waking"
    key, members = popped[0]
    assert key == queue_key.encode()
    assert [member for member, _ in members] == [WAKE]
    # The woken consumer claims what it popped: the marker is no delivery.
    assert lib.claim("blocked", ["~wake"]) == Consumed([], None, 0)
    assert client.zscore(lib.keys.index("blocked"), WAKE) is None
    assert client.zscore(lib.keys.delayed("blocked"), delayed) == eta
    assert client.zcard(queue_key) == 0
    client.close()


# --- unpop: what a BZMPOP popped goes back when nobody will claim it -----------------------------


def zmpop(lib: ScriptLibrary, queue: str, count: int) -> list[tuple[str, str]]:
    """Pop like a consumer's BZMPOP (ZMPOP: its non-blocking twin); (member, score) pairs as
    the server sends them, which is what a channel hands to unpop."""
    reply = lib.client.execute_command("ZMPOP", 1, lib.keys.queue(queue), "MIN", "COUNT", count)
    assert reply is not None
    return [(member.decode(), score.decode()) for member, score in reply[1]]


def test_unpop_puts_messages_back_with_their_old_scores_uncounted(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    ids = [lib.publish("up", f"m{i}", priority=p) for i, p in enumerate((0, 9, 5))]
    scores = {member.decode(): score for member, score in client.zrange(keys.queue("up"), 0, -1,
                                                                       withscores=True)}
    index = {member.decode(): score for member, score in client.zrange(keys.index("up"), 0, -1,
                                                                       withscores=True)}
    popped = zmpop(lib, "up", 2)
    assert [member for member, _ in popped] == [ids[1], ids[2]]
    assert lib.size("up") == 1

    assert lib.unpop("up", popped) == 2

    # Same place in line, and nothing else moved: no delivery was made.
    assert {member.decode(): score for member, score in client.zrange(keys.queue("up"), 0, -1,
                                                                     withscores=True)} == scores
    assert {member.decode(): score for member, score in client.zrange(keys.index("up"), 0, -1,
                                                                     withscores=True)} == index
    for message_id, priority in zip(ids, (0, 9, 5), strict=True):
        assert message_state(client, keys, "up", message_id) == ("ready", 0, priority, "-")
    got = lib.consume(["up"], 10).deliveries
    assert [(d.id, d.delivery_count) for d in got] == [(ids[1], 0), (ids[2], 0), (ids[0], 0)]


def test_unpop_leaves_alone_what_another_consumer_holds_or_what_is_gone(
        target: Target, keyspace: Keyspace) -> None:
    lib = ScriptLibrary(target.client, keyspace, visibility_ms=200)
    client, keys = target.client, keyspace
    held, acked, waiting = (lib.publish("up", name) for name in ("held", "acked", "waiting"))
    popped = zmpop(lib, "up", 3)
    assert [member for member, _ in popped] == [held, acked, waiting]

    # The popping consumer stalls: the sweep restores all three (not a delivery), another
    # consumer takes two of them, acks one of those, and the third waits in the queue again.
    wait_for_server_time(client, int(max(client.zrange(keys.index("up"), 0, -1, withscores=True),
                                         key=lambda pair: pair[1])[1]) + 1)
    assert lib.sweep(["up"]).unclaimed == 3
    other = lib.consume(["up"], 2).deliveries
    assert [d.id for d in other] == [held, acked]
    assert lib.ack("up", [acked]) == 1
    requeued_score = client.zscore(keys.queue("up"), waiting)

    assert lib.unpop("up", [*popped, ("ffffffffffffffff", "2550000000000000")]) == 0

    assert client.zscore(keys.queue("up"), held) is None  # not queued twice while held
    assert message_state(client, keys, "up", held) == ("unacked", 0, 0, "-")
    assert client.zscore(keys.queue("up"), acked) is None  # acked: stays gone
    assert client.zscore(keys.queue("up"), waiting) == requeued_score  # already back: kept
    assert client.zscore(keys.queue("up"), "ffffffffffffffff") is None  # never existed
    assert lib.size("up") == 1


def test_unpop_puts_the_wake_marker_back_only_while_something_is_delayed(
        lib: ScriptLibrary, target: Target) -> None:
    client, queue_key = target.client, lib.keys.queue("wake")
    eta = server_now_ms(client) + DELAY_MS
    delayed = lib.publish("wake", "later", eta_ms=eta)
    popped = zmpop(lib, "wake", 1)
    assert popped == [(WAKE.decode(), str(WAKE_SCORE))]

    assert lib.unpop("wake", popped) == 0  # back, but it is no message
    assert client.zscore(queue_key, WAKE) == WAKE_SCORE

    assert zmpop(lib, "wake", 1) == popped
    wait_for_server_time(client, eta)
    assert [d.id for d in lib.consume(["wake"], 10).deliveries] == [delayed]  # nothing delayed now
    assert lib.unpop("wake", popped) == 0
    assert client.exists(queue_key) == 0  # a marker with nothing to wake for would wake in vain


def test_unpop_keeps_an_expiring_queues_keys_expiring_together(lib: ScriptLibrary) -> None:
    """A queue with x-expires has all seven keys expire together. The pop took the last
    member, so the server deleted queue:{Q}; the ZADD that puts it back makes a new key,
    which must expire with the rest, or it stays behind, holding an id whose message is gone."""
    client, keys = lib.client, lib.keys
    lib.declare("fleeting", expires_ms=60_000)
    lib.publish("fleeting", "m")
    popped = zmpop(lib, "fleeting", 1)
    assert client.exists(keys.queue("fleeting")) == 0

    assert lib.unpop("fleeting", popped) == 1

    assert 0 < client.pttl(keys.meta("fleeting")) <= 60_000
    assert 0 < client.pttl(keys.queue("fleeting")) <= 60_000
