"""Upper bounds of every number that ends up in a script (issue 38): a queue argument, a
message property or a stored value past its bound is refused naming it, or, when an older
version or a hand left it stored, applied as its bound and named, so no later call adds
more than 10 years to the clock.

A stored x-delayed-retry-min of 10^19 ms used to break every later declare of the queue
(with "x-delayed-retry-type 'all' needs x-delayed-retry-min") and overflow reject's and the
sweep's string.format('%d'), redelivering a requeued message several times at once.
"""

from __future__ import annotations

import logging

import pytest
from kombu import Exchange, Producer, Queue

from celery_redis_lua import Keyspace, Policy, ScriptError, ScriptLibrary
from celery_redis_lua.protocol.bounds import (
    MAX_DURATION_MS,
    MAX_DURATION_SECONDS,
    MAX_LIMIT,
    MAX_STREAM_LENGTH,
)
from celery_redis_lua.protocol.retry import DISABLED, DelayedRetry
from conftest import Target
from helpers import message_state, server_now_ms, wait_for_server_time
from kombu_support import Broker

HUGE = 10**19  # what issue 38 stored: past 2^63, so string.format('%d') overflowed on it


# -- arguments past their bound: refused naming them, nothing stored -------------------------

@pytest.mark.parametrize(("arguments", "name"), [
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": HUGE}, "x-delayed-retry-min"),
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": 1, "x-delayed-retry-max": MAX_DURATION_MS + 1},
     "x-delayed-retry-max"),
    ({"x-expires": MAX_DURATION_MS + 1}, "'x-expires' must be a number of ms in 0..315360000000"),
    ({"x-message-ttl": MAX_DURATION_MS + 1}, "'x-message-ttl' must be a number of ms in 0..315360000000"),
    ({"x-message-ttl": float(HUGE)}, "'x-message-ttl'"),
    ({"x-max-priority": 256}, "'x-max-priority' must be a number in 0..255, got 256"),
], ids=["retry-min-1e19", "retry-max", "expires", "message-ttl", "message-ttl-float", "max-priority"])
def test_a_queue_argument_past_its_bound_is_refused_by_name_and_nothing_is_stored(
        kind_broker: Broker, arguments: dict, name: str) -> None:
    with kind_broker.connection() as conn:
        channel = conn.channel()
        with pytest.raises(ValueError) as raised:
            Queue("bounded", queue_arguments=arguments)(channel).declare()
        assert "'bounded'" in str(raised.value) and name in str(raised.value), str(raised.value)
        assert not channel.lib.exists("bounded")
        assert kind_broker.client.exists(kind_broker.keys.meta("bounded")) == 0


def test_a_queue_argument_at_its_bound_is_taken(kind_broker: Broker) -> None:
    arguments = {"x-expires": MAX_DURATION_MS, "x-message-ttl": MAX_DURATION_MS, "x-max-priority": 255,
                 "x-delayed-retry-type": "all", "x-delayed-retry-min": MAX_DURATION_MS,
                 "x-delayed-retry-max": MAX_DURATION_MS}
    with kind_broker.connection() as conn:
        Queue("atbound", queue_arguments=arguments)(conn.channel()).declare()
    declared = kind_broker.lib.declare("atbound")
    assert (declared.expires_ms, declared.message_ttl_ms, declared.max_priority) == (
        MAX_DURATION_MS, MAX_DURATION_MS, 255)
    assert declared.retry == DelayedRetry("all", MAX_DURATION_MS, MAX_DURATION_MS)
    assert declared.out_of_range == ()


def test_a_publish_whose_expiration_is_past_its_bound_is_refused_and_writes_nothing(
        kind_broker: Broker) -> None:
    queue = Queue("ttlq", Exchange("ttlx"), routing_key="ttlq")
    with kind_broker.connection() as conn:
        producer = Producer(conn, exchange=queue.exchange, routing_key="ttlq")
        producer.publish("first", declare=[queue])  # the queue exists: what a refused one must not move
        before = kind_broker.client.hgetall(kind_broker.keys.meta("ttlq"))
        with pytest.raises(ValueError, match=r"property 'expiration' must be at most 315360000000 ms"):
            producer.publish("far", expiration=MAX_DURATION_SECONDS + 1)  # kombu: seconds, sent as ms
        with pytest.raises(ValueError, match=r"header 'expires' is more than 315360000000 ms .* after"):
            producer.publish("far", headers={"eta": "2030-01-01T00:00:00+00:00",
                                              "expires": "2050-01-01T00:00:00+00:00"})
        producer.publish("last", expiration=MAX_DURATION_SECONDS)  # at the bound: taken
    [stats] = kind_broker.lib.stats(["ttlq"])
    assert (stats.ready, stats.delayed) == (2, 0)
    after = kind_broker.client.hgetall(kind_broker.keys.meta("ttlq"))
    assert {k: v for k, v in after.items() if k != b"last_id"} == \
        {k: v for k, v in before.items() if k != b"last_id"}


# -- stored out of range (an older version's, or set by hand): applied as the bound, named --

def stored_out_of_range(lib: ScriptLibrary, queue: str, field: str, value: int | str = HUGE) -> None:
    """``queue`` declared with a delayed retry, then ``field`` of its record set past its bound
    with HSET, as an older version (which took any positive integer) could have left it."""
    lib.declare(queue, retry=DelayedRetry("all", 1000, None))
    lib.client.hset(lib.keys.meta(queue), field, str(value))


def test_a_plain_declare_works_on_a_stored_retry_min_out_of_range_and_names_it(lib: ScriptLibrary) -> None:
    stored_out_of_range(lib, "old", "retry_min")
    declared = lib.declare("old")  # a producer's, or a worker's without retry arguments
    assert declared.retry == DelayedRetry("all", MAX_DURATION_MS, None)  # as reject and sweep apply it
    assert declared.out_of_range == ("x-delayed-retry-min=10000000000000000000",)
    with pytest.raises(ScriptError, match=r"x-delayed-retry-min stored '10000000000000000000' "
                                          r"\(out of range\), declared 1000 \(delete the queue"):
        lib.declare("old", retry=DelayedRetry("all", 1000, None))
    with pytest.raises(ScriptError, match=r"x-delayed-retry-min stored '10+' \(out of range\)"):
        lib.declare("old", retry=DelayedRetry("all", MAX_DURATION_MS, None))  # its bound is no fix either
    assert lib.client.hget(lib.keys.meta("old"), "retry_min") == str(HUGE).encode()  # left for the operator


def test_a_stored_retry_max_below_a_clamped_retry_min_is_every_delay(lib: ScriptLibrary) -> None:
    stored_out_of_range(lib, "capped", "retry_min")
    lib.client.hset(lib.keys.meta("capped"), "retry_max", "60000")
    assert lib.declare("capped").retry == DelayedRetry("all", 60_000, 60_000)


def test_a_stored_retry_type_that_is_none_is_named_and_not_in_force(lib: ScriptLibrary) -> None:
    stored_out_of_range(lib, "odd", "retry_type", "sometimes")
    declared = lib.declare("odd")
    assert declared.retry == DISABLED and declared.out_of_range == ("x-delayed-retry-type=sometimes",)


def test_a_stored_expires_out_of_range_expires_the_queue_after_ten_years(lib: ScriptLibrary) -> None:
    stored_out_of_range(lib, "oldx", "expires")
    declared = lib.declare("oldx")
    assert declared.expires_ms == MAX_DURATION_MS
    assert declared.out_of_range == ("x-expires=10000000000000000000",)
    message_id = lib.publish("oldx", "kept")
    # Not a garbage time: PEXPIREAT of an overflowed (negative) time deleted the keys at once.
    assert MAX_DURATION_MS - 60_000 < lib.client.pttl(lib.keys.message("oldx")) <= MAX_DURATION_MS
    assert [d.id for d in lib.consume(["oldx"], 5).deliveries] == [message_id]


def test_a_stored_message_ttl_out_of_range_is_ten_years(lib: ScriptLibrary) -> None:
    stored_out_of_range(lib, "oldt", "message_ttl")
    before = server_now_ms(lib.client)
    message_id = lib.publish("oldt", "kept")
    deadline = int(message_state(lib.client, lib.keys, "oldt", message_id)[3])
    assert before + MAX_DURATION_MS <= deadline <= server_now_ms(lib.client) + MAX_DURATION_MS


def test_reject_of_a_queue_with_a_stored_retry_min_out_of_range_waits_instead_of_redelivering(
        lib: ScriptLibrary) -> None:
    """Issue 38: the due time overflowed string.format('%d') and the message was ready again at
    once, every time: delivered over and over. Now it waits 10 years: delivered exactly once."""
    stored_out_of_range(lib, "rq", "retry_min")
    message_id = lib.publish("rq", "again")
    [taken] = lib.consume(["rq"], 1).deliveries
    before = server_now_ms(lib.client)
    assert lib.reject("rq", [taken.id], requeue=True, counts=[taken.delivery_count]).requeued == 1
    for _ in range(5):
        assert lib.consume(["rq"], 10).deliveries == []
    due = lib.client.zscore(lib.keys.delayed("rq"), message_id)
    assert due is not None and before + MAX_DURATION_MS <= due <= server_now_ms(lib.client) + MAX_DURATION_MS
    assert message_state(lib.client, lib.keys, "rq", message_id)[:2] == ("retry", 1)  # kept, not lost
    assert lib.sweep(["rq"]).promoted == 0


def test_the_sweep_of_a_queue_with_a_stored_retry_min_out_of_range_waits_instead_of_redelivering(
        target: Target, keyspace: Keyspace) -> None:
    lib = ScriptLibrary(target.client, keyspace, visibility_ms=100)
    stored_out_of_range(lib, "sq", "retry_min")
    message_id = lib.publish("sq", "hung")
    lib.consume(["sq"], 1)
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 110)
    before = server_now_ms(lib.client)
    assert lib.sweep(["sq"]).requeued == 1
    for _ in range(5):
        assert lib.consume(["sq"], 10).deliveries == []
    due = lib.client.zscore(lib.keys.delayed("sq"), message_id)
    assert due is not None and due >= before + MAX_DURATION_MS
    assert lib.sweep(["sq"]).promoted == 0


def test_a_delay_never_passes_the_bound_however_many_deliveries(lib: ScriptLibrary) -> None:
    """No cap declared: min * delivery_count is capped at 10 years (the scripts and Python
    alike), so a due time stays an exact double below a ready score's priority band."""
    lib.declare("long", retry=DelayedRetry("all", MAX_DURATION_MS, None))
    message_id = lib.publish("long", "slow")
    [taken] = lib.consume(["long"], 1).deliveries
    lib.client.hset(lib.keys.state("long"), message_id, "unacked 10 0 -")  # its 11th delivery
    before = server_now_ms(lib.client)
    lib.reject("long", [taken.id], requeue=True)
    due = lib.client.zscore(lib.keys.delayed("long"), message_id)
    assert due is not None and before + MAX_DURATION_MS <= due <= server_now_ms(lib.client) + MAX_DURATION_MS
    assert DelayedRetry("all", MAX_DURATION_MS, None).delay_ms(11) == MAX_DURATION_MS


def test_a_worker_declares_a_queue_with_a_stored_retry_min_out_of_range_and_logs_it(
        kind_broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    stored_out_of_range(kind_broker.lib, "legacy", "retry_min")
    with kind_broker.connection() as conn, caplog.at_level(logging.WARNING):
        Queue("legacy")(conn.channel()).declare()  # failed with "... needs x-delayed-retry-min"
    assert "queue 'legacy' has stored arguments out of range: x-delayed-retry-min=10000000000000000000; " \
        "past its bound one is applied as the bound" in caplog.text


def test_a_policy_whose_visibility_is_past_the_bound_is_refused() -> None:
    """The scripts' visibility_ms is bounded too; a ScriptLibrary built without the
    transport's options (a producer, a tool) is refused before any call."""
    assert Policy(visibility_ms=MAX_DURATION_MS).visibility_ms == MAX_DURATION_MS
    with pytest.raises(ValueError, match=r"visibility_ms must be an integer in 1\.\.315360000000, got 3"):
        Policy(visibility_ms=MAX_DURATION_MS + 1)


@pytest.mark.parametrize("script", ["consume", "extend", "unpop", "dead_replay", "cancel", "reject", "sweep"])
def test_every_script_that_refreshes_a_stored_expires_out_of_range_keeps_the_queue(
        lib: ScriptLibrary, script: str) -> None:
    """Each refreshes all eight keys' expiry at now + expires: with 10^19 that time overflowed
    string.format('%d') and the queue's keys could expire at once. Now 10 years from now."""
    queue = "refresh"
    lib.declare(queue)
    lib.publish(queue, "dead", task_id="t-dead")
    [taken] = lib.consume([queue], 1).deliveries
    lib.reject(queue, [taken.id], requeue=False)
    kept = lib.publish(queue, "kept", task_id="t-kept")
    lib.client.hset(lib.keys.meta(queue), "expires", str(HUGE))  # as an older version might have left
    if script == "consume":
        assert [d.id for d in lib.consume([queue], 1).deliveries] == [kept]
    elif script == "extend":
        lib.extend(queue, [kept])
    elif script == "unpop":
        lib.unpop(queue)
    elif script == "dead_replay":
        assert len(lib.dead_replay(queue)) == 1  # published again, under a new id
    elif script == "reject":
        assert lib.reject(queue, [kept], requeue=True).requeued == 1
    elif script == "sweep":
        lib.sweep([queue])
    else:
        lib.cancel(queue, "t-kept")
    ttl = lib.client.pttl(lib.keys.meta(queue))
    assert MAX_DURATION_MS - 60_000 < ttl <= MAX_DURATION_MS, ttl
    assert lib.client.exists(lib.keys.message(queue)) == (0 if script == "cancel" else 1)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("delivery_limit", MAX_LIMIT + 1, r"delivery_limit must be an integer in 0\.\.1000000 or None"),
    ("dead_letter_maxlen", MAX_STREAM_LENGTH + 1,
     r"dead_letter_maxlen must be an integer in 0\.\.1000000000"),
])
def test_a_policy_whose_count_is_past_its_bound_is_refused(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy(**{field: value})
