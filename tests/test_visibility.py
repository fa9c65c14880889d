"""Visibility: an unacked delivery comes back after its deadline with delivery_count 1;
extend keeps it away; ack after a restore cancels the restored copy; a ready message has
no index entry, and the entries older scripts gave ready messages are settled uncounted;
no-ack consume leaves nothing behind. Deadlines are judged by the server's clock."""

from __future__ import annotations

from typing import Any

import pytest

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.ops import Rejected, SweepReport
from conftest import Target
from helpers import message_exists, message_state, server_now_ms, wait_for_server_time

VISIBILITY_MS = 200


@pytest.fixture
def vlib(target: Target, keyspace: Keyspace) -> ScriptLibrary:
    """The script library with a tiny visibility timeout, on every server kind."""
    return ScriptLibrary(target.client, keyspace, visibility_ms=VISIBILITY_MS)


def index_time(lib: ScriptLibrary, queue: str, message_id: str) -> int | None:
    score = lib.client.zscore(lib.keys.index(queue), message_id)
    return None if score is None else int(score)


def sweep_after_index_time(lib: ScriptLibrary, queue: str, message_id: str) -> SweepReport:
    """Wait until the server clock passes the message's index time, then sweep."""
    due = index_time(lib, queue, message_id)
    assert due is not None, f"{message_id} is not indexed"
    wait_for_server_time(lib.client, due)
    return lib.sweep([queue])


def counts(report: SweepReport) -> tuple[int, ...]:
    return (report.promoted, report.requeued, report.unclaimed, report.backlog,
            report.limit_reached + report.expired, report.orphans)


def zmpop(client: Any, key: str, count: int) -> list[str]:
    """What a blocking consumer of scripts before version 6 did (BZMPOP): pop members
    straight off the queue zset."""
    reply = client.execute_command("ZMPOP", 1, key, "MIN", "COUNT", count)
    assert reply is not None and reply[0] == key.encode()
    return [member.decode() for member, _ in reply[1]]


def test_unacked_delivery_comes_back_after_its_deadline_counted(vlib: ScriptLibrary) -> None:
    message_id = vlib.publish("vis", "work")
    before = server_now_ms(vlib.client)
    [first] = vlib.consume(["vis"], 5).deliveries
    assert (first.id, first.delivery_count) == (message_id, 0)
    deadline = index_time(vlib, "vis", message_id)
    assert deadline is not None and deadline >= before + VISIBILITY_MS
    assert vlib.consume(["vis"], 5).deliveries == []  # in flight, not ready

    report = sweep_after_index_time(vlib, "vis", message_id)
    assert counts(report) == (0, 1, 0, 0, 0, 0)
    [again] = vlib.consume(["vis"], 5).deliveries
    assert (again.id, again.delivery_count, again.payload) == (message_id, 1, b"work")


def test_extend_keeps_a_delivery_away(vlib: ScriptLibrary, target: Target, keyspace: Keyspace) -> None:
    message_id = vlib.publish("vis", "long task")
    vlib.consume(["vis"], 1)
    deadline = index_time(vlib, "vis", message_id)
    assert deadline is not None

    heartbeat = ScriptLibrary(target.client, keyspace, visibility_ms=60_000)
    assert heartbeat.extend("vis", [message_id, "00000000000000ff"]) == 1  # unknown id ignored
    extended = index_time(vlib, "vis", message_id)
    assert extended is not None and extended >= deadline + 60_000 - VISIBILITY_MS

    wait_for_server_time(target.client, deadline + 1)
    assert counts(vlib.sweep(["vis"])) == (0, 0, 0, 0, 0, 0)
    assert vlib.consume(["vis"], 5).deliveries == []
    assert index_time(vlib, "vis", message_id) == extended
    assert vlib.ack("vis", [message_id]) == 1


def test_extend_does_not_resurrect_an_acked_message(vlib: ScriptLibrary) -> None:
    message_id = vlib.publish("vis", "done")
    vlib.consume(["vis"], 1)
    assert vlib.ack("vis", [message_id]) == 1
    assert vlib.extend("vis", [message_id]) == 0
    assert index_time(vlib, "vis", message_id) is None


def test_extend_moves_thousands_of_ids_across_its_chunks(vlib: ScriptLibrary, target: Target,
                                                        keyspace: Keyspace) -> None:
    """A keeper with a deep prefetch extends thousands at once: the script takes them 2,000 at
    a time (two calls per chunk); every indexed id of every chunk moves, none that is not."""
    vlib.run_many([vlib.calls.publish("vis", f"m{i}") for i in range(4_500)])
    taken = [d.id for d in vlib.consume(["vis"], 4_500).deliveries]
    assert len(taken) == 4_500
    acked = taken[1_999:2_002] + taken[-1:]  # at a chunk's edge, and the very last
    assert vlib.ack("vis", acked) == len(acked)
    heartbeat = ScriptLibrary(target.client, keyspace, visibility_ms=60_000)
    before = server_now_ms(target.client)
    assert heartbeat.extend("vis", [*taken, "00000000000000ff"]) == len(taken) - len(acked)
    deadlines = dict(target.client.zrange(keyspace.index("vis"), 0, -1, withscores=True))
    assert {k.decode() for k in deadlines} == set(taken) - set(acked)  # nothing resurrected
    assert min(deadlines.values()) >= before + 60_000


def test_ack_after_restore_cancels_the_restored_copy(vlib: ScriptLibrary, target: Target) -> None:
    message_id = vlib.publish("vis", "slow but fine")
    vlib.consume(["vis"], 1)
    assert sweep_after_index_time(vlib, "vis", message_id).requeued == 1
    assert vlib.size("vis") == 1  # restored, ready again

    assert vlib.ack("vis", [message_id]) == 1  # the slow worker finishes after all
    client = target.client
    assert vlib.size("vis") == 0
    assert client.exists(vlib.keys.queue("vis")) == 0
    assert index_time(vlib, "vis", message_id) is None
    assert not message_exists(client, vlib.keys, "vis", message_id)
    assert vlib.consume(["vis"], 5).deliveries == []


@pytest.mark.parametrize("requeue", [True, False])
def test_a_late_reject_of_a_delivery_made_again_since_is_left_alone(
        vlib: ScriptLibrary, requeue: bool) -> None:
    """Found by the chaos harness: a worker whose heartbeat had stopped handed back a
    message that the sweep had meanwhile restored and another worker held, so it was put
    back in the queue under that worker and ran a third time. Fenced by the count."""
    message_id = vlib.publish("vis", "contested")
    [first] = vlib.consume(["vis"], 1).deliveries  # worker A: delivery 0
    assert sweep_after_index_time(vlib, "vis", message_id).requeued == 1
    [second] = vlib.consume(["vis"], 1).deliveries  # worker B: delivery 1, in flight
    assert (first.delivery_count, second.delivery_count) == (0, 1)

    late = vlib.reject("vis", [message_id], requeue=requeue, counts=[first.delivery_count])
    assert late == Rejected(0, 0, 0, stale=1)
    [stats] = vlib.stats(["vis"])
    assert (stats.ready, stats.in_flight, stats.dead) == (0, 1, 0)  # still B's
    assert message_state(vlib.client, vlib.keys, "vis", message_id)[:2] == ("unacked", 1)

    # B's own reject (its count) acts as before.
    assert vlib.reject("vis", [message_id], requeue=True, counts=[1]) == Rejected(1, 0, 0)
    [third] = vlib.consume(["vis"], 1).deliveries
    assert third.delivery_count == 2
    # An unfenced id keeps the old meaning (foreign consumers, the CLI).
    assert vlib.reject("vis", [message_id], requeue=False) == Rejected(0, 1, 0)


def legacy_ready_entry(lib: ScriptLibrary, queue: str, message_id: str) -> None:
    """The index entry scripts before version 6 gave every ready message (publish time +
    visibility): a keyspace written by them may still hold some."""
    lib.client.zadd(lib.keys.index(queue), {message_id: server_now_ms(lib.client)})


def test_a_message_popped_under_older_scripts_and_never_claimed_is_restored_uncounted(
        vlib: ScriptLibrary, target: Target) -> None:
    message_id = vlib.publish("pop", "lost pop")
    legacy_ready_entry(vlib, "pop", message_id)
    assert zmpop(target.client, vlib.keys.queue("pop"), 1) == [message_id]
    assert vlib.size("pop") == 0  # that consumer died between its BZMPOP and claim

    report = sweep_after_index_time(vlib, "pop", message_id)
    assert counts(report) == (0, 0, 1, 0, 0, 0)
    assert index_time(vlib, "pop", message_id) is None  # ready again, and no TTL: no entry
    assert target.client.lrange(vlib.keys.wake("pop"), 0, -1) == [b"1"]  # made ready: a wake
    [delivery] = vlib.consume(["pop"], 5).deliveries
    assert (delivery.id, delivery.delivery_count) == (message_id, 0)


def test_an_older_scripts_entry_of_a_waiting_message_is_dropped_not_counted(
        vlib: ScriptLibrary, target: Target) -> None:
    message_id = vlib.publish("backlog", "waiting")
    assert index_time(vlib, "backlog", message_id) is None
    legacy_ready_entry(vlib, "backlog", message_id)
    report = sweep_after_index_time(vlib, "backlog", message_id)
    assert counts(report) == (0, 0, 0, 1, 0, 0)
    assert index_time(vlib, "backlog", message_id) is None
    assert vlib.size("backlog") == 1
    assert message_state(target.client, vlib.keys, "backlog", message_id)[:2] == ("ready", 0)
    [delivery] = vlib.consume(["backlog"], 5).deliveries
    assert (delivery.id, delivery.delivery_count) == (message_id, 0)


def test_waiting_in_the_queue_is_never_looked_at_by_the_sweep(vlib: ScriptLibrary, target: Target) -> None:
    """A ready message without a TTL has no index entry, so no sweep touches it however
    long it waits (a backlog of a million costs the sweep nothing)."""
    message_id = vlib.publish("idle", "waiting")
    wait_for_server_time(target.client, server_now_ms(target.client) + 2 * VISIBILITY_MS)
    assert counts(vlib.sweep(["idle"])) == (0, 0, 0, 0, 0, 0)
    assert target.client.exists(vlib.keys.index("idle")) == 0
    [delivery] = vlib.consume(["idle"], 5).deliveries
    assert (delivery.id, delivery.delivery_count) == (message_id, 0)


def test_no_ack_consume_leaves_nothing_behind(vlib: ScriptLibrary, target: Target) -> None:
    ids = [vlib.publish("noack", f"m{i}") for i in range(3)]
    got = vlib.consume(["noack"], 10, no_ack=True).deliveries
    assert [(d.id, d.payload) for d in got] == [(i, f"m{n}".encode()) for n, i in enumerate(ids)]

    client = target.client
    for message_id in ids:
        assert not message_exists(client, vlib.keys, "noack", message_id)
    assert client.exists(vlib.keys.index("noack"), vlib.keys.message("noack"), vlib.keys.state("noack")) == 0
    # Only the queue's definition (meta: its arguments and last id) remains.
    assert target.keys() == {vlib.keys.meta("noack").encode()}

    wait_for_server_time(client, server_now_ms(client) + VISIBILITY_MS + 1)
    assert counts(vlib.sweep(["noack"])) == (0, 0, 0, 0, 0, 0)
    assert vlib.consume(["noack"], 10).deliveries == []
