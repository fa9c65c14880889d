"""Delayed delivery: a message with an ETA (absolute unix ms, server clock) is not
consumable before it and is consumable at it; the sweep promotes due ones too. The wake
token: whatever makes a message consumable (a ready or a delayed publish, a consume that
leaves messages behind) pushes one token onto the queue's wake list when it is empty; a
consumer blocked there with BLPOP pops the token, never a message, and runs consume.
What a stopping consumer's BLPOP took goes back with unpop while the queue holds
something."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.retry import DelayedRetry
from conftest import Target
from helpers import message_state, server_now_ms, wait_for_server_time, wait_until
from scripts.servers import Server

TOKEN = [b"1"]  # what a wake list holds when a consumer is to wake
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


def test_a_countdown_rejected_by_id_alone_is_delivered_once(lib: ScriptLibrary, target: Target) -> None:
    """An operator's reject (by id, unfenced, requeue) of a countdown makes it ready at once
    and takes it out of the delayed set: reject 14 left it in both, so the consume at its
    ETA delivered it a second time (found in review; the model's reject_countdown too)."""
    eta = server_now_ms(target.client) + DELAY_MS
    message_id = lib.publish("countdown", "hello", eta_ms=eta)
    assert lib.reject("countdown", [message_id], requeue=True).requeued == 1
    assert target.client.zscore(lib.keys.delayed("countdown"), message_id) is None
    first = lib.consume(["countdown"], 10)
    assert [(d.id, d.delivery_count) for d in first.deliveries] == [(message_id, 1)]
    wait_for_server_time(target.client, eta)
    assert lib.consume(["countdown"], 10).deliveries == []  # in flight, not due again


def waiting_for_a_retry(lib: ScriptLibrary, queue: str) -> str:
    """A message with a TTL in ``queue`` (declared with a 60 s delayed retry), delivered and
    rejected with requeue: waiting for its retry, indexed at its TTL. Its id."""
    lib.declare(queue, retry=DelayedRetry("failed", 60_000, None))
    message_id = lib.publish(queue, "again", ttl_ms=3_600_000)
    delivery = lib.consume([queue], 1).deliveries[0]
    assert lib.reject(queue, [f"{delivery.id}:{delivery.delivery_count}"], requeue=True).requeued == 1
    return message_id


def test_a_keeper_s_extend_that_races_a_reject_into_a_retry_leaves_it_waiting(lib: ScriptLibrary,
                                                                              target: Target) -> None:
    """The keeper extends the deliveries being settled too, and extend moves any indexed id:
    one sent before a reject made the delivery a delayed retry (indexed at its TTL) lands
    after it and moves that entry to now + visibility. When it falls due the retry keeps
    waiting, indexed at its TTL again: sweep 13 made it ready while it stayed in the delayed
    set, so it ran at once and again at its retry's ETA."""
    client = target.client
    message_id = waiting_for_a_retry(lib, "raced")
    ttl_at = client.zscore(lib.keys.index("raced"), message_id)
    assert ttl_at is not None  # a retry is indexed at its TTL
    assert lib.with_policy(visibility_ms=1).extend("raced", [message_id]) == 1  # the keeper's, late
    wait_for_server_time(client, server_now_ms(client) + 2)
    assert lib.sweep(["raced"]).unclaimed == 0
    assert client.zscore(lib.keys.queue("raced"), message_id) is None
    assert client.zscore(lib.keys.delayed("raced"), message_id) is not None
    assert client.zscore(lib.keys.index("raced"), message_id) == ttl_at
    assert message_state(client, lib.keys, "raced", message_id)[:2] == ("retry", 1)
    assert lib.consume(["raced"], 10).deliveries == []


def test_a_countdown_whose_index_entry_falls_due_waits_for_its_eta(lib: ScriptLibrary,
                                                                   target: Target) -> None:
    """A countdown has no index entry until it is ready (its TTL counts from its ETA); one
    that falls due (set by hand, or by another version's script) goes, and the countdown
    keeps waiting: sweep 13 made it ready and left it delayed too, so it ran at once and again
    at its ETA."""
    client = target.client
    eta = server_now_ms(client) + DELAY_MS
    message_id = lib.publish("stale-entry", "later", eta_ms=eta, ttl_ms=60_000)
    client.zadd(lib.keys.index("stale-entry"), {message_id: server_now_ms(client) - 1})
    assert lib.sweep(["stale-entry"]).unclaimed == 0
    assert client.zscore(lib.keys.queue("stale-entry"), message_id) is None
    assert client.zscore(lib.keys.delayed("stale-entry"), message_id) == eta
    assert client.zscore(lib.keys.index("stale-entry"), message_id) is None
    assert lib.consume(["stale-entry"], 10).deliveries == []
    wait_for_server_time(client, eta)
    assert [d.id for d in lib.consume(["stale-entry"], 10).deliveries] == [message_id]


def test_a_retry_out_of_the_delayed_set_is_made_ready_and_no_longer_counted(lib: ScriptLibrary,
                                                                          target: Target) -> None:
    """A message waiting for its delayed retry that left the delayed set (by hand) but is still
    indexed is made ready by the sweep, and the queue's 'retrying' counter lets it go: sweep
    13 left the counter one too high for good."""
    client = target.client
    message_id = waiting_for_a_retry(lib, "lost-retry")
    assert client.hget(lib.keys.meta("lost-retry"), "retrying") == b"1"
    client.zrem(lib.keys.delayed("lost-retry"), message_id)
    client.zadd(lib.keys.index("lost-retry"), {message_id: server_now_ms(client) - 1})
    assert lib.sweep(["lost-retry"]).unclaimed == 1
    assert message_state(client, lib.keys, "lost-retry", message_id)[:2] == ("ready", 1)
    assert client.hget(lib.keys.meta("lost-retry"), "retrying") == b"0"
    assert [d.id for d in lib.consume(["lost-retry"], 10).deliveries] == [message_id]


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
        # Ready as of its ETA, at its priority; not indexed: no blocking pop can take it.
        assert client.zscore(lib.keys.queue("swept"), message_id) == (255 - priority) * 10**13 + eta
        assert client.zscore(lib.keys.index("swept"), message_id) is None
        assert message_state(client, lib.keys, "swept", message_id) == ("ready", 0, priority, "-")
    assert lib.size("swept") == 2
    assert [d.id for d in lib.consume(["swept"], 10).deliveries] == due_ids[::-1]


def test_eta_in_the_past_is_ready_now(lib: ScriptLibrary, target: Target) -> None:
    past = lib.publish("past", "a", eta_ms=server_now_ms(target.client) - 10_000)
    ancient = lib.publish("past", "b", eta_ms=1)
    assert target.client.exists(lib.keys.delayed("past")) == 0
    assert target.client.zcard(lib.keys.queue("past")) == 2
    assert lib.size("past") == 2
    consumed = lib.consume(["past"], 10)
    assert [d.id for d in consumed.deliveries] == [past, ancient]
    assert consumed.wake_in_ms is None


def test_the_wake_token_has_a_list_of_its_own_and_is_never_delivered(
        lib: ScriptLibrary, target: Target) -> None:
    client, wake_key = target.client, lib.keys.wake("wq")
    eta = server_now_ms(client) + 3_600_000
    delayed = lib.publish("wq", "later", eta_ms=eta)

    # A delayed publish wakes a blocked consumer too (it learns the ETA); the ready ZSET
    # holds messages only.
    assert client.lrange(wake_key, 0, -1) == TOKEN
    assert client.exists(lib.keys.queue("wq")) == 0
    assert lib.size("wq") == 0
    ready = lib.publish("wq", "now", priority=255)
    assert client.lrange(wake_key, 0, -1) == TOKEN  # one token, however many publishes
    assert lib.size("wq") == 1

    consumed = lib.consume(["wq"], 10)
    assert [d.id for d in consumed.deliveries] == [ready]
    assert consumed.wake_in_ms is not None and consumed.wake_in_ms > 3_500_000
    assert [m.decode() for m in client.zrange(lib.keys.index("wq"), 0, -1)] == [ready]  # in flight only
    assert client.zscore(lib.keys.delayed("wq"), delayed) == eta
    assert lib.consume(["wq"], 10).deliveries == []


def test_a_ready_message_without_a_ttl_has_no_index_entry(lib: ScriptLibrary, target: Target) -> None:
    """Nothing pops a message but consume, which marks it in flight in the same call, so a
    ready message needs no entry for the sweep; one with a TTL has one, at its deadline."""
    client = target.client
    plain = lib.publish("ix", "plain")
    mortal = lib.publish("ix", "mortal", ttl_ms=60_000)
    index = dict(client.zrange(lib.keys.index("ix"), 0, -1, withscores=True))
    assert list(index) == [mortal.encode()]
    assert message_state(client, lib.keys, "ix", mortal)[3] == str(int(index[mortal.encode()]))
    assert client.zscore(lib.keys.index("ix"), plain) is None


def test_a_consume_that_stops_at_its_count_wakes_another_consumer(lib: ScriptLibrary, target: Target) -> None:
    """A burst one consumer's room cannot hold is shared: a consume that leaves ready
    messages behind pushes the token again; one that empties the queue does not."""
    client, wake_key = target.client, lib.keys.wake("burst")
    for n in range(3):
        lib.publish("burst", f"m{n}")
    assert client.lpop(wake_key) == b"1"  # a blocked consumer took the publishes' token
    assert len(lib.consume(["burst"], 2).deliveries) == 2
    assert client.lrange(wake_key, 0, -1) == TOKEN  # one left behind: the next consumer wakes
    assert client.lpop(wake_key) == b"1"
    assert len(lib.consume(["burst"], 2).deliveries) == 1
    assert client.exists(wake_key) == 0  # nothing left to wake anyone for


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    server: Server = request.getfixturevalue(f"{request.param}_server")
    client = server.client(socket_timeout=10)
    client.flushall()
    client.close()
    yield server


def blocked_consumers(server: Server, wake_key: str, count: int) -> tuple[list[threading.Thread], list[Any]]:
    """``count`` consumers blocked in BLPOP on ``wake_key`` (5 s), each on its own connection
    with a read timeout above the block; returns their threads and the list of what woke them."""
    woken: list[Any] = []

    def block() -> None:
        blocker = server.client(socket_timeout=8)
        try:
            woken.append(blocker.execute_command("BLPOP", wake_key, 5))
        finally:
            blocker.close()

    threads = [threading.Thread(target=block, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    watcher = server.client(socket_timeout=10)
    wait_until(lambda: int(watcher.info("clients")["blocked_clients"]) >= count)
    watcher.close()
    return threads, woken


def test_delayed_publish_wakes_a_blocked_blpop(server: Server) -> None:
    client = server.client(socket_timeout=10)
    lib = ScriptLibrary(client, Keyspace("app:"), visibility_ms=60_000)
    wake_key = lib.keys.wake("blocked")
    threads, woken = blocked_consumers(server, wake_key, 1)

    eta = server_now_ms(client) + 3_600_000
    delayed = lib.publish("blocked", "later", eta_ms=eta)
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()

    assert woken and woken[0] is not None, "BLPOP timed out instead of waking"
    assert list(woken[0]) == [wake_key.encode(), b"1"]
    # The woken consumer runs consume: nothing to deliver, and when to look again.
    consumed = lib.consume(["blocked"], 10)
    assert consumed.deliveries == [] and consumed.wake_in_ms is not None and consumed.wake_in_ms > 3_500_000
    assert client.zscore(lib.keys.delayed("blocked"), delayed) == eta
    assert client.exists(lib.keys.wake("blocked"), lib.keys.queue("blocked"), lib.keys.index("blocked")) == 0
    client.close()


def test_each_publish_wakes_one_more_blocked_consumer(server: Server) -> None:
    """Two consumers blocked on one queue, two publishes: the server hands each token to one
    waiter in turn (the list is empty again after each pop, so the next publish pushes)."""
    client = server.client(socket_timeout=10)
    lib = ScriptLibrary(client, Keyspace("app:"), visibility_ms=60_000)
    wake_key = lib.keys.wake("pair")
    threads, woken = blocked_consumers(server, wake_key, 2)
    for n in range(2):
        lib.publish("pair", f"m{n}")
    for thread in threads:
        thread.join(timeout=10)
    assert [list(w) for w in woken] == [[wake_key.encode(), b"1"]] * 2
    assert len(lib.consume(["pair"], 10).deliveries) == 2
    client.close()


# --- unpop: the token a stopping consumer's BLPOP took goes back -----------------------------


def test_unpop_gives_the_token_back_while_the_queue_holds_something(lib: ScriptLibrary) -> None:
    client, wake_key = lib.client, lib.keys.wake("up")
    ids = [lib.publish("up", f"m{i}", priority=p) for i, p in enumerate((0, 9, 5))]
    assert client.lpop(wake_key) == b"1"  # the stopping consumer's BLPOP

    assert lib.unpop("up") == 1
    assert client.lrange(wake_key, 0, -1) == TOKEN
    assert lib.unpop("up") == 0  # a token already waits: one is enough
    assert client.lrange(wake_key, 0, -1) == TOKEN
    # Nothing else moved: no delivery was made.
    for message_id, priority in zip(ids, (0, 9, 5), strict=True):
        assert message_state(client, lib.keys, "up", message_id) == ("ready", 0, priority, "-")
    got = lib.consume(["up"], 10).deliveries
    assert [(d.id, d.delivery_count) for d in got] == [(ids[1], 0), (ids[2], 0), (ids[0], 0)]


def test_unpop_wakes_nobody_for_an_empty_queue_but_does_for_a_delayed_message(
        lib: ScriptLibrary, target: Target) -> None:
    client, wake_key = target.client, lib.keys.wake("wake")
    assert lib.unpop("wake") == 0
    assert client.exists(wake_key) == 0  # a token with nothing to wake for would wake in vain
    lib.publish("wake", "later", eta_ms=server_now_ms(client) + 3_600_000)
    assert client.lpop(wake_key) == b"1"
    assert lib.unpop("wake") == 1  # a blocked consumer must learn the ETA
    assert client.lrange(wake_key, 0, -1) == TOKEN


def test_unpop_keeps_an_expiring_queues_keys_expiring_together(lib: ScriptLibrary) -> None:
    """A queue with x-expires has all eight keys expire together. The pop took the token,
    so the server deleted wake:{Q}; the push that puts it back makes a new key, which must
    expire with the rest, or it stays behind when the queue is gone."""
    client, keys = lib.client, lib.keys
    lib.declare("fleeting", expires_ms=60_000)
    lib.publish("fleeting", "m")
    assert 0 < client.pttl(keys.wake("fleeting")) <= 60_000  # publish's token expires with the queue
    assert client.lpop(keys.wake("fleeting")) == b"1"
    assert client.exists(keys.wake("fleeting")) == 0

    assert lib.unpop("fleeting") == 1

    assert 0 < client.pttl(keys.meta("fleeting")) <= 60_000
    assert 0 < client.pttl(keys.wake("fleeting")) <= 60_000
