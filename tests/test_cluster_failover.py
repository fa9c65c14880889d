"""The transport on a cluster whose topology changes under load (three primaries, one replica
each, Valkey and Redis): a primary SIGKILLed (its replica promoted), a manual CLUSTER
FAILOVER, a slot migrated while publishes run into it (TRYAGAIN, ASK, MOVED), and the
durability option on a cluster (the wait runs on the node that ran the write).

The promoted replica never saw SCRIPT LOAD (scripts are a per-node cache), so its first
EVALSHA answers NOSCRIPT: the test asserts the script was missing there and that nobody
noticed."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.exceptions import OperationalError
from kombu.mixins import ConsumerMixin

from celery_redis_lua import Keyspace, Policy, ScriptLibrary
from celery_redis_lua.protocol.contract import load_scripts
from celery_redis_lua.protocol.durability import Durability, NotDurable
from conftest import require_kind
from helpers import names_on_each_node, wait_until
from scripts.servers import Cluster, Server
from spares import fresh_cluster

VISIBILITY_SECONDS = 5
MESSAGES = 600
FAULT_AFTER = 150  # confirmed publishes before the fault


@pytest.fixture(params=["valkey", "redis"])
def replicated(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A fresh three-primary cluster with a replica each, failing over 1 s after a primary
    stops answering (the topology tests change it, so no other test shares it)."""
    require_kind(request.param)
    cluster = fresh_cluster(request.param, replicas=1, node_timeout_ms=1000)  # started one test ahead
    try:
        yield cluster
    finally:
        cluster.stop()


def url(cluster: Cluster) -> str:
    return f"redislua+cluster://127.0.0.1:{cluster.nodes[0].port}/0"


class Collector(ConsumerMixin):  # type: ignore[misc]
    """kombu's own reconnecting consumer: what a kombu application runs."""

    def __init__(self, connection: Connection, queue: Queue) -> None:
        self.connection, self.queue = connection, queue
        self.got: list[tuple[int, float]] = []
        self.connection_errors = 0

    def get_consumers(self, consumer: Any, channel: Any) -> list[Any]:
        return [consumer(queues=[self.queue], callbacks=[self.on_message], prefetch_count=20)]

    def on_message(self, body: dict[str, int], message: Any) -> None:
        self.got.append((body["i"], time.time()))
        message.ack()

    def on_connection_error(self, exc: Exception, interval: float) -> None:
        self.connection_errors += 1
        super().on_connection_error(exc, interval)


class Publisher(threading.Thread):
    """Publishes MESSAGES numbered messages (kombu's retrying publish), a few ms apart;
    ``confirmed`` holds those whose publish returned."""

    def __init__(self, cluster_url: str, options: dict[str, Any], exchange: Exchange, queue: Queue) -> None:
        super().__init__(daemon=True)
        self.url, self.options, self.exchange, self.queue = cluster_url, options, exchange, queue
        self.confirmed: list[int] = []
        self.unconfirmed: list[int] = []  # applied, but not yet on a replica (NotDurable)
        # Publishes kombu retried after a lost connection: the first try may have been stored
        # (its reply lost with the primary), and a plain kombu message has no task id for the
        # publish script to know it again, so the retry can store it a second time.
        self.retried: set[int] = set()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        with Connection(self.url, transport_options=self.options) as conn:
            producer = conn.Producer()
            for i in range(MESSAGES):
                policy = {"max_retries": 100, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.3,
                          "errback": lambda exc, interval, i=i: self.retried.add(i)}
                try:
                    producer.publish({"i": i}, exchange=self.exchange, routing_key=self.queue.name,
                                     declare=[self.queue], retry=True, retry_policy=policy)
                    self.confirmed.append(i)
                except NotDurable:  # the new primary has no replica until the old one rejoins
                    self.unconfirmed.append(i)
                except Exception as error:  # recorded; the test fails on it
                    self.errors.append(error)
                time.sleep(0.004)


def script_cached(server: Server, name: str) -> bool:
    return bool(server.client(socket_timeout=5).script_exists(load_scripts()[name].sha1)[0])


@pytest.mark.parametrize("fault", ["sigkill", "cluster-failover"])
def test_publishing_and_consuming_go_on_across_a_failover(replicated: Cluster, fault: str) -> None:
    name = "failover"
    owner = replicated.owner(Keyspace().queue(name))
    replica = replicated.replica_of(owner)
    # A SIGKILL can take writes the replica never got (replication is asynchronous): with
    # durability, a publish returns only once the replica has it, so none is lost. A manual
    # failover waits for the replica to catch up, so it needs no durability.
    options: dict[str, Any] = {"visibility_timeout": VISIBILITY_SECONDS}
    if fault == "sigkill":
        options["durability"] = "replicas:1"
    exchange = Exchange(name, "direct")
    queue = Queue(name, exchange, routing_key=name)
    publisher = Publisher(url(replicated), options, exchange, queue)
    with Connection(url(replicated), transport_options=options) as conn:
        collector = Collector(conn, queue)
        consuming = threading.Thread(target=collector.run, daemon=True)
        consuming.start()
        publisher.start()
        wait_until(lambda: len(publisher.confirmed) >= FAULT_AFTER, timeout=30)
        assert not script_cached(replica, "publish"), "the replica had the script already"
        began = time.time()
        if fault == "sigkill":
            new = replicated.kill_primary(owner)
            replicated.start_again(owner)  # it rejoins as the new primary's replica
            replicated.wait_healthy()
        else:
            new = replicated.failover(owner)
        ended = time.time()
        publisher.join(120)
        assert not publisher.errors, publisher.errors[:3]
        try:
            wait_until(lambda: set(publisher.confirmed) <= {i for i, _ in collector.got}, timeout=60)
        finally:
            collector.should_stop = True
            consuming.join(20)
    assert new.port == replica.port
    assert script_cached(new, "publish")  # loaded on NOSCRIPT, without the caller noticing
    received = {i for i, _ in collector.got}
    assert set(publisher.confirmed) <= received
    assert received <= set(publisher.confirmed) | set(publisher.unconfirmed)
    assert len(publisher.unconfirmed) < MESSAGES // 4, "publishes kept failing after the rejoin"
    # A duplicate is a delivery whose ack the old primary took (or never got) as it went
    # away (its first delivery came before the fault ended), or a publish kombu retried
    # after the primary died with its reply (stored twice: no task id to know it again).
    first_seen: dict[int, float] = {}
    for i, at in collector.got:
        if i in first_seen and i not in publisher.retried:
            assert first_seen[i] <= ended + 1.0, f"message {i} delivered twice, first after the fault"
        first_seen.setdefault(i, at)
    assert sum(1 for _, at in collector.got if at > ended) > 0  # consumed after it, same consumer
    assert min(first_seen.values()) < began


def test_a_publish_into_a_slot_being_migrated_is_retried_and_stored_once(replicated: Cluster) -> None:
    """MIGRATING on the source, IMPORTING on the target, some of the queue's keys moved:
    the source answers TRYAGAIN (a script's keys are split) until the migration ends, then
    MOVED. kombu's publish returns once it ran, exactly once."""
    name = "moving"
    keys = Keyspace()
    source = replicated.owner(keys.queue(name))
    target = next(p for p in replicated.primaries() if p.port != source.port)
    exchange = Exchange(name, "direct")
    queue = Queue(name, exchange, routing_key=name)
    slot = keys.slot(name)
    src, dst = source.client(socket_timeout=5), target.client(socket_timeout=5)
    with Connection(url(replicated)) as conn:
        producer = conn.Producer()
        producer.publish({"i": 0}, exchange=exchange, routing_key=name, declare=[queue])
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.execute_command("CLUSTER", "MYID"))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.execute_command("CLUSTER", "MYID"))
        moved = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", moved[0])

        def finish() -> None:
            time.sleep(0.3)  # the fault: the migration is half done this long
            for key in src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", key)
            for node in replicated.primaries():
                node.client(socket_timeout=5).execute_command(
                    "CLUSTER", "SETSLOT", slot, "NODE", dst.execute_command("CLUSTER", "MYID"))

        with pytest.raises(redis.exceptions.TryAgainError):  # what the source answers now
            ScriptLibrary(source.client(socket_timeout=5)).publish(name, "{}")
        finishing = threading.Thread(target=finish)
        finishing.start()
        producer.publish({"i": 1}, exchange=exchange, routing_key=name, declare=[queue], retry=True,
                         retry_policy={"max_retries": 50, "interval_start": 0, "interval_step": 0.05,
                                       "interval_max": 0.1})
        finishing.join()
        assert replicated.owner(keys.queue(name)).port == target.port
        simple = conn.SimpleQueue(queue)
        bodies = [simple.get(timeout=10) for _ in range(2)]
        for message in bodies:
            message.ack()
        assert sorted(m.payload["i"] for m in bodies) == [0, 1]
        with pytest.raises(simple.Empty):
            simple.get(timeout=0.5)
        simple.close()


def test_durability_on_a_cluster_waits_on_the_node_that_ran_the_write(replicated: Cluster) -> None:
    client, keys = replicated.client(), Keyspace()
    names = names_on_each_node(client, keys, "durable")
    confirmed = ScriptLibrary(client, keys, Policy(durability=Durability.parse("replicas:1", 2000)))
    ids = confirmed.run_many([confirmed.calls.publish(name, "{}") for name in names])
    assert len(ids) == 3
    # Each primary has one replica: asking for two falls short on every node, and says so.
    greedy = ScriptLibrary(client, keys, Policy(durability=Durability.parse("replicas:2", 200)))
    with pytest.raises(NotDurable, match="replicas:2"):
        greedy.publish(names[1], "{}")
    assert sum(s.ready for s in confirmed.stats(names)) == 4  # applied, not confirmed


def test_the_durability_probe_meets_a_primary_down_as_a_lost_connection(replicated: Cluster) -> None:
    """Connecting with durability while a primary is down (before its replica took over):
    the probe's refused connection is a connection error kombu retries, not a refusal of the
    setting (a chaos run met DurabilityUnavailable here, and workers stopped reconnecting)."""
    client = replicated.client()
    replicated.primaries()[0].kill()
    with pytest.raises(redis.exceptions.ConnectionError):
        Durability.parse("replicas:1", 500).check_server(client)


def test_the_durability_probe_meets_a_demoted_primary_as_a_lost_connection(replicated: Cluster) -> None:
    """Connecting with durability while the client's slot map is stale (it still calls a
    primary that a failover just demoted one): WAIT on that node is refused ("cannot be used
    with replica instances"), which is a failover under way, not a server that cannot honour
    the setting. It is a lost connection kombu retries, the map is refreshed by then, and the
    retry finds the new primary (CI met DurabilityUnavailable here, and a publisher gave up)."""
    client = replicated.client()
    demoted = replicated.primaries()[0]
    assert demoted.port in {int(node.port) for node in client.get_primaries()}
    replicated.failover(demoted)  # the client's map is now stale: it has not asked since
    durability = Durability.parse("replicas:1", 500)
    with pytest.raises(redis.exceptions.ClusterError, match="replica"):
        durability.check_server(client)
    assert demoted.port not in {int(node.port) for node in client.get_primaries()}
    assert durability.check_server(client) == 1  # what kombu's retry meets


# Celery's default task_publish_retry_policy (celery/app/defaults.py): what apply_async retries with.
CELERY_PUBLISH_RETRY = {"max_retries": 3, "interval_start": 0, "interval_max": 1, "interval_step": 0.2}


@pytest.mark.parametrize(("window", "task_id"), [(None, "task-1"), (0, "task-1"), (None, None)])
def test_a_publish_into_a_slot_whose_primary_died_waits_for_its_replica(
        replicated: Cluster, window: int | None, task_id: str | None) -> None:
    """A primary SIGKILLed: until its replica is promoted (node timeout 1 s, then the
    election) its slots have no owner, while the rest of the cluster answers. kombu's retry
    reconnects at once (other nodes answer) and sends again at once, so Celery's default
    policy (3 retries) was spent in a few ms and apply_async raised OperationalError (chaos
    seed 1013). The channel now waits the slot's failover out, up to reconnect_window (10 s;
    0: as before), and the publish returns once the promoted replica stored it. Only a task's
    publish (a task id, as Celery's) is sent again: its reply may be what was lost, and the
    task index stores a second copy once."""
    name = "orphaned"
    owner = replicated.owner(Keyspace().queue(name))
    replica = replicated.replica_of(owner)
    queue = Queue(name, Exchange(name, "direct"), routing_key=name)
    options = {} if window is None else {"reconnect_window": window}
    with Connection(url(replicated), transport_options=options) as conn:
        producer = conn.Producer()
        producer.publish({"i": 0}, exchange=queue.exchange, routing_key=name, declare=[queue])
        owner.kill()
        killed = time.monotonic()
        if window == 0 or task_id is None:  # off, or a message a resend might store twice
            with pytest.raises(OperationalError, match="Connection refused"):
                headers = {"id": task_id} if task_id else None
                producer.publish({"i": 1}, exchange=queue.exchange, routing_key=name, retry=True,
                                 retry_policy=CELERY_PUBLISH_RETRY, headers=headers)
            return
        producer.publish({"i": 1}, exchange=queue.exchange, routing_key=name, retry=True,
                         retry_policy=CELERY_PUBLISH_RETRY, headers={"id": "task-1"})
        waited = time.monotonic() - killed
        # The promoted replica stored it; a node that answers CLUSTER SLOTS may learn of it later.
        wait_until(lambda: replicated.owner(Keyspace().queue(name)).port == replica.port, timeout=10)
        simple = conn.SimpleQueue(queue)
        got = []
        with contextlib.suppress(simple.Empty):
            while True:
                message = simple.get(timeout=2)
                got.append(message.payload["i"])
                message.ack()
        simple.close()
    assert 1 in got, f"the publish returned but its message is not there: {got}"
    assert got.count(1) == 1
    assert waited < 15, waited  # the failover's time (node timeout 1 s and the election), not the window's
