"""Late acks and the state they meet (issue 38, defects 1-3), script level on every server
kind, then through kombu.

A consumer whose lease lapsed acks after the sweep moved its message on: into a delayed
retry (the ack cancels that copy, and the queue's in-flight count and ``retrying`` stay
true), or back to ready and on to another consumer (the ack is fenced by its delivery
count: that consumer's delivery, and its slot of an in-flight cap, are left alone). And a
paused queue's sweep promotes nothing: its countdowns and retries wait for resume.
"""

from __future__ import annotations

import logging

import pytest
from kombu import Consumer, Queue
from kombu.message import Message

from celery_redis_lua import ScriptLibrary
from celery_redis_lua.protocol.envelope import DeliveryTag
from celery_redis_lua.protocol.retry import DelayedRetry
from helpers import message_state, server_now_ms, wait_for_server_time, wait_until
from kombu_support import Broker, drain


def lapse(lib: ScriptLibrary, queue: str, ids: list[str]) -> None:
    """The consumer holding ``ids`` died: their visibility deadlines pass (server clock)."""
    assert lib.with_policy(visibility_ms=1).extend(queue, ids) == len(ids)
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 2)


def counts(lib: ScriptLibrary, queue: str) -> tuple[int, int, int, int]:
    """(ready, delayed, in flight, retrying) as a dashboard reads them."""
    [m] = lib.metrics([queue])
    return m.ready, m.delayed, m.in_flight, m.retrying


def test_a_late_ack_of_a_retry_waiting_message_cancels_it_and_keeps_the_cap(lib: ScriptLibrary) -> None:
    """Defect 1: the ack left the id in ``delayed``, so in flight (stored - ready - delayed)
    read -1 and a cap of 1 let two deliveries out; ``retrying`` stayed 1 for good."""
    lib.declare("capped", retry=DelayedRetry("failed", 60_000, None))
    first, *_ = [lib.publish("capped", f"m{i}") for i in range(3)]
    lib.limit("capped", in_flight=1)
    [a] = lib.consume(["capped"], 1).deliveries
    assert a.id == first
    lapse(lib, "capped", [a.id])
    assert lib.sweep(["capped"]).requeued == 1  # into a delayed retry, 60 s away
    assert counts(lib, "capped") == (2, 1, 0, 1)

    assert lib.ack("capped", [a.id], counts=[a.delivery_count]) == 1  # A finished after all
    assert counts(lib, "capped") == (2, 0, 0, 0)
    assert lib.client.zcard(lib.keys.delayed("capped")) == 0
    assert len(lib.consume(["capped"], 10).deliveries) == 1  # B: the cap's one slot
    assert lib.consume(["capped"], 10).deliveries == []  # C: none while B holds it


def test_an_unfenced_late_ack_of_a_retry_waiting_message_cancels_it_too(lib: ScriptLibrary) -> None:
    lib.declare("retried", retry=DelayedRetry("failed", 60_000, None))
    message_id = lib.publish("retried", "m")
    lib.consume(["retried"], 1)
    lapse(lib, "retried", [message_id])
    assert lib.sweep(["retried"]).requeued == 1
    assert lib.ack("retried", [message_id]) == 1
    assert counts(lib, "retried") == (0, 0, 0, 0)
    assert lib.client.exists(lib.keys.wake("retried")) == 0  # nothing left to wake anyone for


def test_a_stale_ack_leaves_another_consumers_delivery_and_its_slot_alone(lib: ScriptLibrary) -> None:
    """Defect 2: A's lease lapsed, the sweep restored the message, B took it (count 1); A's
    late ack deleted B's delivery, so C got the next message under a cap of 1."""
    lib.declare("capped")
    first = lib.publish("capped", "m0")
    lib.limit("capped", in_flight=1)
    [a] = lib.consume(["capped"], 1).deliveries
    lapse(lib, "capped", [a.id])
    assert lib.sweep(["capped"]).requeued == 1
    [b] = lib.consume(["capped"], 1).deliveries
    assert (b.id, b.delivery_count) == (first, 1)
    lib.publish("capped", "m1")

    acked = lib.ack("capped", [a.id], counts=[a.delivery_count])
    assert (acked, acked.stale) == (0, (first,))
    assert message_state(lib.client, lib.keys, "capped", first) == ("unacked", 1, 0, "-")
    assert lib.consume(["capped"], 10).deliveries == []  # C: B still holds the one slot
    acked = lib.ack("capped", [b.id], counts=[b.delivery_count])
    assert (acked, acked.stale) == (1, ())
    assert [d.payload for d in lib.consume(["capped"], 10).deliveries] == [b"m1"]


def test_a_stale_ack_of_a_copy_that_waits_ready_again_still_cancels_it(lib: ScriptLibrary) -> None:
    """Nobody holds the restored copy: the late ack cancels it, so the task does not run twice."""
    message_id = lib.publish("slow", "m")
    [a] = lib.consume(["slow"], 1).deliveries
    lapse(lib, "slow", [a.id])
    assert lib.sweep(["slow"]).requeued == 1
    acked = lib.ack("slow", [a.id], counts=[a.delivery_count])
    assert (acked, acked.stale) == (1, ())
    assert counts(lib, "slow") == (0, 0, 0, 0)
    assert lib.client.hexists(lib.keys.message("slow"), message_id) == 0
    assert lib.consume(["slow"], 1).deliveries == []


def test_a_bad_fenced_id_is_refused_and_changes_nothing(lib: ScriptLibrary) -> None:
    message_id = lib.publish("q", "m")
    lib.consume(["q"], 1)
    with pytest.raises(Exception, match=r"ack: id 'x:y' must be an id or id:delivery_count"):
        lib.run(lib.calls.ack("q", [message_id, "x:y"]))
    assert counts(lib, "q") == (0, 0, 1, 0)


def test_a_paused_queue_sweep_promotes_no_countdown_and_no_retry(lib: ScriptLibrary) -> None:
    """Defect 3: the sweep promoted a paused queue's due countdowns (status showed them
    ready, ``retrying`` fell to 0), where consume and the docs leave them waiting."""
    lib.declare("held", retry=DelayedRetry("failed", 20, None))
    retried = lib.publish("held", "retried")
    [d] = lib.consume(["held"], 1).deliveries
    assert lib.reject("held", [d.id], requeue=True, counts=[0]).requeued == 1
    eta = server_now_ms(lib.client) + 20
    countdown = lib.publish("held", "countdown", eta_ms=eta)
    assert lib.pause("held", "maintenance")
    wait_for_server_time(lib.client, eta + 25)  # both are due now

    report = lib.sweep(["held"])
    assert report.promoted == 0
    assert counts(lib, "held") == (0, 2, 0, 1)
    assert lib.client.exists(lib.keys.wake("held")) == 0  # a paused queue wakes nobody
    assert lib.consume(["held"], 10).deliveries == []

    assert lib.resume("held")
    assert sorted(d.id for d in lib.consume(["held"], 10).deliveries) == sorted([retried, countdown])
    assert counts(lib, "held") == (0, 0, 2, 0)


def test_a_requeue_into_a_paused_queue_wakes_nobody(lib: ScriptLibrary) -> None:
    message_id = lib.publish("held", "m")
    lib.consume(["held"], 1)
    lib.pause("held")
    assert lib.reject("held", [message_id], requeue=True).requeued == 1
    assert lib.client.exists(lib.keys.wake("held")) == 0
    assert lib.unpop("held") == 0
    assert lib.client.exists(lib.keys.wake("held")) == 0
    lib.resume("held")
    assert lib.client.lrange(lib.keys.wake("held"), 0, -1) == [b"1"]


def test_the_transport_fences_its_acks_and_reports_a_stale_one(
        kind_broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    """Through kombu: A's message.ack() after its lease lapsed and B took the message leaves
    B's delivery alone and logs the stale ack at WARNING, naming queue and id."""
    lib = kind_broker.lib
    got: list[Message] = []
    with kind_broker.connection(ack_flush_delay=0.01) as conn:
        queue = Queue("fenced", routing_key="fenced")
        with conn.Producer() as producer:
            producer.publish("task", routing_key="fenced", declare=[queue])
        with Consumer(conn, [queue], callbacks=[lambda body, message: got.append(message)]):
            drain(conn, got, 1)
            [message] = got
            message_id = DeliveryTag.parse(message.delivery_tag).id
            lapse(lib, "fenced", [message_id])
            assert lib.sweep(["fenced"]).requeued == 1
            [b] = lib.consume(["fenced"], 1).deliveries
            assert b.delivery_count == 1
            with caplog.at_level(logging.WARNING, logger="celery_redis_lua"):
                message.ack()
                wait_until(lambda: "came after their lease lapsed" in caplog.text, timeout=10,
                           what="the stale ack's warning")
    assert f"{message_id}" in caplog.text and "'fenced'" in caplog.text
    assert message_state(lib.client, lib.keys, "fenced", message_id)[:2] == ("unacked", 1)
    assert lib.ack("fenced", [b.id], counts=[b.delivery_count]) == 1


@pytest.mark.parametrize("change", ["resume", "limit"])
def test_a_token_pushed_by_resume_or_limit_expires_with_the_queue(lib: ScriptLibrary, change: str) -> None:
    """Found by the model: the wake list a resume (or a loosened limit) made had no expiry,
    so an x-expires queue's token outlived the rest of its keys."""
    lib.declare("brief", expires_ms=600_000)
    lib.publish("brief", "m")
    if change == "resume":
        lib.pause("brief")
        assert lib.resume("brief")
    else:
        lib.limit("brief", in_flight=1)
        assert lib.consume(["brief"], 1).deliveries
        lib.publish("brief", "n")
        lib.client.delete(lib.keys.wake("brief"))  # as a capped consume leaves it
        lib.limit("brief", clear_in_flight=True)
    assert lib.client.llen(lib.keys.wake("brief")) == 1
    expiry = lib.client.pexpiretime(lib.keys.meta("brief"))
    assert lib.client.pexpiretime(lib.keys.wake("brief")) == expiry > 0


def test_a_token_an_ack_pushes_for_a_freed_slot_expires_with_the_queue(lib: ScriptLibrary) -> None:
    """Found by the model: an ack that freed a capped queue's slot pushed the wake token into
    a list of no expiry, which outlived the x-expires queue's other keys."""
    lib.declare("brief", expires_ms=600_000)
    lib.publish("brief", "m")
    lib.publish("brief", "n")
    lib.limit("brief", in_flight=1)
    [taken] = lib.consume(["brief"], 10).deliveries
    assert lib.client.exists(lib.keys.wake("brief")) == 0  # the cap dropped it
    assert lib.ack("brief", [taken.id], counts=[taken.delivery_count]) == 1
    assert lib.client.llen(lib.keys.wake("brief")) == 1
    expiry = lib.client.pexpiretime(lib.keys.meta("brief"))
    assert lib.client.pexpiretime(lib.keys.wake("brief")) == expiry > 0
