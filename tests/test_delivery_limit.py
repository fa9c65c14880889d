"""Delivery limit, counted like RabbitMQ quorum queues: the first delivery has count 0,
visibility-timeout restores and reject(requeue) add one, and a message whose next
attempt would exceed the limit goes to the dead-letter stream (or is deleted outright
with dead_letter_maxlen 0). None or 0 means no limit."""

from __future__ import annotations

import pytest

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.ops import Delivery, Dropped, Rejected, SweepReport
from conftest import Target
from helpers import message_exists, wait_for_server_time

VISIBILITY_MS = 200


@pytest.fixture
def vlib(target: Target, keyspace: Keyspace) -> ScriptLibrary:
    """The script library with a tiny visibility timeout, on every server kind."""
    return ScriptLibrary(target.client, keyspace, visibility_ms=VISIBILITY_MS)


def consume_one(lib: ScriptLibrary, queue: str) -> Delivery:
    deliveries = lib.consume([queue], 5).deliveries
    assert len(deliveries) == 1, deliveries
    return deliveries[0]


def time_out(lib: ScriptLibrary, queue: str, message_id: str, *, delivery_limit: int | None,
             dead_letter_maxlen: int = 10_000) -> SweepReport:
    """Let the delivery's visibility deadline pass on the server clock, then sweep."""
    deadline = lib.client.zscore(lib.keys.index(queue), message_id)
    assert deadline is not None, f"{message_id} is not in flight"
    wait_for_server_time(lib.client, int(deadline))
    policy = lib.with_policy(delivery_limit=delivery_limit, dead_letter_maxlen=dead_letter_maxlen)
    return policy.sweep([queue])


def assert_gone(lib: ScriptLibrary, queue: str, message_id: str) -> None:
    client = lib.client
    assert client.zscore(lib.keys.queue(queue), message_id) is None
    assert client.zscore(lib.keys.index(queue), message_id) is None
    assert not message_exists(client, lib.keys, queue, message_id)
    assert lib.consume([queue], 5).deliveries == []


def test_limit_3_is_a_first_delivery_plus_two_redeliveries(vlib: ScriptLibrary) -> None:
    message_id = vlib.publish("lim", "poison", priority=4)
    seen = []
    for expected_requeued in (1, 1):
        delivery = consume_one(vlib, "lim")
        seen.append(delivery.delivery_count)
        report = time_out(vlib, "lim", message_id, delivery_limit=3)
        assert (report.requeued, report.limit_reached) == (expected_requeued, 0)
    delivery = consume_one(vlib, "lim")
    seen.append(delivery.delivery_count)
    assert seen == [0, 1, 2]
    assert vlib.dead_list("lim") == []

    report = time_out(vlib, "lim", message_id, delivery_limit=3)
    assert (report.requeued, report.limit_reached) == (0, 1)
    # The sweep reports what it dropped, payload included.
    assert report.dropped_messages == [Dropped("lim", message_id, 3, "delivery-limit", b"poison")]

    [dead] = vlib.dead_list("lim")
    assert (dead.id, dead.reason, dead.delivery_count, dead.priority, dead.payload) == (
        message_id, "delivery-limit", 3, 4, b"poison")
    assert_gone(vlib, "lim", message_id)


def test_reject_requeue_counts_and_is_limited(vlib: ScriptLibrary) -> None:
    message_id = vlib.publish("rq", "flaky")
    for count in (0, 1):
        assert consume_one(vlib, "rq").delivery_count == count
        limited = vlib.with_policy(delivery_limit=3)
        assert limited.reject("rq", [message_id], requeue=True) == Rejected(1, 0, 0)
    assert consume_one(vlib, "rq").delivery_count == 2
    assert vlib.with_policy(delivery_limit=3).reject("rq", [message_id], requeue=True) == Rejected(0, 1, 0)

    [dead] = vlib.dead_list("rq")
    assert (dead.id, dead.reason, dead.delivery_count, dead.payload) == (
        message_id, "delivery-limit", 3, b"flaky")
    assert_gone(vlib, "rq", message_id)


def test_timeouts_and_rejects_share_one_counter(vlib: ScriptLibrary) -> None:
    message_id = vlib.publish("both", "mixed")
    assert consume_one(vlib, "both").delivery_count == 0
    assert time_out(vlib, "both", message_id, delivery_limit=3).requeued == 1
    assert consume_one(vlib, "both").delivery_count == 1
    assert vlib.with_policy(delivery_limit=3).reject("both", [message_id], requeue=True).requeued == 1
    assert consume_one(vlib, "both").delivery_count == 2
    report = time_out(vlib, "both", message_id, delivery_limit=3)
    assert report.limit_reached == 1 and report.requeued == 0
    assert [(d.reason, d.delivery_count) for d in vlib.dead_list("both")] == [("delivery-limit", 3)]


def test_reject_without_requeue_dead_letters_as_rejected(vlib: ScriptLibrary) -> None:
    message_id = vlib.publish("rej", "bad input", priority=7)
    consume_one(vlib, "rej")
    assert vlib.reject("rej", [message_id], requeue=False) == Rejected(0, 1, 0)

    [dead] = vlib.dead_list("rej")
    assert (dead.id, dead.reason, dead.delivery_count, dead.priority, dead.payload) == (
        message_id, "rejected", 0, 7, b"bad input")
    assert_gone(vlib, "rej", message_id)


def test_dead_letter_maxlen_0_deletes_outright(vlib: ScriptLibrary, target: Target) -> None:
    rejected = vlib.publish("gone", "reject me")
    consume_one(vlib, "gone")
    outright = vlib.with_policy(dead_letter_maxlen=0)
    assert outright.reject("gone", [rejected], requeue=False) == Rejected(0, 0, 1)

    timed_out = vlib.publish("gone", "time me out")
    consume_one(vlib, "gone")
    # Limit 1: no redelivery at all, and nowhere to keep the letter.
    report = time_out(vlib, "gone", timed_out, delivery_limit=1, dead_letter_maxlen=0)
    assert (report.requeued, report.limit_reached) == (0, 1)
    assert report.dropped_messages == [Dropped("gone", timed_out, 1, "delivery-limit", b"time me out")]

    assert target.client.exists(vlib.keys.dead("gone")) == 0
    assert vlib.dead_list("gone") == []
    assert_gone(vlib, "gone", rejected)
    assert_gone(vlib, "gone", timed_out)


@pytest.mark.parametrize("limit", [None, 0], ids=["None", "zero"])
def test_no_limit_allows_any_number_of_redeliveries(vlib: ScriptLibrary, limit: int | None) -> None:
    message_id = vlib.publish("inf", "again and again")
    for count in range(30):
        delivery = consume_one(vlib, "inf")
        assert delivery.delivery_count == count
        unlimited = vlib.with_policy(delivery_limit=limit)
        assert unlimited.reject("inf", [message_id], requeue=True) == Rejected(1, 0, 0)
    consume_one(vlib, "inf")
    assert time_out(vlib, "inf", message_id, delivery_limit=limit).requeued == 1
    assert consume_one(vlib, "inf").delivery_count == 31
    assert vlib.dead_list("inf") == []
