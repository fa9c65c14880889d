"""Nothing left behind: once every message is gone, only the keys that define queues remain.

A queue is defined by its ``meta:{Q}`` hash (queue arguments and ``last_id``); an
exchange by its binding table. After publish, consume and ack of every message (ready,
delayed then due, with and without priorities, several queues), after reject without
requeue with dead-lettering off, after messages expired (TTL) with dead-lettering off,
after purge, the exact key set is those and nothing else: the payload and state hashes
(``message:{Q}``, ``state:{Q}``) go with their last field. delete removes meta and the
dead-letter stream too.
"""

from __future__ import annotations

import pytest

from celery_redis_lua import Delivery, Keyspace, Policy, ScriptLibrary
from conftest import Target
from helpers import message_state, server_now_ms, wait_for_server_time, wait_until

QUEUES = ("alpha", "beta", "gamma")
EXCHANGE = "tasks"
PRIORITIES = (None, None, 5, 200, 255)


def publish_mix(lib: ScriptLibrary, queues: tuple[str, ...] = QUEUES) -> tuple[set[str], int]:
    """Ready messages with and without priorities and two delayed ones per queue.
    Returns the (queue, id) pairs as strings and the server time when the delayed are due."""
    due = server_now_ms(lib.client) + 200
    published = set()
    for queue in queues:
        for n, priority in enumerate(PRIORITIES):
            payload = f"{queue}-{n}"
            message_id = (lib.publish(queue, payload) if priority is None
                          else lib.publish(queue, payload, priority=priority))
            published.add(f"{queue}/{message_id}")
        for n, priority in enumerate((0, 7)):
            message_id = lib.publish(queue, f"{queue}-late-{n}", priority=priority, eta_ms=due)
            published.add(f"{queue}/{message_id}")
    return published, due


def consume_all(lib: ScriptLibrary, total: int, queues: tuple[str, ...] = QUEUES,
                no_ack: bool = False) -> list[Delivery]:
    got: list[Delivery] = []

    def more() -> bool:
        got.extend(lib.consume(list(queues), 50, no_ack=no_ack).deliveries)
        return len(got) >= total

    wait_until(more, timeout=10)
    assert len(got) == total
    return got


def defining_keys(keys: Keyspace, queues: tuple[str, ...] = QUEUES, bound: bool = False) -> set[bytes]:
    expected = {keys.meta(q).encode() for q in queues}
    if bound:
        expected.add(keys.binding(EXCHANGE).encode())
    return expected


def bind_all(lib: ScriptLibrary, queues: tuple[str, ...] = QUEUES) -> None:
    lib.bind(EXCHANGE, [lib.keys.binding_member(q, "", q) for q in queues])


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_consume_and_ack_everything_leaves_only_defining_keys(
        target: Target, lib: ScriptLibrary, bound: bool) -> None:
    if bound:
        bind_all(lib)
    published, due = publish_mix(lib)
    ready = lib.consume(list(QUEUES), 100).deliveries  # the ready ones (delayed wait, normally)
    assert len(ready) >= len(QUEUES) * len(PRIORITIES)
    for delivery in ready:
        assert lib.ack(delivery.queue, [delivery.id]) == 1

    waiting = len(published) - len(ready)
    wait_for_server_time(lib.client, due)
    assert lib.sweep(list(QUEUES)).promoted == waiting
    late = consume_all(lib, waiting)
    for delivery in late:
        assert lib.ack(delivery.queue, [delivery.id]) == 1

    assert {f"{d.queue}/{d.id}" for d in ready + late} == published
    assert target.keys() == defining_keys(lib.keys, bound=bound)


def test_delayed_messages_promoted_by_consume_leave_nothing_behind(
        target: Target, lib: ScriptLibrary) -> None:
    published, due = publish_mix(lib)
    wait_for_server_time(lib.client, due)
    everything = consume_all(lib, len(published))
    by_queue: dict[str, list[str]] = {}
    for delivery in everything:
        by_queue.setdefault(delivery.queue, []).append(delivery.id)
    for queue, ids in by_queue.items():
        assert lib.ack(queue, ids) == len(ids)  # a batch ack
    assert target.keys() == defining_keys(lib.keys)


def test_no_ack_consume_leaves_nothing_behind(target: Target, lib: ScriptLibrary) -> None:
    published, due = publish_mix(lib)
    wait_for_server_time(lib.client, due)
    consumed = consume_all(lib, len(published), no_ack=True)
    assert {f"{d.queue}/{d.id}" for d in consumed} == published
    assert target.keys() == defining_keys(lib.keys)


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_reject_without_requeue_and_no_dead_letters_leaves_only_defining_keys(
        target: Target, lib: ScriptLibrary, bound: bool) -> None:
    if bound:
        bind_all(lib)
    published, due = publish_mix(lib)
    wait_for_server_time(lib.client, due)
    first = consume_all(lib, len(published))
    # Half go round once more through reject(requeue=True) before they are dropped.
    again = first[::2]
    for delivery in again:
        assert lib.reject(delivery.queue, [delivery.id], requeue=True).requeued == 1
    redelivered = consume_all(lib, len(again))
    assert {d.id for d in redelivered} == {d.id for d in again}
    assert all(d.delivery_count == 1 for d in redelivered)

    no_dead_letters = lib.with_policy(dead_letter_maxlen=0)
    for delivery in first:
        rejected = no_dead_letters.reject(delivery.queue, [delivery.id], requeue=False)
        assert (rejected.requeued, rejected.dead_lettered, rejected.deleted) == (0, 0, 1)
    assert target.keys() == defining_keys(lib.keys, bound=bound)


def test_ack_after_visibility_restore_leaves_nothing_behind(target: Target, keyspace: Keyspace) -> None:
    lib = ScriptLibrary(target.client, keyspace, visibility_ms=200)
    lib.publish("slow", "task")
    (delivery,) = lib.consume(["slow"], 1).deliveries
    deadline = int(lib.client.zscore(keyspace.index("slow"), delivery.id))
    wait_for_server_time(lib.client, deadline + 1)
    assert lib.sweep(["slow"]).requeued == 1
    assert lib.ack("slow", [delivery.id]) == 1  # the slow worker finished after all
    assert target.keys() == defining_keys(keyspace, ("slow",))


def publish_expiring(lib: ScriptLibrary, queue: str, count: int, ttl_ms: int = 100) -> list[str]:
    """``count`` messages with a TTL; waits until the server's clock is past every deadline."""
    before = server_now_ms(lib.client)
    ids = [lib.publish(queue, f"m{i}", ttl_ms=ttl_ms) for i in range(count)]
    after = server_now_ms(lib.client)
    deadlines = []
    for message_id in ids:  # the TTL is a deadline in the message's state, not a key TTL
        state, delivery_count, priority, expires_at = message_state(lib.client, lib.keys, queue, message_id)
        assert (state, delivery_count, priority) == ("ready", 0, 0)
        assert before + ttl_ms <= int(expires_at) <= after + ttl_ms
        deadlines.append(int(expires_at))
    assert lib.client.pttl(lib.keys.message(queue)) == -1
    wait_for_server_time(lib.client, max(deadlines) + 1)
    return ids


@pytest.mark.parametrize("by", ["consume", "sweep"])
def test_expired_messages_leave_nothing_behind(target: Target, keyspace: Keyspace, by: str) -> None:
    """With dead-lettering off (maxlen 0), whoever finds an expired message deletes it."""
    lib = ScriptLibrary(target.client, keyspace, Policy(visibility_ms=60_000, dead_letter_maxlen=0))
    publish_expiring(lib, "short", 3)
    if by == "consume":
        consumed = lib.consume(["short"], 10)
        assert (consumed.deliveries, consumed.expired) == ([], 3)
    else:
        report = lib.sweep(["short"])  # dead_letter_maxlen 0: the library's policy
        assert (report.expired, report.limit_reached, report.backlog) == (3, 0, 0)
        assert {d.reason for d in report.dropped_messages} == {"expired"}
    assert target.keys() == defining_keys(lib.keys, ("short",))


def test_expired_messages_dead_lettered_leave_only_their_dead_letters(
        target: Target, lib: ScriptLibrary) -> None:
    ids = publish_expiring(lib, "short", 3)
    assert lib.sweep(["short"]).expired == 3
    letters = lib.dead_list("short")
    assert [(d.id, d.reason) for d in letters] == [(i, "expired") for i in ids]
    assert target.keys() == defining_keys(lib.keys, ("short",)) | {lib.keys.dead("short").encode()}


def test_replayed_dead_letters_leave_nothing_behind(target: Target, lib: ScriptLibrary) -> None:
    ids = [lib.publish("dlq", f"m{i}") for i in range(3)]
    lib.consume(["dlq"], 3)
    assert lib.reject("dlq", ids, requeue=False).dead_lettered == 3
    assert len(lib.dead_replay("dlq")) == 3  # every dead letter goes back to the queue
    replayed = lib.consume(["dlq"], 10).deliveries
    assert lib.ack("dlq", [d.id for d in replayed]) == 3
    assert target.keys() == defining_keys(lib.keys, ("dlq",))


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_purge_leaves_only_defining_keys(target: Target, lib: ScriptLibrary, bound: bool) -> None:
    if bound:
        bind_all(lib)
    published, _ = publish_mix(lib)
    per_queue = len(published) // len(QUEUES)
    for queue in QUEUES:
        assert lib.purge(queue) == per_queue
    assert target.keys() == defining_keys(lib.keys, bound=bound)


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_delete_removes_meta_and_dead_letters_too(target: Target, lib: ScriptLibrary, bound: bool) -> None:
    if bound:
        bind_all(lib)
    published, _ = publish_mix(lib)
    in_flight = lib.consume(list(QUEUES), 6).deliveries
    dead = in_flight[0]
    assert lib.reject(dead.queue, [dead.id], requeue=False).dead_lettered == 1
    assert lib.client.xlen(lib.keys.dead(dead.queue)) == 1

    deleted = sum(lib.delete(queue).messages for queue in QUEUES)
    assert deleted == len(published) - 1  # every message but the dead-lettered one
    assert target.keys() == (defining_keys(lib.keys, (), bound=bound))
