"""Message TTL and queue expiry: expired hashes are skipped and cleaned, queue keys carry TTLs.

Message TTL is the hash's PEXPIRE: the server deletes the hash, and consume finds a queue
entry without a hash, drops it and its index entry, and moves on to the next message in the
same call. Queue expiry (RabbitMQ's x-expires) is a PEXPIRE on the queue's four keys,
refreshed by publish, declare and extend, floored at 10 s, and removed by a redeclare
without it.
"""

from __future__ import annotations

from typing import Any

from celery_redis_lua import Keyspace, ScriptLibrary, calls
from helpers import server_now_ms, wait_until

MIN_EXPIRES_MS = 10_000


def queue_keys(keys: Keyspace, queue: str) -> list[str]:
    return [keys.queue(queue), keys.delayed(queue), keys.index(queue), keys.meta(queue)]


def pttls(client: Any, names: list[str]) -> list[int]:
    return [int(client.pttl(name)) for name in names]


def wait_gone(client: Any, key: str) -> None:
    wait_until(lambda: client.exists(key) == 0, timeout=10)


def test_expired_message_is_skipped_and_cleaned_and_next_one_delivered(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    doomed = lib.publish("ttl", "doomed", ttl_ms=150)
    live = lib.publish("ttl", "live")
    assert 0 < client.pttl(keys.message("ttl", doomed)) <= 150
    assert client.pttl(keys.message("ttl", live)) == -1
    assert client.zscore(keys.index("ttl"), doomed) is not None  # indexed at publish

    wait_gone(client, keys.message("ttl", doomed))
    # The expired entry is first in line (same priority, published earlier).
    assert client.zrange(keys.queue("ttl"), 0, 0) == [doomed.encode()]

    consumed = lib.consume(["ttl"], 1)
    assert [(d.id, d.payload) for d in consumed.deliveries] == [(live, b"live")]
    assert client.zscore(keys.index("ttl"), doomed) is None
    assert client.zscore(keys.queue("ttl"), doomed) is None
    assert client.zscore(keys.index("ttl"), live) is not None  # in flight now
    assert lib.size("ttl") == 0


def test_queue_message_ttl_expires_messages(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    lib.declare("qttl", message_ttl_ms=150)
    doomed = lib.publish("qttl", "doomed")  # no ttl of its own: the queue's applies
    assert 0 < client.pttl(keys.message("qttl", doomed)) <= 150
    assert client.hget(keys.meta("qttl"), "message_ttl") == b"150"

    lib.declare("qttl")  # the last declaration wins: no message TTL any more
    assert client.hget(keys.meta("qttl"), "message_ttl") is None
    live = lib.publish("qttl", "live")
    assert client.pttl(keys.message("qttl", live)) == -1

    wait_gone(client, keys.message("qttl", doomed))
    consumed = lib.consume(["qttl"], 5)
    assert [(d.id, d.payload) for d in consumed.deliveries] == [(live, b"live")]
    assert client.zscore(keys.index("qttl"), doomed) is None
    assert client.zscore(keys.queue("qttl"), doomed) is None


def test_several_expired_messages_are_skipped_in_one_call(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    doomed = [lib.publish("many", f"doomed-{i}", priority=9, ttl_ms=100) for i in range(5)]
    live = [lib.publish("many", f"live-{i}") for i in range(2)]
    for message_id in doomed:
        wait_gone(client, keys.message("many", message_id))
    consumed = lib.consume(["many"], 2)
    assert [d.id for d in consumed.deliveries] == live
    assert [client.zscore(keys.index("many"), i) for i in doomed] == [None] * 5
    assert client.zcard(keys.index("many")) == 2


def test_a_run_of_expired_messages_does_not_hide_a_live_one(lib: ScriptLibrary) -> None:
    """A queue whose consumers were away while its messages expired: one consume call
    for one message still gets past a few dozen expired ones (the skip budget is
    bounded, but in messages, not a handful of refill rounds)."""
    client, keys = lib.client, lib.keys
    ids = lib.run_many([calls.publish(keys, "backlog", f"old-{i}", ttl_ms=100, visibility_ms=60_000)
                        for i in range(30)])
    live = lib.publish("backlog", "live")
    wait_until(lambda: client.exists(*(keys.message("backlog", i) for i in ids)) == 0)
    consumed = lib.consume(["backlog"], 1)
    assert [d.id for d in consumed.deliveries] == [live]
    assert client.zcard(keys.index("backlog")) == 1
    assert client.zcard(keys.queue("backlog")) == 0


def test_shorter_of_message_ttl_and_queue_ttl_wins(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    lib.declare("short", message_ttl_ms=5_000)
    own_shorter = lib.publish("short", "a", ttl_ms=1_000)
    queue_shorter = lib.publish("short", "b", ttl_ms=60_000)
    queue_only = lib.publish("short", "c")
    assert 0 < client.pttl(keys.message("short", own_shorter)) <= 1_000
    assert 1_000 < client.pttl(keys.message("short", queue_shorter)) <= 5_000
    assert 1_000 < client.pttl(keys.message("short", queue_only)) <= 5_000

    # Without a queue TTL, the message's own TTL applies as given.
    own_only = lib.publish("plain", "d", ttl_ms=60_000)
    assert 5_000 < client.pttl(keys.message("plain", own_only)) <= 60_000


def test_delayed_message_keeps_its_ttl(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    eta = server_now_ms(client) + 3_600_000
    delayed = lib.publish("later", "x", eta_ms=eta, ttl_ms=30_000)
    assert 0 < client.pttl(keys.message("later", delayed)) <= 30_000
    assert client.zscore(keys.delayed("later"), delayed) == eta


def _fill(lib: ScriptLibrary, queue: str) -> str:
    """Give the queue all four keys: ready and in-flight messages, a delayed one, meta.
    Returns the id of the in-flight message."""
    lib.publish(queue, "first")
    lib.publish(queue, "second")
    lib.publish(queue, "later", eta_ms=server_now_ms(lib.client) + 3_600_000)
    (in_flight,) = lib.consume([queue], 1).deliveries
    return in_flight.id


def test_declare_with_expires_sets_ttl_on_every_queue_key(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    _fill(lib, "exp")
    names = queue_keys(keys, "exp")
    assert client.exists(*names) == 4
    assert pttls(client, names) == [-1] * 4  # no expiry before the declaration

    counts = lib.declare("exp", expires_ms=20_000)
    assert (counts.ready, counts.delayed, counts.in_flight) == (1, 1, 1)
    for ttl in pttls(client, names):
        assert 15_000 < ttl <= 20_000
    assert client.hget(keys.meta("exp"), "expires") == b"20000"


def test_expires_has_a_floor_of_ten_seconds(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    _fill(lib, "floor")
    lib.declare("floor", expires_ms=1_000)
    assert client.hget(keys.meta("floor"), "expires") == str(MIN_EXPIRES_MS).encode()
    for ttl in pttls(client, queue_keys(keys, "floor")):
        assert MIN_EXPIRES_MS - 5_000 < ttl <= MIN_EXPIRES_MS


def test_publish_declare_and_extend_refresh_queue_expiry(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    in_flight = _fill(lib, "fresh")
    names = queue_keys(keys, "fresh")
    lib.declare("fresh", expires_ms=1_000)  # floored to 10 s

    def drop_then(operation: Any) -> None:
        before = wait_until(
            lambda: (t := pttls(client, names)) and all(0 < v < MIN_EXPIRES_MS - 100 for v in t) and t,
            timeout=5, interval=0.02)
        operation()
        after = pttls(client, names)
        # A PTTL only falls with time; a higher reading means the TTL was set again.
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)

    drop_then(lambda: lib.publish("fresh", "third"))
    drop_then(lambda: lib.declare("fresh", expires_ms=1_000))
    drop_then(lambda: lib.extend("fresh", [in_flight]))
    drop_then(lambda: lib.extend("fresh", []))  # no ids: only the expiry is refreshed
    assert client.exists(*names) == 4


def test_redeclare_without_expires_persists_queue_keys(lib: ScriptLibrary) -> None:
    client, keys = lib.client, lib.keys
    _fill(lib, "keep")
    names = queue_keys(keys, "keep")
    lib.declare("keep", expires_ms=30_000)
    assert all(ttl > 0 for ttl in pttls(client, names))

    lib.declare("keep")
    assert pttls(client, names) == [-1] * 4
    assert client.hget(keys.meta("keep"), "expires") is None
    lib.publish("keep", "after")  # a later publish does not bring the expiry back
    assert pttls(client, names) == [-1] * 4

