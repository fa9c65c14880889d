"""Sharded queues (``x-shards``, protocol/shards.py): one logical queue over N hash tags.

On three-primary Valkey and Redis clusters and standalone: the shards' names put them on
distinct primaries; publishes spread round-robin or by ``x-shard-key``; consumers of the
logical queue drain every shard, the shard asked first turning; declare, purge, size and
delete act on every shard; pause and limits apply to the logical queue; a bad ``x-shards``
names itself; and the order given up is bounded by one consume batch per shard.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol import shards
from celery_redis_lua.tools import flow
from conftest import Broker, cluster_url
from kombu_support import consume, drain
from scripts.servers import Cluster


def sharded(name: str, count: int = 3, **kwargs: Any) -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name,
                 queue_arguments={"x-shards": count, **kwargs})


def ready(lib: ScriptLibrary, queues: list[str]) -> dict[str, int]:
    return {s.queue: s.ready for s in lib.stats(queues)}


# -- naming -----------------------------------------------------------------------------------


def test_shard_names_are_stable_and_parse_back() -> None:
    names = shards.shard_names("celery", 3)
    assert names == shards.shard_names("celery", 3)
    assert [n.split(".")[0] for n in names] == ["celery~0/3", "celery~1/3", "celery~2/3"]
    for index, name in enumerate(names):
        of = shards.shard_of(name)
        assert of is not None and (of.queue, of.index, of.count) == ("celery", index, 3)
    assert shards.shard_of("celery") is None
    assert shards.shard_of("celery~0/3.999999") is None  # not its salt: no shard's name
    assert shards.shard_names("celery", 1) == ()
    grouped = shards.group_shards(["other", *reversed(names), "celery"])
    assert grouped == {"other": [], "celery": list(names)}


@pytest.mark.parametrize("count", [2, 3, 4, 6, 64])
def test_each_shard_s_slot_is_in_its_own_range(count: int) -> None:
    keys = Keyspace(prefix="app:")
    for index, name in enumerate(shards.shard_names("q", count)):
        assert index * 16384 // count <= keys.slot(name) < (index + 1) * 16384 // count


def test_three_shards_land_on_the_three_primaries(cluster: Cluster) -> None:
    client, keys = cluster.client(), Keyspace()
    for queue in ("celery", "default", "hot"):
        nodes = [client.get_node_from_key(keys.queue(n)).name for n in shards.shard_names(queue, 3)]
        assert len(set(nodes)) == 3 == len(client.get_primaries())
    six = [client.get_node_from_key(keys.queue(n)).name for n in shards.shard_names("celery", 6)]
    assert sorted(Counter(six).values()) == [2, 2, 2]


@pytest.mark.parametrize("bad", [0, 65, -1, "3", 2.5, True])
def test_a_bad_x_shards_names_itself(broker: Broker, bad: Any) -> None:
    with broker.connection() as conn, pytest.raises(ValueError, match=r"'x-shards'.*1\.\.64"):
        sharded("bad", bad)(conn.default_channel).declare()


def test_a_shard_cannot_be_sharded_nor_a_fanout_queue(broker: Broker) -> None:
    with broker.connection() as conn:
        with pytest.raises(ValueError, match="itself a shard"):
            sharded(shards.shard_name("q", 0, 2))(conn.default_channel).declare()
        with pytest.raises(ValueError, match=r"'x-shards'.*fanout"):
            fanout = Queue("fq", Exchange("fx", "fanout"), queue_arguments={"x-shards": 2})
            fanout(conn.default_channel).declare()


# -- publish and consume on a cluster ------------------------------------------------------------


def test_round_robin_publish_and_a_consumer_draining_every_shard(cluster: Cluster) -> None:
    queue = sharded("hot")
    names = list(shards.shard_names("hot", 3))
    lib = ScriptLibrary(cluster.client(), Keyspace())
    with Connection(cluster_url(cluster)) as conn:
        producer = conn.Producer()
        for i in range(30):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="hot", declare=[queue])
        assert ready(lib, ["hot", *names]) == {"hot": 0, **dict.fromkeys(names, 10)}
        assert queue(conn.default_channel).queue_declare(passive=True).message_count == 30
        got = consume(conn, [queue], 30)
    assert sorted(m.payload["i"] for m in got) == list(range(30))
    assert {m.delivery_info["routing_key"] for m in got} == {"hot"}
    assert ready(lib, ["hot", *names]) == dict.fromkeys(["hot", *names], 0)
    assert all(s.in_flight == 0 for s in lib.stats(names))  # acked on their shards


def test_a_shard_key_keeps_a_key_on_one_shard(cluster: Cluster) -> None:
    queue = sharded("keyed")
    names = shards.shard_names("keyed", 3)
    lib = ScriptLibrary(cluster.client(), Keyspace())
    with Connection(cluster_url(cluster)) as conn:
        producer = conn.Producer()
        for i in range(24):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="keyed", declare=[queue],
                             headers={"x-shard-key": f"user-{i % 4}"})
    expected = Counter(names[zlib.crc32(f"user-{i % 4}".encode()) % 3] for i in range(24))
    assert ready(lib, list(names)) == {n: expected.get(n, 0) for n in names}
    assert len(expected) >= 2  # the four keys do not all land on one shard


def test_a_logical_queue_s_unsharded_messages_are_consumed_too(cluster: Cluster) -> None:
    """A producer that did not declare the queue sharded publishes to the logical queue
    itself, which the shards' consumers consume too."""
    queue = sharded("mixed")
    with Connection(cluster_url(cluster)) as conn:
        queue(conn.default_channel).declare()
    with Connection(cluster_url(cluster)) as unaware:
        plain = Queue("mixed", Exchange("mixed", "direct"), routing_key="mixed")
        unaware.Producer().publish({"i": "plain"}, exchange=plain.exchange, routing_key="mixed")
    with Connection(cluster_url(cluster)) as conn:
        conn.Producer().publish({"i": "sharded"}, exchange=queue.exchange, routing_key="mixed",
                                declare=[queue])
        got = consume(conn, [queue], 2)
    assert sorted(m.payload["i"] for m in got) == ["plain", "sharded"]


def test_purge_size_and_delete_act_on_every_shard(cluster: Cluster) -> None:
    queue = sharded("admin")
    names = ["admin", *shards.shard_names("admin", 3)]
    lib = ScriptLibrary(cluster.client(), Keyspace())
    with Connection(cluster_url(cluster)) as conn:
        bound = queue(conn.default_channel)
        producer = conn.Producer()
        for i in range(9):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="admin", declare=[queue])
        assert bound.queue_declare(passive=True).message_count == 9
        assert bound.purge() == 9
        assert sum(ready(lib, names).values()) == 0
        producer.publish({"i": 9}, exchange=queue.exchange, routing_key="admin")
        assert bound.queue_declare(passive=True).message_count == 1
        bound.delete()
    assert not any(lib.exists(name) for name in names)


def test_the_consumer_s_first_shard_turns(cluster: Cluster) -> None:
    """Batches of 2 from three full shards (a call per slot): were the first shard asked
    always the same, the first 6 deliveries would all be its; with the turn, each gives 2."""
    queue = sharded("turn")
    with Connection(cluster_url(cluster), transport_options={"consume_batch": 2}) as conn:
        producer = conn.Producer()
        for i in range(30):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="turn", declare=[queue])
        got = consume(conn, [queue], 30, prefetch_count=2)
    shard_of = {m.payload["i"]: m.payload["i"] % 3 for m in got}  # round-robin: i % 3 is its shard
    assert Counter(shard_of[m.payload["i"]] for m in got[:6]) == {0: 2, 1: 2, 2: 2}
    assert sorted(m.payload["i"] for m in got) == list(range(30))


def test_inversion_is_bounded_by_one_consume_batch_per_shard(cluster: Cluster) -> None:
    """FIFO across shards is given up: a message may go out after later ones of other shards,
    but at most one consume batch per other shard: the turn reaches its shard by then."""
    batch, count = 4, 3
    queue = sharded("order", count)
    with Connection(cluster_url(cluster), transport_options={"consume_batch": batch}) as conn:
        producer = conn.Producer()
        for i in range(60):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="order", declare=[queue])
        got = [m.payload["i"] for m in consume(conn, [queue], 60, prefetch_count=batch)]
    inversions = [sum(1 for later in got[:position] if later > i) for position, i in enumerate(got)]
    assert max(inversions) > 0  # the order is given up ...
    assert max(inversions) <= batch * (count - 1)  # ... within one batch of each other shard


# -- standalone -----------------------------------------------------------------------------------


def test_basic_get_and_no_ack_consume_over_shards(broker: Broker) -> None:
    queue = sharded("got", 2)
    with broker.connection() as conn:
        producer = conn.Producer()
        for i in range(4):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="got", declare=[queue])
        bound = queue(conn.default_channel)
        first, second = bound.get(), bound.get()
        assert first is not None and second is not None
        first.ack()
        second.ack()
        rest = consume(conn, [queue], 2, no_ack=True)
    assert sorted([first.payload["i"], second.payload["i"], *(m.payload["i"] for m in rest)]) == [0, 1, 2, 3]


def test_publishing_on_a_closed_channel_raises_a_connection_error(broker: Broker) -> None:
    with broker.connection() as conn:
        channel = conn.channel()
        queue = sharded("closed")(channel)
        queue.declare()
        channel.close()
        with pytest.raises(redis.ConnectionError, match="closed"):
            Producer(channel).publish({"i": 0}, exchange="", routing_key="closed")


# -- pause and limits over the logical queue -------------------------------------------------------


class _App:
    """What tools.flow needs of a Celery app: its broker connection."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def connection_for_write(self) -> Connection:
        return self.conn.clone()


def test_pause_and_resume_hold_every_shard(cluster: Cluster) -> None:
    queue = sharded("paused")
    lib = ScriptLibrary(cluster.client(), Keyspace())
    names = ["paused", *shards.shard_names("paused", 3)]
    with Connection(cluster_url(cluster)) as conn:
        queue(conn.default_channel).declare()
        assert flow.pause(_App(conn), "paused", "deploy") is True
        assert all(m.paused == "deploy" for m in lib.metrics(names))
        assert flow.pause(_App(conn), "paused", "again") is False
        assert flow.resume(_App(conn), "paused") is True
        assert all(m.paused is None for m in lib.metrics(names))


def test_limits_are_split_over_the_shards(cluster: Cluster) -> None:
    queue = sharded("limited")
    lib = ScriptLibrary(cluster.client(), Keyspace())
    names = list(shards.shard_names("limited", 3))
    with Connection(cluster_url(cluster)) as conn:
        queue(conn.default_channel).declare()
        limits = flow.limit(_App(conn), "limited", in_flight=8, rate="20/s")
        assert (limits.in_flight, limits.rate) == (8, "20/s")
        assert [(m.limits.in_flight, m.limits.rate) for m in lib.metrics(names)] == \
            [(3, "7/s"), (3, "7/s"), (2, "6/s")]
        assert lib.metrics(["limited"])[0].limits.in_flight == 8
        assert flow.limit(_App(conn), "limited", in_flight=2).in_flight == 3  # 1 each at least
        cleared = flow.clear_limits(_App(conn), "limited")
        assert (cleared.in_flight, cleared.rate) == (None, None)
        assert all(m.limits.in_flight is None and m.limits.rate is None for m in lib.metrics(names))


def test_an_in_flight_limit_holds_over_the_logical_queue(cluster: Cluster) -> None:
    queue = sharded("capped")
    with Connection(cluster_url(cluster)) as conn:
        producer = conn.Producer()
        for i in range(12):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="capped", declare=[queue])
        flow.limit(_App(conn), "capped", in_flight=6)
        held = consume(conn, [queue], 6, ack=False)
        with Connection(cluster_url(cluster)) as other:
            assert queue(other.default_channel).get() is None  # 2 in flight on each shard: full
        for message in held:
            message.ack()
        assert len(consume(conn, [queue], 6)) == 6


# -- status and the exporter ---------------------------------------------------------------------


def test_status_and_the_exporter_show_the_logical_queue_and_each_shard(cluster: Cluster) -> None:
    from click.testing import CliRunner

    from celery_redis_lua.tools.cli import main
    from celery_redis_lua.tools.exporter import QueueCollector

    queue = sharded("watched")
    names = list(shards.shard_names("watched", 3))
    with Connection(cluster_url(cluster)) as conn:
        producer = conn.Producer()
        for i in range(7):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="watched", declare=[queue])
        flow.limit(_App(conn), "watched", in_flight=9)
    url = cluster_url(cluster)
    for args in ([], ["--queue", "watched"]):
        result = CliRunner().invoke(main, ["status", "--json", "--url", url, *args])
        assert result.exit_code == 0, result.output
        rows = {row["queue"]: row for row in json.loads(result.output.splitlines()[0])["queues"]}
        assert list(rows) == ["watched", *names]
        assert rows["watched"]["ready"] == 7 and rows["watched"]["shards"] == names
        assert rows["watched"]["limits"]["in_flight"] == 9
        assert [rows[n]["ready"] for n in names] == [3, 2, 2]
        assert {rows[n]["shard_of"] for n in names} == {"watched"}
    lib = ScriptLibrary(cluster.client(), Keyspace())
    for collector in (QueueCollector(lib), QueueCollector(lib, ["watched"])):
        samples = [(family.name, sample.labels, sample.value) for family in collector.collect()
                   for sample in family.samples]
        assert ("celery_queue_length", {"queue_name": "watched"}, 7) in samples
        assert not [s for s in samples if s[1].get("queue_name", s[1].get("queue")) in names]
        per_shard = {s[1]["shard"]: s[2] for s in samples
                     if s[0] == "celery_redis_lua_queue_shard" and s[1]["state"] == "ready"}
        assert per_shard == dict(zip(names, [3, 2, 2], strict=True))


def test_unconfirmed_publishes_spread_over_the_shards_too(broker: Broker) -> None:
    queue = sharded("fast")
    names = list(shards.shard_names("fast", 3))
    with broker.connection(confirm_publish=False) as conn:
        producer = conn.Producer()
        for i in range(9):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="fast", declare=[queue])
        assert queue(conn.default_channel).queue_declare(passive=True).message_count == 9  # settled first
        lib = conn.default_channel.lib
        assert ready(lib, ["fast", *names]) == {"fast": 0, **dict.fromkeys(names, 3)}
        got = consume(conn, [queue], 9)
    assert sorted(m.payload["i"] for m in got) == list(range(9))


def test_empty_shards_wait_instead_of_costing_a_call_each_round(cluster: Cluster) -> None:
    """All 80 messages in one shard, taken 4 at a time: the shards found empty block on their
    wake lists from the first round on, so their primaries see a consume or two, not one
    for every batch the busy shard gives."""
    queue = sharded("lopsided")
    names = shards.shard_names("lopsided", 3)
    busy = names[zlib.crc32(b"same") % 3]
    client = cluster.client()
    busy_node = client.get_node_from_key(Keyspace().queue(busy))
    others = [node for node in client.get_primaries() if node.name != busy_node.name]

    def evalsha_calls() -> int:
        return sum(client.get_redis_connection(node).info("commandstats").get("cmdstat_evalsha", {})
                   .get("calls", 0) for node in others)

    options = {"consume_batch": 4, "sweep_interval": 60}
    with Connection(cluster_url(cluster), transport_options=options) as conn:
        producer = conn.Producer()
        for i in range(80):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key="lopsided", declare=[queue],
                             headers={"x-shard-key": "same"})
        got: list[Any] = []
        with Consumer(conn, [queue], callbacks=[lambda body, message: (got.append(body), message.ack())],
                      prefetch_count=4):
            before = evalsha_calls()  # the declares and binds made
            drain(conn, got, 80)
            wasted = evalsha_calls() - before
    assert sorted(body["i"] for body in got) == list(range(80))
    assert wasted <= 8, f"{wasted} consume calls on the primaries of the empty shards for 20 batches"


def test_an_unbind_or_delete_elsewhere_is_never_followed_by_the_old_route_to_a_shard(broker: Broker) -> None:
    """A producer's cached table still routes to the sharded queue after another connection
    unbound (then deleted) it: the publish to a shard is refused as a stale route, as one to
    the queue would be, so nothing lands in a shard, nor brings one back into being."""
    exchange = Exchange("routed", "direct")
    plain, split = Queue("plain", exchange, routing_key="rk"), \
        Queue("split", exchange, routing_key="rk", queue_arguments={"x-shards": 2})
    names = ["split", *shards.shard_names("split", 2)]
    with broker.connection() as conn, broker.connection() as other:
        lib = conn.default_channel.lib
        producer = conn.Producer()
        producer.publish("both", exchange=exchange, routing_key="rk", declare=[plain, split])
        assert sum(ready(lib, names).values()) == 1
        elsewhere = split(other.default_channel)
        elsewhere.declare()
        elsewhere.unbind_from(exchange=exchange, routing_key="rk")
        producer.publish("plain only", exchange=exchange, routing_key="rk")
        assert ready(lib, ["plain"]) == {"plain": 2} and sum(ready(lib, names).values()) == 1
        elsewhere.delete()
        producer.publish("after the delete", exchange=exchange, routing_key="rk")
        assert ready(lib, ["plain"]) == {"plain": 3}
        assert not any(lib.exists(name) for name in names)
