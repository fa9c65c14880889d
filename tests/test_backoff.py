"""Redelivery backoff: RabbitMQ 4.3's delayed retry (x-delayed-retry-type/min/max), stored by
declare and applied by reject and sweep (lua/). A requeue of the kind the type names waits
min(min * delivery_count, max) ms in the delayed set, priority and count kept, and is counted
as retrying until it is ready; every other requeue is ready at once. Script level on every
server kind, judged by the server's clock; then the transport's option and queue arguments.
"""

from __future__ import annotations

import pytest
from kombu import Queue

from celery_redis_lua import Keyspace, ScriptError, ScriptLibrary
from celery_redis_lua.protocol.bounds import MAX_DURATION_MS, MAX_DURATION_SECONDS
from celery_redis_lua.protocol.options import OptionError, parse_options
from celery_redis_lua.protocol.policy import Policy
from celery_redis_lua.protocol.retry import DelayedRetry
from conftest import Target
from helpers import message_state, server_now_ms, wait_for_server_time
from kombu_support import Broker

MIN_MS, MAX_MS = 300, 700


def retrying(lib: ScriptLibrary, queue: str) -> tuple[int, int]:
    """(delayed, retrying) of ``queue`` as a dashboard reads them."""
    [m] = lib.metrics([queue])
    return m.delayed, m.retrying


def state_of(lib: ScriptLibrary, queue: str, message_id: str) -> tuple[str, int, int, str]:
    state = message_state(lib.client, lib.keys, queue, message_id)
    assert state is not None, f"{message_id} has no state"
    return state


def due_at(lib: ScriptLibrary, queue: str, message_id: str) -> int:
    score = lib.client.zscore(lib.keys.delayed(queue), message_id)
    assert score is not None, f"{message_id} is not in the delayed set"
    return int(score)


def declared(lib: ScriptLibrary, queue: str, kind: str, max_ms: int | None = MAX_MS) -> None:
    lib.declare(queue, retry=DelayedRetry(kind, MIN_MS, max_ms))


def test_a_failed_requeue_waits_min_times_the_delivery_count_up_to_max(lib: ScriptLibrary) -> None:
    declared(lib, "poison", "failed")
    message_id = lib.publish("poison", "boom", priority=7)
    for count, delay in ((1, 300), (2, 600), (3, 700), (4, 700)):  # capped at max from the 3rd
        [taken] = lib.consume(["poison"], 1).deliveries
        assert (taken.id, taken.delivery_count) == (message_id, count - 1)
        before = server_now_ms(lib.client)
        assert lib.reject("poison", [message_id], requeue=True, counts=[count - 1]).requeued == 1
        due = due_at(lib, "poison", message_id)
        assert before + delay <= due <= server_now_ms(lib.client) + delay
        assert state_of(lib, "poison", message_id)[:3] == ("retry", count, 7)
        assert retrying(lib, "poison") == (1, 1)
        assert lib.consume(["poison"], 1).deliveries == []  # not before its time
        wait_for_server_time(lib.client, due)
    [last] = lib.consume(["poison"], 1).deliveries
    assert last.delivery_count == 4
    assert retrying(lib, "poison") == (0, 0)  # the counter follows the promotion


def test_the_type_decides_which_requeues_wait(lib: ScriptLibrary) -> None:
    """'failed': reject(requeue) waits, a hand-back does not; 'returned' the other way round;
    'all' both; a queue without the arguments never waits."""
    expected = {"failed": (True, False), "returned": (False, True), "all": (True, True),
                "disabled": (False, False)}
    for kind, (failed_waits, returned_waits) in expected.items():
        queue = f"kind-{kind}"
        lib.declare(queue, retry=DelayedRetry(kind, MIN_MS, MAX_MS) if kind != "disabled" else None)
        for returned, waits in ((False, failed_waits), (True, returned_waits)):
            message_id = lib.publish(queue, f"{kind} {returned}")
            [taken] = lib.consume([queue], 1).deliveries
            lib.reject(queue, [taken.id], requeue=True, counts=[0], returned=returned)
            state = state_of(lib, queue, message_id)[0]
            assert state == ("retry" if waits else "ready"), (kind, returned)
            lib.purge(queue)
        assert retrying(lib, queue) == (0, 0), kind  # purge took what waited, and its count


def test_a_delivery_that_times_out_is_a_failed_one(target: Target, keyspace: Keyspace) -> None:
    lib = ScriptLibrary(target.client, keyspace, visibility_ms=100)
    declared(lib, "hung", "failed")
    message_id = lib.publish("hung", "stuck")
    [taken] = lib.consume(["hung"], 1).deliveries
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 110)
    before = server_now_ms(lib.client)
    assert lib.sweep(["hung"]).requeued == 1
    assert state_of(lib, "hung", taken.id)[:2] == ("retry", 1)
    assert due_at(lib, "hung", message_id) >= before + MIN_MS
    assert lib.client.llen(lib.keys.wake("hung")) == 1  # a blocked consumer learns the new ETA
    wait_for_server_time(lib.client, due_at(lib, "hung", message_id))
    assert lib.sweep(["hung"]).promoted == 1  # the sweep promotes it as consume would
    assert retrying(lib, "hung") == (0, 0)
    [again] = lib.consume(["hung"], 1).deliveries
    assert (again.id, again.delivery_count) == (message_id, 1)


def test_the_delivery_limit_still_ends_the_retries(lib: ScriptLibrary) -> None:
    limited = ScriptLibrary(lib.client, lib.keys, Policy(visibility_ms=60_000, delivery_limit=2))
    declared(limited, "limited", "all")
    message_id = limited.publish("limited", "poison")
    [taken] = limited.consume(["limited"], 1).deliveries
    limited.reject("limited", [taken.id], requeue=True, counts=[0])
    wait_for_server_time(limited.client, due_at(limited, "limited", message_id))
    [taken] = limited.consume(["limited"], 1).deliveries
    assert limited.reject("limited", [taken.id], requeue=True, counts=[1]).dead_lettered == 1
    [letter] = limited.dead_list("limited")
    assert (letter.id, letter.reason, letter.delivery_count) == (message_id, "delivery-limit", 2)
    assert retrying(limited, "limited") == (0, 0)


def test_where_and_cancel_know_a_message_waiting_to_retry(lib: ScriptLibrary) -> None:
    declared(lib, "later", "failed")
    message_id = lib.publish("later", "task", task_id="t-1")
    lib.consume(["later"], 1)
    lib.reject("later", [message_id], requeue=True, counts=[0])
    found = lib.locate("later", "t-1")
    assert (found.state, found.id, found.delivery_count) == ("retry", message_id, 1)
    assert found.detail == due_at(lib, "later", message_id)
    cancelled = lib.cancel("later", "t-1")
    assert (cancelled.outcome, cancelled.was) == ("cancelled", "retry")
    assert retrying(lib, "later") == (0, 0)


def test_declare_stores_the_arguments_and_refuses_other_ones(lib: ScriptLibrary) -> None:
    declared = lib.declare("args", retry=DelayedRetry("returned", 1000, 5000))
    assert declared.retry == DelayedRetry("returned", 1000, 5000)
    assert lib.declare("args").retry == DelayedRetry("returned", 1000, 5000)  # a producer's: kept
    with pytest.raises(ScriptError, match="x-delayed-retry-min stored 1000, declared 2000"):
        lib.declare("args", retry=DelayedRetry("returned", 2000, 5000))
    assert lib.declare("args", retry=DelayedRetry("returned", 1000, 5000)).retry.min_ms == 1000


@pytest.mark.parametrize(("arguments", "message"), [
    ({"x-delayed-retry-type": "sometimes", "x-delayed-retry-min": 10}, "x-delayed-retry-type must be one of"),
    ({"x-delayed-retry-type": "failed"}, "x-delayed-retry-type 'failed' needs x-delayed-retry-min"),
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": -5}, "x-delayed-retry-min must be a positive"),
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": "1s"}, "x-delayed-retry-min must be a positive"),
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": 100, "x-delayed-retry-max": 10},
     "x-delayed-retry-max 10 is below x-delayed-retry-min 100"),
    # Issue 38: 10^19 ms was stored, and broke every later declare and reject.
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": 10**19},
     r"x-delayed-retry-min must be a positive integer \(ms\) of at most 315360000000"),
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": MAX_DURATION_MS + 1},
     "x-delayed-retry-min must be .* at most 315360000000 .*, got 315360000001"),
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": 1, "x-delayed-retry-max": MAX_DURATION_MS + 1},
     "x-delayed-retry-max must be .* at most 315360000000 .*, got 315360000001"),
    ({"x-delayed-retry-type": "all", "x-delayed-retry-min": 1e19},  # kombu converts seconds to floats
     "x-delayed-retry-min must be .* at most 315360000000"),
])
def test_bad_queue_arguments_name_the_value_and_declare_nothing(kind_broker: Broker, arguments: dict,
                                                                 message: str) -> None:
    with kind_broker.connection() as conn:
        channel = conn.channel()
        with pytest.raises(ValueError, match=message) as raised:
            Queue("badretry", queue_arguments=arguments)(channel).declare()
        assert "'badretry'" in str(raised.value)
        assert not channel.lib.exists("badretry")


def test_the_transport_option_is_the_default_of_queues_without_arguments(kind_broker: Broker) -> None:
    options = {"delayed_retry_type": "all", "delayed_retry_min": 0.25, "delayed_retry_max": 2}
    with kind_broker.connection(**options) as conn:
        channel = conn.channel()
        Queue("defaulted")(channel).declare()
        Queue("own", queue_arguments={"x-delayed-retry-type": "failed", "x-delayed-retry-min": 50})(
            channel).declare()
        assert channel.lib.declare("defaulted").retry == DelayedRetry("all", 250, 2000)
        assert channel.lib.declare("own").retry == DelayedRetry("failed", 50, None)


@pytest.mark.parametrize(("options", "message"), [
    ({"delayed_retry_type": "never"}, "'delayed_retry_type' must be one of disabled, all, failed, returned"),
    # Issue 42: the options' names and seconds, not the queue arguments' ms.
    ({"delayed_retry_type": "failed"},
     r"'delayed_retry_type' 'failed' needs 'delayed_retry_min' \(the first delay, in seconds\)"),
    ({"delayed_retry_type": "failed", "delayed_retry_min": 0},
     "'delayed_retry_min' must be a number of seconds > 0"),
    ({"delayed_retry_type": 1}, "'delayed_retry_type' must be str"),
    ({"delayed_retry_type": "all", "delayed_retry_min": 2, "delayed_retry_max": 1},
     r"'delayed_retry_max' \(1 seconds\) is below 'delayed_retry_min' \(2 seconds\)"),
    # Issue 38: past 10 years, in seconds.
    ({"delayed_retry_type": "all", "delayed_retry_min": 10**16},
     "'delayed_retry_min' must be a number of seconds > 0 and <= 315360000 or None, got 10000000000000000"),
    ({"delayed_retry_type": "all", "delayed_retry_min": 1, "delayed_retry_max": MAX_DURATION_SECONDS + 1},
     "'delayed_retry_max' must be a number of seconds > 0 and <= 315360000"),
])
def test_bad_options_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(OptionError, match=message) as raised:
        parse_options(options)
    assert "x-delayed-retry" not in str(raised.value) and "(ms)" not in str(raised.value)


def test_the_option_s_bound_is_ten_years_in_seconds() -> None:
    options = parse_options({"delayed_retry_type": "all", "delayed_retry_min": MAX_DURATION_SECONDS,
                             "delayed_retry_max": MAX_DURATION_SECONDS})
    assert options.delayed_retry == DelayedRetry("all", MAX_DURATION_MS, MAX_DURATION_MS)
