"""The transport through plain kombu (no Celery worker), on Valkey and Redis, standalone and
three-primary clusters, with and without a global_keyprefix; the broker is inspected with
the script library or raw keys. On the clusters, the queues the module uses are placed on
every primary (asserted once the module's cluster tests ran)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.message import Message
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.transport.virtual import exchange as virtual_exchange

import celery_redis_lua
from celery_redis_lua import Keyspace
from celery_redis_lua.protocol.envelope import DeliveryTag
from helpers import PLACEMENT, wait_for_server_time, wait_until
from kombu_support import Broker, consume
from scripts.servers import Cluster

EX = Exchange("ex", "direct")
KINDS = [(kind, prefix) for prefix in ("", "app:")
         for kind in ("valkey", "redis", "valkey-cluster", "redis-cluster")]


@pytest.fixture(scope="module")
def placement() -> Iterator[None]:
    yield
    assert not PLACEMENT.unmet("kombu")


@pytest.fixture(params=KINDS, ids=lambda p: f"{p[0]}-{'prefix' if p[1] else 'noprefix'}")
def broker(request: pytest.FixtureRequest, placement: None) -> Iterator[Broker]:
    """The transport under test: each server kind and cluster, with and without a prefix."""
    kind, prefix = request.param
    server = request.getfixturevalue(kind.replace("-", "_") + ("" if "cluster" in kind else "_server"))
    client = server.client(socket_timeout=10)
    client.flushall()
    yield Broker(server, prefix, client)
    if isinstance(server, Cluster):
        PLACEMENT.record("kombu", kind, server)
    client.close()


def test_publish_consume_ack_leaves_only_the_queue_definition(conn: Connection, broker: Broker) -> None:
    queue = Queue("work", EX, routing_key="work")
    producer = Producer(conn, exchange=EX, routing_key="work")
    for i in range(3):
        producer.publish({"n": i}, declare=[queue])
    assert queue(conn.default_channel).queue_declare(passive=True).message_count == 3
    messages = consume(conn, [queue], 3)
    assert [m.payload for m in messages] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert [m.delivery_info["routing_key"] for m in messages] == ["work"] * 3
    wait_until(lambda: broker.lib.stats(["work"])[0] == celery_redis_lua.QueueStats("work", 0, 0, 0, 0),
               timeout=5)  # the acks are batched: sent a few ms after ack() returned
    assert broker.queue_keys("work") == {broker.keys.meta("work")}


def test_a_stored_envelope_has_no_delivery_tag_and_a_delivered_one_has_the_transports(
        conn: Connection, broker: Broker) -> None:
    """kombu's virtual channel puts a uuid4 tag in every envelope it publishes; delivery sets
    the tag that acks use, so the stored copy leaves it out (a urandom call and ~55 bytes
    of every queued message)."""
    queue = Queue("tagged", EX, routing_key="tagged")
    Producer(conn, exchange=EX, routing_key="tagged").publish({"n": 1}, declare=[queue])
    ((message_id, stored),) = broker.client.hgetall(broker.keys.message("tagged")).items()
    properties = json.loads(stored)["properties"]
    assert "delivery_tag" not in properties
    assert properties["delivery_info"] == {"exchange": "ex", "routing_key": "tagged"}
    (message,) = consume(conn, [queue], 1)
    tag = DeliveryTag.parse(message.delivery_tag)
    assert (tag.queue, tag.id) == ("tagged", message_id.decode())


def test_a_text_body_is_stored_as_text_and_a_binary_one_in_base64(conn: Connection, broker: Broker) -> None:
    """A JSON body goes into the stored envelope as it is (redis-cli shows the arguments; no
    third more bytes of base64); a binary one is base64, as stock kombu stores it. Both come
    back to the consumer as kombu delivers them from any broker."""
    queue = Queue("bodies", EX, routing_key="bodies")
    producer = Producer(conn, exchange=EX, routing_key="bodies")
    producer.publish({"args": ["é", '"q"']}, declare=[queue])  # the JSON serializer: text
    producer.publish(b"\x00\xffraw", declare=[queue], content_type="application/data",
                     content_encoding="binary")
    by_id = broker.client.hgetall(broker.keys.message("bodies"))
    stored = [json.loads(payload) for _, payload in sorted(by_id.items())]
    assert [envelope["properties"].get("body_encoding") for envelope in stored] == [None, "base64"]
    assert "body_encoding" not in stored[0]["properties"]
    assert json.loads(stored[0]["body"]) == {"args": ["é", '"q"']}
    text, binary = consume(conn, [queue], 2)
    assert text.payload == {"args": ["é", '"q"']}
    assert text.body == json.dumps({"args": ["é", '"q"']}).encode()  # bytes, as from any kombu broker
    assert binary.body == b"\x00\xffraw"


def test_reject_dead_letters_and_requeue_redelivers_counted(conn: Connection, broker: Broker) -> None:
    queue = Queue("rq", EX, routing_key="rq")
    producer = Producer(conn, exchange=EX, routing_key="rq")
    producer.publish("drop me", declare=[queue])
    producer.publish("again", declare=[queue])
    first = consume(conn, [queue], 2, ack=False)
    assert [(m.headers["x-delivery-count"], m.delivery_info["redelivered"]) for m in first] == [
        (0, False), (0, False)]
    first[0].reject()
    first[1].requeue()
    again = consume(conn, [queue], 1)[0]
    assert (again.payload, again.headers["x-delivery-count"], again.delivery_info["redelivered"]) == (
        "again", 1, True)
    assert [(d.reason, d.delivery_count) for d in broker.lib.dead_list("rq")] == [("rejected", 0)]
    assert broker.lib.stats(["rq"])[0].ready == 0


def test_purge_and_queue_length(conn: Connection, broker: Broker) -> None:
    queue = Queue("pq", EX, routing_key="pq")(conn.default_channel)
    for i in range(5):
        Producer(conn, exchange=EX, routing_key="pq").publish(i, declare=[queue])
    assert queue.queue_declare(passive=True).message_count == 5
    assert queue.purge() == 5
    assert queue.queue_declare(passive=True).message_count == 0
    assert broker.queue_keys("pq") == {broker.keys.meta("pq")}


@pytest.mark.parametrize("how", ["bound", "default-exchange", "other-connection"])
def test_delete_removes_every_key_of_the_queue(broker: Broker, how: str) -> None:
    exchange = Exchange("") if how == "default-exchange" else EX
    with broker.connection() as conn:
        queue = Queue("dq", exchange, routing_key="dq")(conn.default_channel)
        Producer(conn, exchange=exchange, routing_key="dq").publish("x", declare=[queue])
        assert broker.queue_keys("dq")
        if how != "other-connection":
            queue.delete()
    if how == "other-connection":
        with broker.connection() as other:
            Queue("dq", exchange, routing_key="dq")(other.default_channel).delete()
    assert broker.queue_keys("dq") == set()
    assert not broker.lib.exists("dq")


def test_simple_queue(conn: Connection) -> None:
    channel = conn.channel()
    channel.basic_qos(0, 1, False)  # else get() prefetches the whole queue into its buffer
    simple = conn.SimpleQueue("simple", channel=channel)
    for i in range(3):
        simple.put({"i": i})
    assert simple.qsize() == 3
    message = simple.get(timeout=5)
    assert message.payload == {"i": 0}
    message.ack()
    assert simple.qsize() == 2
    nowait = simple.get_nowait()
    assert nowait.payload == {"i": 1}
    nowait.ack()
    assert simple.clear() == 1
    assert simple.qsize() == 0
    with pytest.raises(simple.Empty):
        simple.get_nowait()
    simple.close()


def test_direct_and_topic_routing_follow_kombu_patterns(conn: Connection) -> None:
    route_topics_and_direct(conn)


# kombu < 5.7's TopicExchange (5.4, 5.5, 5.6): '*' became '.*?[^\.]', which also matches several words.
KOMBU_5_4_WILDCARDS = {"*": r".*?[^\.]", "#": r".*?"}


def test_a_topic_star_matches_one_word_even_under_kombu_5_4_patterns(
        conn: Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport's own topic exchange (kombu/exchange.py) routes as AMQP says on every kombu:
    kombu 5.4's wildcards (here on kombu's class, as kombu 5.4 has them) change nothing, and a
    binding stored with kombu 5.4's pattern routes by its key (noxfile.py runs kombu 5.4 itself)."""
    monkeypatch.setattr(virtual_exchange.TopicExchange, "wildcards", KOMBU_5_4_WILDCARDS)
    route_topics_and_direct(conn)
    old = virtual_exchange.TopicExchange(conn.default_channel)
    table = [("a.*", old.key_to_pattern("a.*"), "star"), ("a.#", old.key_to_pattern("a.#"), "hash")]
    lookup = conn.default_channel.typeof("tx").lookup
    assert lookup(table, "tx", "a.b.c", None) == {"hash"}
    assert lookup(table, "tx", "a.b", None) == {"star", "hash"}
    assert lookup(table, "tx", "a", None) == set()


def route_topics_and_direct(conn: Connection) -> None:
    topic = Exchange("tx", "topic")
    star, hash_ = Queue("star", topic, routing_key="a.*"), Queue("hash", topic, routing_key="a.#")
    one, two = Queue("one", EX, routing_key="k1"), Queue("two", EX, routing_key="k2")
    producer = Producer(conn)
    for key in ("a.b", "a.b.c", "a", "x.b"):
        producer.publish(key, exchange=topic, routing_key=key, declare=[star, hash_])
    producer.publish("k2", exchange=EX, routing_key="k2", declare=[one, two])
    assert [m.payload for m in consume(conn, [star], 1)] == ["a.b"]
    assert [m.payload for m in consume(conn, [hash_], 2)] == ["a.b", "a.b.c"]
    assert [m.payload for m in consume(conn, [two], 1)] == ["k2"]
    for queue in (star, hash_, one):
        assert queue(conn.default_channel).queue_declare(passive=True).message_count == 0


def test_fanout_reaches_every_bound_queue_even_when_consumed_later(conn: Connection) -> None:
    fan = Exchange("fan", "fanout")
    first, second = Queue("f1", fan), Queue("f2", fan)
    first(conn.default_channel).declare()
    producer = Producer(conn, exchange=fan)
    producer.publish("before f2 was bound")
    second(conn.default_channel).declare()
    producer.publish("after")
    # f2 was bound but not consumed when 'after' went out; it still gets it, and only it.
    assert [m.payload for m in consume(conn, [second], 1)] == ["after"]
    assert [m.payload for m in consume(conn, [first], 2)] == ["before f2 was bound", "after"]


def test_priority_higher_first_then_publish_order(conn: Connection) -> None:
    queue = Queue("prio", EX, routing_key="prio")
    producer = Producer(conn, exchange=EX, routing_key="prio")
    for body, priority in [("p0", 0), ("p5a", 5), ("p9", 9), ("p5b", 5), ("p1", 1)]:
        producer.publish(body, priority=priority, declare=[queue])
    assert [m.payload for m in consume(conn, [queue], 5)] == ["p9", "p5a", "p5b", "p1", "p0"]


def test_no_ack_leaves_nothing_in_the_broker(conn: Connection, broker: Broker) -> None:
    queue = Queue("noack", EX, routing_key="noack")
    for i in range(3):
        Producer(conn, exchange=EX, routing_key="noack").publish(i, declare=[queue])
    assert [m.payload for m in consume(conn, [queue], 3, no_ack=True)] == [0, 1, 2]
    assert broker.lib.stats(["noack"])[0] == celery_redis_lua.QueueStats("noack", 0, 0, 0, 0)
    assert broker.queue_keys("noack") == {broker.keys.meta("noack")}


def test_prefetch_count_limits_deliveries_per_drain(conn: Connection, broker: Broker) -> None:
    queue = Queue("pf", EX, routing_key="pf")
    for i in range(5):
        Producer(conn, exchange=EX, routing_key="pf").publish(i, declare=[queue])
    got: list[Message] = []
    with Consumer(conn, [queue], callbacks=[lambda body, m: got.append(m)], prefetch_count=2):
        conn.drain_events(timeout=5)
        assert [m.payload for m in got] == [0, 1]
        with pytest.raises(socket.timeout):  # QoS is full: nothing more until an ack
            conn.drain_events(timeout=0.3)
        assert broker.lib.stats(["pf"])[0].in_flight == 2
        for message in got:
            message.ack()
        conn.drain_events(timeout=5)
        assert [m.payload for m in got] == [0, 1, 2, 3]


def test_drain_events_times_out_idle_and_wakes_for_a_message(broker: Broker) -> None:
    queue = Queue("idle", EX, routing_key="idle")
    got: list[Message] = []
    with broker.connection(blocking_timeout=30) as conn, Consumer(
            conn, [queue], callbacks=[lambda body, m: (got.append(m), m.ack())]):
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=0.2)

        def publish_once_blocked() -> None:
            wait_until(lambda: broker.blocked_clients() >= 1)
            with broker.connection() as producer_conn:
                Producer(producer_conn, exchange=EX, routing_key="idle").publish("wake")

        thread = threading.Thread(target=publish_once_blocked)
        thread.start()
        try:
            conn.drain_events(timeout=20)  # blocking_timeout 30: only the message can end it
        finally:
            thread.join()
    assert [m.payload for m in got] == ["wake"]


def declared(name: str, how: str, **options: float) -> Queue:
    """Queue arguments the kombu way (Queue(max_priority=3)) or as raw x-* queue_arguments."""
    if how == "kombu":
        return Queue(name, EX, routing_key=name, **options)
    return Queue(name, EX, routing_key=name, queue_arguments=to_rabbitmq_queue_arguments({}, **options))


HOW = pytest.mark.parametrize("how", ["kombu", "x-args"])


@HOW
def test_x_max_priority_caps_priorities(conn: Connection, broker: Broker, how: str) -> None:
    queue = declared("cap", how, max_priority=3)
    producer = Producer(conn, exchange=EX, routing_key="cap")
    for body, priority in [("p3", 3), ("p9", 9), ("p2", 2)]:
        producer.publish(body, priority=priority, declare=[queue])
    second = sorted(broker.client.hkeys(broker.keys.state("cap")))[1]
    assert broker.client.hget(broker.keys.state("cap"), second).split()[2] == b"3"
    assert [m.payload for m in consume(conn, [queue], 3)] == ["p3", "p9", "p2"]


@HOW
def test_x_message_ttl_expires_messages(conn: Connection, broker: Broker, how: str) -> None:
    queue = declared("ttl", how, message_ttl=0.6)
    Producer(conn, exchange=EX, routing_key="ttl").publish("short-lived", declare=[queue])
    [message_id] = broker.client.hkeys(broker.keys.state("ttl"))
    deadline = int(broker.client.hget(broker.keys.state("ttl"), message_id).split()[3])
    wait_for_server_time(broker.client, deadline + 1)
    simple = conn.SimpleQueue(queue)
    with pytest.raises(simple.Empty):
        simple.get_nowait()
    assert broker.lib.stats(["ttl"])[0].in_flight == 0
    assert [(d.id.encode(), d.reason) for d in broker.lib.dead_list("ttl")] == [(message_id, "expired")]


@HOW
def test_x_expires_sets_key_ttls(conn: Connection, broker: Broker, how: str) -> None:
    keep, expiring = declared("keep", how), declared("exp", how, expires=30)
    producer = Producer(conn, exchange=EX)
    producer.publish("a", routing_key="keep", declare=[keep])
    producer.publish("b", routing_key="exp", declare=[expiring])
    assert broker.client.pttl(broker.keys.meta("keep")) == -1
    assert 25_000 < broker.client.pttl(broker.keys.meta("exp")) <= 30_000
    assert 25_000 < broker.client.pttl(broker.keys.queue("exp")) <= 30_000


def test_db_number_and_prefix_apply_to_every_key(broker: Broker) -> None:
    if broker.is_cluster:
        pytest.skip("a cluster has only db 0 (test_cluster_transport: another db is an error)")
    fan = Exchange("dbfan", "fanout")
    with broker.connection(db=3) as conn:
        producer = Producer(conn)
        producer.publish("x", exchange=EX, routing_key="dbq", declare=[Queue("dbq", EX, "dbq")])
        producer.publish("y", exchange=fan, declare=[Queue("dbf", fan)])
        assert [m.payload for m in consume(conn, [Queue("dbq", EX, "dbq")], 1, ack=False)] == ["x"]
    assert broker.client.keys("*") == []  # db 0
    with broker.server.client(db=3) as db3:
        keys = {k.decode() for k in db3.keys("*")}
    stream = Keyspace(broker.prefix, fanout_prefix="/3.").fanout("dbfan")
    groups = broker.keys.fanout_groups(stream)
    assert {broker.keys.meta("dbq"), broker.keys.binding("ex"), stream, groups} <= keys
    assert all(k.startswith(broker.prefix) for k in keys)


def test_an_entity_left_on_a_closed_channel_is_revived_by_ensure(broker: Broker) -> None:
    """After a reconnect, an exchange still bound to the old (closed) channel meets a lost
    connection, which kombu's ensure() answers by reviving it on a new channel; before, it
    met an AttributeError that no retry handles."""
    with broker.connection() as conn:
        old = conn.channel()
        exchange = Exchange("revived", "topic")(old)
        old.close()
        with pytest.raises(conn.connection_errors):
            exchange.declare()
        conn.ensure(exchange, exchange.declare, max_retries=2)()
        assert exchange.channel is not old and exchange.channel.connection is not None
        assert "revived" in conn.default_channel.state.exchanges
