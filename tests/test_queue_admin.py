"""Queue administration: purge, delete, size, stats, declare counts, dead letters.

purge drops ready and delayed messages (not in-flight ones) in bounded batches; delete
drops everything of a queue in one call (it unlinks the queue's seven keys: in-flight
messages, arguments and dead letters included) and says how many messages it held; stats
count per queue across cluster slots; dead letters can be listed page by page, replayed as
fresh messages (new ids, delivery count 0) and purged.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery_redis_lua import Declared, Deleted, Keyspace, QueueStats, ScriptLibrary
from conftest import Target
from helpers import (
    id_microseconds,
    is_message_id,
    message_exists,
    names_on_each_node,
    server_now_ms,
    wait_for_server_time,
)

LATER = 3_600_000  # an ETA an hour away: delayed for the whole test


def exists(lib: ScriptLibrary, queue: str, ids: Sequence[str]) -> list[bool]:
    return [message_exists(lib.client, lib.keys, queue, i) for i in ids]


def keys_of(target: Target, queue: str) -> set[bytes]:
    """Every key on the server that belongs to ``queue`` (carries its hash tag)."""
    every_key = target.keys()
    return {key for key in every_key if b"{" + queue.encode() + b"}" in key}


def later(lib: ScriptLibrary) -> int:
    return server_now_ms(lib.client) + LATER


def test_purge_drops_ready_and_delayed_but_not_in_flight(target: Target, lib: ScriptLibrary) -> None:
    ready = [lib.publish("p", f"r{i}") for i in range(5)]
    delayed = [lib.publish("p", f"d{i}", eta_ms=later(lib)) for i in range(2)]
    in_flight = [d.id for d in lib.consume(["p"], 2).deliveries]
    assert in_flight == ready[:2]

    assert lib.purge("p") == 5
    assert exists(lib, "p", ready[2:] + delayed) == [False] * 5
    assert exists(lib, "p", in_flight) == [True, True]
    assert [m.decode() for m in lib.client.zrange(lib.keys.index("p"), 0, -1)] == in_flight
    assert lib.stats(["p"]) == [QueueStats("p", 0, 0, 2, 0)]
    assert lib.consume(["p"], 10).deliveries == []

    assert lib.ack("p", in_flight) == 2  # in-flight work still completes normally
    assert target.keys() == {lib.keys.meta("p").encode()}


def test_purge_of_a_large_queue_runs_in_batches(target: Target, lib: ScriptLibrary) -> None:
    eta = later(lib)
    lib.run_many([lib.calls.publish("big", f"m{i}") for i in range(4_600)]
                 + [lib.calls.publish("big", f"d{i}", eta_ms=eta) for i in range(400)])
    assert lib.stats(["big"]) == [QueueStats("big", 4_600, 400, 0, 0)]

    purged, remaining = lib.run(lib.calls.purge("big", batch=1_000))
    assert purged == 1_000
    assert remaining == 4_000
    assert lib.size("big") == 3_600

    assert lib.purge("big", batch=1_000) == 4_000
    assert lib.stats(["big"]) == [QueueStats("big", 0, 0, 0, 0)]
    assert target.keys() == {lib.keys.meta("big").encode()}


def test_delete_removes_everything_of_the_queue_only(target: Target, lib: ScriptLibrary) -> None:
    keys = lib.keys
    lib.declare("doomed", max_priority=10)
    ready = [lib.publish("doomed", f"r{i}", priority=i) for i in range(6)]
    delayed = lib.publish("doomed", "later", eta_ms=later(lib))
    taken = lib.consume(["doomed"], 3).deliveries
    assert lib.reject("doomed", [taken[0].id], requeue=False).dead_lettered == 1
    in_flight = [d.id for d in taken[1:]]
    survivor = lib.publish("other", "keep me")

    assert lib.delete("doomed") == Deleted(6)  # 3 ready + 1 delayed + 2 in flight
    assert exists(lib, "doomed", [*ready, delayed]) == [False] * 7
    assert keys_of(target, "doomed") == set()  # meta and the dead letters went too
    assert lib.ack("doomed", in_flight) == 0
    assert lib.exists("doomed") is False
    other = {keys.meta("other"), keys.queue("other"), keys.wake("other"), keys.message("other"),
             keys.state("other")}
    assert target.keys() == {k.encode() for k in other}
    assert message_exists(lib.client, keys, "other", survivor)
    assert [d.payload for d in lib.consume(["other"], 5).deliveries] == [b"keep me"]


def test_delete_is_one_call_that_unlinks_every_key_of_the_queue(target: Target, lib: ScriptLibrary) -> None:
    """No batches any more: the messages live in the queue's own two hashes, so one call
    unlinks all seven keys (the server frees big ones in the background)."""
    lib.declare("gone", expires_ms=600_000, max_priority=3)
    ids = [lib.publish("gone", f"m{i}") for i in range(5)]
    ids.append(lib.publish("gone", "later", eta_ms=later(lib)))
    taken = lib.consume(["gone"], 2).deliveries
    assert lib.reject("gone", [taken[0].id], requeue=False).dead_lettered == 1
    assert {k.decode() for k in keys_of(target, "gone")} == set(lib.keys.queue_keys("gone"))

    assert lib.run(lib.calls.delete("gone")) == Deleted(5)  # 3 ready, 1 delayed, 1 in flight
    assert target.keys() == set()
    assert lib.run(lib.calls.delete("gone")) == Deleted(0)  # nothing left; and nothing created
    assert target.keys() == set()

    # Declared again under the same name, the queue starts empty and without its old arguments,
    # and (in a later server ms: see the next test for the same one) its ids stay above the
    # old ones, so a late ack of an old delivery touches nothing.
    wait_for_server_time(lib.client, id_microseconds(max(ids)) // 1000 + 1)
    declared = lib.declare("gone")
    assert declared == Declared(0, 0, 0, None, None, None)
    reborn = lib.publish("gone", "reborn")
    assert reborn > max(ids)
    assert lib.ack("gone", [d.id for d in taken]) == 0
    assert [d.payload for d in lib.consume(["gone"], 10).deliveries] == [b"reborn"]


def test_ids_are_not_reused_by_a_publish_right_after_delete(lib: ScriptLibrary) -> None:
    """publish.lua and delete.lua promise ids that are never used twice for one queue name,
    even after the queue was deleted. Publish, delete and publish again in one pipeline (the
    server runs them back to back, within one ms): the second id must differ, or a late
    ack of the first delivery deletes the second message."""
    for _ in range(50):
        first, held, second = lib.run_many([lib.calls.publish("again", "old"), lib.calls.delete("again"),
                                            lib.calls.publish("again", "new")])
        assert held == Deleted(1)
        assert second > first
        assert lib.ack("again", [first]) == 0
        assert lib.size("again") == 1
        lib.delete("again")


def test_size_counts_ready_messages_only(lib: ScriptLibrary) -> None:
    assert lib.size("s") == 0
    for i in range(3):
        lib.publish("s", f"m{i}")
    lib.publish("s", "later", eta_ms=later(lib))  # delayed: not ready
    assert lib.size("s") == 3
    lib.consume(["s"], 1)
    assert lib.size("s") == 2


def queues_in_different_slots(target: Target, keys: Keyspace) -> list[str]:
    if target.is_cluster:
        return names_on_each_node(target.client, keys, stem="stat")
    names = ["stat-a", "stat-b", "stat-c"]
    assert len({keys.slot(n) for n in names}) == 3
    return names


def test_stats_per_queue_across_slots(target: Target, lib: ScriptLibrary) -> None:
    a, b, c = queues_in_different_slots(target, lib.keys)
    lib.publish(a, "a1")
    lib.publish(a, "a2")
    lib.publish(b, "b1")
    lib.consume([b], 1)  # in flight
    lib.publish(b, "b-later", eta_ms=later(lib))
    lib.publish(c, "c1")
    lib.publish(c, "c2")
    (first,) = lib.consume([c], 1).deliveries
    lib.reject(c, [first.id], requeue=False)

    expected = [QueueStats(a, 2, 0, 0, 0), QueueStats(b, 0, 1, 1, 0), QueueStats(c, 1, 0, 0, 1),
                QueueStats("never-used", 0, 0, 0, 0)]
    assert lib.stats([a, b, c, "never-used"]) == expected
    assert lib.stats([c, "never-used", a, b]) == [expected[i] for i in (2, 3, 0, 1)]


def test_declare_returns_counts(lib: ScriptLibrary) -> None:
    counts = lib.declare("d")
    assert (counts.ready, counts.delayed, counts.in_flight) == (0, 0, 0)
    for i in range(3):
        lib.publish("d", f"m{i}")
    lib.publish("d", "later", eta_ms=later(lib))
    lib.consume(["d"], 1)
    counts = lib.declare("d", max_priority=5)
    assert (counts.ready, counts.delayed, counts.in_flight) == (2, 1, 1)


def test_counts_of_a_delayed_message_and_its_wake_token(lib: ScriptLibrary) -> None:
    """A delayed publish pushes a wake token (in wake:{Q}, not queue:{Q}); no count sees it,
    and in_flight (stored minus ready and delayed) stays 0."""
    lib.publish("w", "later", eta_ms=later(lib))
    assert lib.client.lrange(lib.keys.wake("w"), 0, -1) == [b"1"]
    assert lib.client.exists(lib.keys.queue("w")) == 0
    counts = lib.declare("w")
    assert (counts.ready, counts.delayed, counts.in_flight) == (0, 1, 0)
    assert lib.stats(["w"]) == [QueueStats("w", 0, 1, 0, 0)]


def make_dead_letters(lib: ScriptLibrary, queue: str, priorities: Sequence[int]) -> list[str]:
    """Dead letters in publish order; the second one was redelivered once first."""
    ids = [lib.publish(queue, f"m{i}", priority=p) for i, p in enumerate(priorities)]
    taken = lib.consume([queue], len(ids)).deliveries
    assert {d.id for d in taken} == set(ids)
    lib.reject(queue, [ids[1]], requeue=True)
    assert [d.id for d in lib.consume([queue], 1).deliveries] == [ids[1]]
    assert lib.reject(queue, ids, requeue=False).dead_lettered == len(ids)
    return ids


def test_dead_letters_are_listed_page_by_page(lib: ScriptLibrary) -> None:
    ids = make_dead_letters(lib, "dl", [0, 0, 0, 9, 0])
    pages, after = [], None
    while page := lib.dead_list("dl", count=2, after=after):
        pages.append(page)
        after = page[-1].entry_id
    assert [len(p) for p in pages] == [2, 2, 1]
    letters = [letter for page in pages for letter in page]
    assert [d.id for d in letters] == ids
    assert [d.payload for d in letters] == [f"m{i}".encode() for i in range(5)]
    assert {d.reason for d in letters} == {"rejected"}
    assert [d.delivery_count for d in letters] == [0, 1, 0, 0, 0]
    assert [d.priority for d in letters] == [0, 0, 0, 9, 0]
    assert lib.stats(["dl"])[0].dead == 5
    assert lib.dead_list("dl", count=10) == letters  # one page of everything


def test_replay_chosen_entries_gives_fresh_messages(lib: ScriptLibrary) -> None:
    old_ids = make_dead_letters(lib, "rp", [0, 0, 0, 9, 0])
    letters = lib.dead_list("rp")
    chosen = [letters[1].entry_id, letters[3].entry_id]
    new_ids = lib.dead_replay("rp", entry_ids=chosen)
    assert len(new_ids) == 2
    assert not set(new_ids) & set(old_ids)
    assert min(new_ids) > max(old_ids)  # from the queue's sequence, after every old id
    assert [d.id for d in lib.dead_list("rp")] == [old_ids[0], old_ids[2], old_ids[4]]

    replayed = lib.consume(["rp"], 5).deliveries
    # Priority 9 first; delivery counts start again at 0.
    assert [(d.id, d.payload, d.delivery_count) for d in replayed] == [
        (new_ids[1], b"m3", 0), (new_ids[0], b"m1", 0)]
    assert lib.dead_replay("rp", entry_ids=["1-1"]) == []  # unknown entries are skipped


def test_an_entry_named_twice_is_replayed_once(lib: ScriptLibrary) -> None:
    """Also when named once in full and once with leading zeros: XRANGE finds the same entry
    (before version 8, both were replayed)."""
    make_dead_letters(lib, "twice", [0, 0])
    first = lib.dead_list("twice")[0].entry_id
    assert len(lib.dead_replay("twice", entry_ids=[first, first, f"0{first}"])) == 1
    assert [d.payload for d in lib.consume(["twice"], 5).deliveries] == [b"m0"]
    assert [d.payload for d in lib.dead_list("twice")] == [b"m1"]


def test_replay_with_given_payloads_replaces_each_and_skips_what_is_gone(lib: ScriptLibrary) -> None:
    make_dead_letters(lib, "given", [0, 9])
    letters = lib.dead_list("given")
    new_ids = lib.dead_replay("given", payloads={letters[0].entry_id: b"new0", "1-1": b"never",
                                                 letters[1].entry_id: b"new1"})
    assert len(new_ids) == 2 and lib.dead_list("given") == []
    delivered = lib.consume(["given"], 5).deliveries  # the priorities of the letters are kept
    assert [(d.id, d.payload) for d in delivered] == [(new_ids[1], b"new1"), (new_ids[0], b"new0")]
    assert lib.dead_replay("given", payloads={letters[0].entry_id: b"again"}) == []  # gone: skipped


def test_replay_all_and_by_count(lib: ScriptLibrary) -> None:
    make_dead_letters(lib, "ra", [0, 0, 0])
    first = lib.dead_replay("ra", count=1)
    assert len(first) == 1
    assert [d.payload for d in lib.dead_list("ra")] == [b"m1", b"m2"]
    rest = lib.dead_replay("ra")
    assert len(rest) == 2
    assert lib.stats(["ra"]) == [QueueStats("ra", 3, 0, 0, 0)]
    replayed = lib.consume(["ra"], 5).deliveries
    assert [(d.id, d.payload, d.delivery_count) for d in replayed] == [
        (first[0], b"m0", 0), (rest[0], b"m1", 0), (rest[1], b"m2", 0)]


def test_one_replay_of_many_letters_mints_distinct_ids_in_order(lib: ScriptLibrary) -> None:
    """One dead_replay call reads the clock once: past 16 letters its counter (one hex digit)
    carries into the next microsecond, and the ids stay well-formed, distinct and ordered."""
    make_dead_letters(lib, "many", [0] * 40)
    new_ids = lib.dead_replay("many")
    assert len(new_ids) == 40 and all(is_message_id(i) for i in new_ids)
    assert new_ids == sorted(set(new_ids))
    assert id_microseconds(new_ids[-1]) - id_microseconds(new_ids[0]) >= 2  # carried twice
    assert [d.payload for d in lib.consume(["many"], 40).deliveries] == [f"m{i}".encode() for i in range(40)]


def test_dead_purge(lib: ScriptLibrary) -> None:
    make_dead_letters(lib, "dp", [0, 0])
    lib.publish("dp", "alive")
    assert lib.dead_purge("dp") == 2
    assert lib.client.exists(lib.keys.dead("dp")) == 0
    assert lib.stats(["dp"]) == [QueueStats("dp", 1, 0, 0, 0)]
    assert lib.dead_purge("dp") == 0
