"""A batch in one publish call (issue 41 §1): what as many publishes in a row would store, each
message's own reply in its place, and a bad message refusing the whole call with nothing
written. The model (tests/test_model.py) proves the batch against every other script; these
show each case a producer meets, by name."""

from __future__ import annotations

import pytest

from celery_redis_lua import Dedup, Published, ScriptError, ScriptLibrary
from celery_redis_lua.protocol.ops import Outgoing, StaleRoute, publish_many
from celery_redis_lua.protocol.ops.delivery import MAX_BATCH
from helpers import server_now_ms


def batch(lib: ScriptLibrary, queue: str, *messages: Outgoing) -> list[Published | StaleRoute]:
    return lib.publish_many(queue, list(messages))


def drain(lib: ScriptLibrary, queue: str) -> list[bytes]:
    """The payloads of ``queue`` in delivery order."""
    return [d.payload for d in lib.consume([queue], 1000, no_ack=True).deliveries]


def test_a_batch_delivers_as_the_same_publishes_in_a_row_deliver(lib: ScriptLibrary) -> None:
    lib.declare("one")
    lib.declare("many")
    messages = [Outgoing(f"m{i}", priority=p, task_id=f"t{i}") for i, p in enumerate([0, 9, 5, 9, 0, 255])]
    singles = [lib.publish("one", m.payload, priority=m.priority, task_id=m.task_id) for m in messages]
    replies = batch(lib, "many", *messages)
    assert all(isinstance(r, Published) for r in replies)
    ids = [str(r) for r in replies]
    assert len(set(ids)) == len(messages) and ids == sorted(ids), "ids only grow, in the batch's order"
    for queue, stored in (("one", singles), ("many", replies)):  # the task index finds each
        for m, message_id in zip(messages, stored, strict=True):
            assert lib.locate(queue, m.task_id or "").id == str(message_id)
    assert drain(lib, "many") == drain(lib, "one") == [b"m5", b"m1", b"m3", b"m2", b"m0", b"m4"]


def test_a_delayed_and_an_expiring_message_in_a_batch_are_each_where_a_publish_puts_it(
        lib: ScriptLibrary) -> None:
    lib.declare("q")
    eta = server_now_ms(lib.client) + 60_000
    now, later, short = batch(lib, "q", Outgoing("now"), Outgoing("later", eta_ms=eta),
                              Outgoing("short", ttl_ms=50_000))
    assert lib.client.zscore(lib.keys.delayed("q"), str(later)) == eta
    assert lib.client.zscore(lib.keys.index("q"), str(short)) is not None, "indexed at its TTL"
    assert lib.client.zscore(lib.keys.index("q"), str(now)) is None, "a plain ready message needs no entry"
    assert drain(lib, "q") == [b"now", b"short"]


def test_the_same_task_twice_in_a_batch_is_stored_once_and_a_retry_twice(lib: ScriptLibrary) -> None:
    """kombu's retried publish (same task id, same payload) is the first copy; a Celery retry
    (same task id, another payload) is a message of its own that takes the index over."""
    lib.declare("q")
    first, again, retry = batch(lib, "q", Outgoing("body", task_id="t"), Outgoing("body", task_id="t"),
                                Outgoing("retried", task_id="t"))
    assert again == first and retry != first
    assert lib.locate("q", "t").id == str(retry)
    assert drain(lib, "q") == [b"body", b"retried"]


def test_a_stale_route_refuses_its_own_message_and_stores_the_others(lib: ScriptLibrary) -> None:
    lib.declare("q")
    looked_up = server_now_ms(lib.client) - 10
    lib.rerouted("q", "tasks", looked_up + 5)  # the bindings changed after that lookup
    fresh, stale, plain = batch(lib, "q", Outgoing("fresh", route=("tasks", looked_up + 5)),
                                Outgoing("stale", route=("tasks", looked_up)), Outgoing("plain"))
    assert isinstance(fresh, StaleRoute), "a route looked up in the very ms of the change is refused too"
    assert isinstance(stale, StaleRoute) and stale.changed_ms == looked_up + 5
    assert isinstance(plain, Published)
    assert drain(lib, "q") == [b"plain"]


def test_a_dedup_id_held_by_an_earlier_message_of_the_batch_drops_the_later(lib: ScriptLibrary) -> None:
    """A message with a dedup id reads its hold from the server: what the batch gathered
    before it is written first, so the hold of the batch's own first message counts."""
    lib.declare("q")
    held, dropped, replaced = batch(lib, "q", Outgoing("a", dedup=Dedup("r:1")),
                                    Outgoing("b", dedup=Dedup("r:1")),
                                    Outgoing("c", dedup=Dedup("r:2", "debounce")))
    assert isinstance(dropped, Published) and dropped.deduplicated and dropped == held
    newest = batch(lib, "q", Outgoing("d", dedup=Dedup("r:2", "debounce")), Outgoing("e"))[0]
    assert isinstance(newest, Published) and newest.replaced == str(replaced)
    assert drain(lib, "q") == [b"a", b"d", b"e"]


def test_a_bad_message_refuses_the_whole_batch_by_its_number_and_nothing_is_written(
        lib: ScriptLibrary) -> None:
    lib.declare("q")
    lib.publish("q", "before")
    keys = list(lib.keys.queue_keys("q"))
    state = {k: lib.client.dump(k) for k in keys}
    with pytest.raises(ScriptError,
                       match=r"publish: message 2: priority must be an integer in 0\.\.255, got '300'"):
        batch(lib, "q", Outgoing("fine"), Outgoing("bad", priority=300), Outgoing("fine too"))
    with pytest.raises(ScriptError, match="publish: message 3: payload is missing or empty"):
        batch(lib, "q", Outgoing("fine"), Outgoing("fine too"), Outgoing(""))
    assert {k: lib.client.dump(k) for k in keys} == state
    assert drain(lib, "q") == [b"before"]


def test_a_batch_is_one_call_of_at_most_3999_arguments(lib: ScriptLibrary) -> None:
    """ElastiCache Serverless refuses a request of more than 3,999 arguments."""
    call = publish_many(lib.keys, lib.policy, "q", [Outgoing(f"m{i}") for i in range(MAX_BATCH)])
    assert 3 + len(call.keys) + len(call.args) <= 3_999  # EVALSHA, the sha, numkeys
    with pytest.raises(ValueError, match=f"1..{MAX_BATCH} messages per call, got {MAX_BATCH + 1}"):
        publish_many(lib.keys, lib.policy, "q", [Outgoing("m")] * (MAX_BATCH + 1))
    lib.declare("q")
    assert len(lib.run(call)) == MAX_BATCH
    assert len(drain(lib, "q")) == MAX_BATCH


def test_the_script_refuses_a_batch_of_the_wrong_width(lib: ScriptLibrary) -> None:
    """A producer in another language gets the layout by name when it miscounts."""
    lib.declare("q")
    call = publish_many(lib.keys, lib.policy, "q", [Outgoing("a"), Outgoing("b")])
    broken = type(call)(call.script, call.keys, [*call.args, "extra"], call.decode)
    with pytest.raises(ScriptError, match=r"expected 5, 6, 8, 11 or 12 arguments, or 12 per message for "
                                          r"2\.\.1000 messages, got 25"):
        lib.run(broken)
    assert drain(lib, "q") == []
