"""What the transport reads of a pidbox broadcast (protocol/revoke.py): only a JSON ``revoke``
command's task ids, one or a list; a waiting task is dead-lettered 'revoked' whether the
broadcast came from Celery or from kombu's Mailbox directly, and other commands, other
exchanges and a task in flight change nothing."""

from __future__ import annotations

import base64
import json

from kombu import Consumer, Queue
from kombu.message import Message
from kombu.pidbox import Mailbox

from celery_redis_lua import Rejected, ScriptLibrary
from celery_redis_lua.protocol.revoke import revoked_task_ids
from helpers import server_now_ms, wait_for_server_time
from kombu_support import Broker, drain


def envelope(command: object, base64_body: bool = False) -> dict[str, object]:
    body = json.dumps(command)
    if base64_body:
        return {"body": base64.b64encode(body.encode()).decode(), "properties": {"body_encoding": "base64"}}
    return {"body": body, "properties": {}}


def test_only_a_revoke_command_s_task_ids_are_read() -> None:
    revoke = {"method": "revoke", "arguments": {"task_id": ["a", "b", "a", "", 5, "x" * 257]}}
    assert revoked_task_ids("celery.pidbox", envelope(revoke)) == ["a", "b"]
    assert revoked_task_ids("myapp.pidbox", envelope(revoke, base64_body=True)) == ["a", "b"]
    one = {"method": "revoke", "arguments": {"task_id": "c", "terminate": True}}
    assert revoked_task_ids("celery.pidbox", envelope(one)) == ["c"]
    assert revoked_task_ids("bcast", envelope(one)) == []  # a fanout exchange of the app's own
    assert revoked_task_ids("celery.pidbox", envelope({"method": "ping", "arguments": {}})) == []
    assert revoked_task_ids("celery.pidbox", {"body": "\x80not json", "properties": {}}) == []


def test_a_mailbox_revoke_dead_letters_what_waits_and_leaves_a_delivery_alone(kind_broker: Broker) -> None:
    lib = kind_broker.lib
    with kind_broker.connection() as conn:
        producer = conn.Producer()
        for name in ("delivered", "queued", "other"):
            producer.publish({}, routing_key="jobs", declare=[Queue("jobs")], headers={"id": name})
        lib.publish("jobs", "{}", task_id="from-node")  # a producer in another language
        got: list[Message] = []
        with Consumer(conn, [Queue("jobs")], callbacks=[lambda body, message: got.append(message)],
                      prefetch_count=1):
            drain(conn, got, 1)
        assert got[0].headers["id"] == "delivered"  # FIFO: the first is in flight now
        mailbox = Mailbox("celery", type="fanout")(conn)
        mailbox._broadcast("ping", {})  # another command: nothing happens
        assert lib.dead_list("jobs") == []
        mailbox._broadcast("revoke", {"task_id": ["delivered", "queued", "from-node", "never-sent"]})
        letters = lib.dead_list("jobs")
        assert sorted((json.loads(d.payload).get("headers", {}).get("id", "from-node"), d.reason)
                      for d in letters) == [("from-node", "revoked"), ("queued", "revoked")]
        assert lib.stats(["jobs"])[0].in_flight == 1  # the delivery is the workers' to revoke
        got[0].ack()


def in_flight(lib: ScriptLibrary, queue: str, task_id: str) -> str:
    lib.publish(queue, "{}", task_id=task_id)
    (delivery,) = lib.consume([queue], 1).deliveries
    return delivery.id


def test_a_revoked_delivery_that_comes_back_is_dead_lettered_not_run_again(kind_broker: Broker) -> None:
    """cancel(reason='revoked') marks a delivery; a requeue (reject, a hand-back) or the
    sweep (its lease lapsed: its worker died) dead-letters it, reason 'revoked'; an ack takes
    the mark with it; the CLI's cancel ('cancelled') marks nothing."""
    lib, client, k = kind_broker.lib, kind_broker.client, kind_broker.keys
    rejected = in_flight(lib, "rv", "t-rejected")
    assert lib.cancel("rv", "t-rejected", reason="revoked").outcome == "in_flight"
    assert client.hget(k.state("rv"), "revoked:t-rejected") == b"1"
    assert lib.reject("rv", [rejected], requeue=True) == Rejected(0, 1, 0, 0)
    lapsed = in_flight(lib, "rv", "t-lapsed")
    lib.cancel("rv", "t-lapsed", reason="revoked")
    lib.extend("rv", [lapsed], visibility_ms=1)
    wait_for_server_time(client, server_now_ms(client) + 2)
    report = lib.sweep(["rv"])
    assert (report.revoked, report.requeued) == (1, 0)
    assert [(d.id, d.reason) for d in report.dropped_messages] == [(lapsed, "revoked")]
    acked = in_flight(lib, "rv", "t-acked")
    lib.cancel("rv", "t-acked", reason="revoked")
    assert lib.ack("rv", [acked]) == 1
    plain = in_flight(lib, "rv", "t-plain")
    assert lib.cancel("rv", "t-plain").outcome == "in_flight"  # the CLI's cancel: no mark
    assert lib.reject("rv", [plain], requeue=True) == Rejected(1, 0, 0, 0)
    assert [(d.id, d.reason) for d in lib.dead_list("rv")] == [(rejected, "revoked"), (lapsed, "revoked")]
    assert {f for f in client.hkeys(k.state("rv")) if f.startswith(b"revoked:")} == set()
    assert lib.metrics(["rv"])[0].dropped.get("revoked") == 2
