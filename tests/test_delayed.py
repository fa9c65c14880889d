"""Delayed delivery: a message with an ETA (absolute unix ms, server clock) is not
consumable before it and is consumable at it; the sweep promotes due ones too; a
delayed publish leaves a wake marker that wakes a blocked BZMPOP but is never delivered."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.servers import Server
from conftest import Target
from helpers import server_now_ms, wait_for_server_time, wait_until

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
    assert target.client.hget(lib.keys.message("later", message_id), "state") == b"delayed"

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
    assert (report.promoted, report.requeued, report.dropped) == (2, 0, 0)

    client = target.client
    assert [m.decode() for m in client.zrange(lib.keys.delayed("swept"), 0, -1)] == [far]
    for priority, message_id in enumerate(due_ids):
        # Ready as of its ETA, at its priority; indexed so that a lost pop comes back.
        assert client.zscore(lib.keys.queue("swept"), message_id) == (255 - priority) * 10**13 + eta
        assert client.zscore(lib.keys.index("swept"), message_id) is not None
        assert client.hget(lib.keys.message("swept", message_id), "state") == b"ready"
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
    assert lib.claim("blocked", ["~wake"]) == []
    assert client.zscore(lib.keys.index("blocked"), WAKE) is None
    assert client.zscore(lib.keys.delayed("blocked"), delayed) == eta
    assert client.zcard(queue_key) == 0
    client.close()
