"""The transport on Redis Cluster and Valkey Cluster (three primaries), through plain kombu:
queues placed on every primary (asserted), publish, consume and ack routed to the node that
owns each queue, a consumer blocked on queues of three nodes woken by a message on any of
them, fanout across the cluster, and the URL and option errors."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Queue
from kombu.exceptions import OperationalError

from celery_redis_lua import Keyspace, ScriptLibrary
from conftest import cluster_url, require_kind
from scripts.servers import Cluster


def one_queue_per_primary(cluster: Cluster, prefix: str) -> list[str]:
    """Queue names whose slots belong to three different primaries."""
    client, keys = cluster.client(), Keyspace()
    found: dict[str, str] = {}
    for i in itertools.count():
        name = f"{prefix}-{i}"
        node = client.get_node_from_key(keys.queue(name)).name
        found.setdefault(node, name)
        if len(found) == len(cluster.nodes):
            return sorted(found.values())


def stats(cluster: Cluster, queues: list[str]) -> dict[str, tuple[int, int]]:
    lib = ScriptLibrary(cluster.client(), Keyspace())
    return {s.queue: (s.ready, s.in_flight) for s in lib.stats(queues)}


def test_queues_on_every_primary_publish_consume_and_ack(cluster: Cluster) -> None:
    names = one_queue_per_primary(cluster, "spread")
    client = cluster.client()
    assert len({client.get_node_from_key(Keyspace().queue(n)).name for n in names}) == 3
    exchange = Exchange("spread", "direct")
    queues = [Queue(name, exchange, routing_key=name) for name in names]
    got: list[Any] = []
    with Connection(cluster_url(cluster)) as conn:
        producer = conn.Producer()
        for i in range(30):
            name = names[i % 3]
            producer.publish({"i": i}, exchange=exchange, routing_key=name, declare=queues)
        assert stats(cluster, names) == {name: (10, 0) for name in names}
        with Consumer(conn, queues, callbacks=[lambda body, message: (got.append(body), message.ack())]):
            while len(got) < 30:
                conn.drain_events(timeout=10)
    assert sorted(body["i"] for body in got) == list(range(30))
    deadline = time.monotonic() + 10
    while stats(cluster, names) != {name: (0, 0) for name in names}:  # the acks are batched
        assert time.monotonic() < deadline, stats(cluster, names)
        time.sleep(0.02)


def test_a_consumer_blocked_on_three_nodes_wakes_for_any_of_them(cluster: Cluster) -> None:
    names = one_queue_per_primary(cluster, "woken")
    exchange = Exchange("woken", "direct")
    queues = [Queue(name, exchange, routing_key=name) for name in names]
    got: list[tuple[str, float]] = []
    # blocking_timeout 30 s: a wait that was not woken would hold each message that long.
    with Connection(cluster_url(cluster), transport_options={"blocking_timeout": 30}) as consumer_conn, \
            Connection(cluster_url(cluster)) as producer_conn:
        producer = producer_conn.Producer()
        def received(body: Any, message: Any) -> None:
            got.append((body, time.monotonic()))
            message.ack()

        with Consumer(consumer_conn, queues, callbacks=[received]):
            with pytest.raises(TimeoutError):
                consumer_conn.drain_events(timeout=0.5)  # every wait is now blocked on its node
            for name in [*names, *names]:
                sent = time.monotonic()
                producer.publish(name, exchange=exchange, routing_key=name, declare=queues)
                consumer_conn.drain_events(timeout=10)
                body, at = got[-1]
                assert body == name
                assert at - sent < 5, f"{name}: delivered {at - sent:.1f} s after its publish"


def test_fanout_reaches_every_bound_queue_on_the_cluster(cluster: Cluster) -> None:
    exchange = Exchange("cluster-broadcast", "fanout")
    names = one_queue_per_primary(cluster, "listener")
    queues = [Queue(name, exchange) for name in names]
    got: dict[str, list[Any]] = {name: [] for name in names}
    with Connection(cluster_url(cluster)) as conn:
        consumers = [Consumer(conn, [q], callbacks=[lambda body, message, n=q.name: got[n].append(body)])
                     for q in queues]
        for consumer in consumers:
            consumer.consume()
        conn.Producer().publish("to all", exchange=exchange, routing_key="")
        deadline = time.monotonic() + 10
        while not all(got.values()):
            assert time.monotonic() < deadline, got
            conn.drain_events(timeout=10)
        for consumer in consumers:
            consumer.cancel()
    assert got == {name: ["to all"] for name in names}


@pytest.mark.parametrize(("broker_url", "options", "error"), [
    ("redislua+cluster://127.0.0.1:{port}/1", {}, "a cluster has only database 0"),
    ("redislua://127.0.0.1:{port}/0", {"cluster": True, "cluster_nodes": ["nohost:"]},
     "cluster node must be 'host:port'"),
    ("redislua://127.0.0.1:{port}/0", {"cluster": True, "cluster_nodes": "127.0.0.1:7000"},
     "'cluster_nodes' must be a list of 'host:port' strings"),
])
def test_bad_cluster_urls_and_options_name_the_problem(valkey_cluster: Cluster, broker_url: str,
                                                      options: dict[str, Any], error: str) -> None:
    broker_url = broker_url.format(port=valkey_cluster.nodes[0].port)
    with Connection(broker_url, transport_options=options) as conn, pytest.raises(ValueError, match=error):
        conn.default_channel  # noqa: B018


def test_the_class_route_with_the_cluster_option(valkey_cluster: Cluster) -> None:
    port = valkey_cluster.nodes[0].port
    seeds = [f"127.0.0.1:{n.port}" for n in valkey_cluster.nodes]
    with Connection(f"redis://127.0.0.1:{port}/0", transport="celery_redis_lua:Transport",
                    transport_options={"cluster": True, "cluster_nodes": seeds}) as conn:
        queue = Queue("class-route", Exchange("class-route", "direct"), routing_key="class-route")
        conn.Producer().publish("via the class route", exchange=queue.exchange, routing_key="class-route",
                                declare=[queue])
        message = queue(conn.default_channel).get()
        assert message is not None and message.payload == "via the class route"
        message.ack()


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_a_password_cluster_with_a_key_prefix(kind: str) -> None:
    """Credentials in the URL reach every node (the discovered ones too); a wrong password is
    retried as a lost connection (as on a standalone server) and named in the error, not a
    hang; global_keyprefix applies on every primary."""
    require_kind(kind)
    with Cluster(kind, password="s3cret") as cluster:
        names = one_queue_per_primary(cluster, "auth")
        exchange = Exchange("auth", "direct")
        queues = [Queue(name, exchange, routing_key=name) for name in names]
        good = f"redislua+cluster://:s3cret@127.0.0.1:{cluster.nodes[0].port}/0"
        with Connection(good, transport_options={"global_keyprefix": "app:"}) as conn:
            for name in names:
                conn.Producer().publish(name, exchange=exchange, routing_key=name, declare=queues)
            got = [queue(conn.default_channel).get() for queue in queues]
            assert [m.payload for m in got if m is not None] == names
            for message in got:
                message.ack()
        client = cluster.client()
        assert {client.get_node_from_key(Keyspace("app:").meta(n)).port for n in names} == {
            n.port for n in cluster.nodes}
        assert all(key.startswith(b"app:") for key in client.keys("*", target_nodes=client.PRIMARIES))
        bad = good.replace("s3cret", "wrong")
        began = time.monotonic()
        with Connection(bad, connect_timeout=5) as conn, pytest.raises(
                OperationalError, match="invalid username-password pair"):
            conn.ensure_connection(max_retries=1)
        # Refused at once, not ridden out as a broker out of reach for reconnect_window (10 s)
        # on each of the two tries: this process reached the cluster before, with the password.
        assert time.monotonic() - began < 10


def test_the_cli_covers_every_primary(cluster: Cluster) -> None:
    """status finds queues on every node; publish and dead list route to the queue's node."""
    from click.testing import CliRunner

    from celery_redis_lua.tools.cli import main

    names = one_queue_per_primary(cluster, "cli")
    cli_url = cluster_url(cluster)
    for name in names:
        published = CliRunner().invoke(main, ["publish", "tasks.add", "--queue", name, "--url", cli_url])
        assert published.exit_code == 0, published.output
    status = CliRunner().invoke(main, ["status", "--url", cli_url])
    assert status.exit_code == 0, status.output
    rows = {line.split()[0]: line.split()[1:] for line in status.stdout.splitlines()[1:]}
    assert {name: rows.get(name) for name in names} == {name: ["1", "0", "0", "0", "0", "no", "-"]
                                                         for name in names}
    bad = CliRunner().invoke(main, ["status", "--url", cli_url.replace("/0", "/2")])
    assert bad.exit_code != 0 and "a cluster has only database 0" in bad.stderr


def test_the_cli_loads_the_scripts_on_every_primary_and_lists_dead_letters_anywhere(
        cluster: Cluster) -> None:
    from click.testing import CliRunner

    from celery_redis_lua.protocol.contract import load_scripts
    from celery_redis_lua.tools.cli import main

    client = cluster.client()
    client.script_flush()
    loaded = CliRunner().invoke(main, ["scripts", "load", "--url", cluster_url(cluster)])
    assert loaded.exit_code == 0, loaded.output
    shas = [script.sha1 for script in load_scripts().values()]
    for node in cluster.nodes:  # each primary on its own, not the cluster client's summary
        assert node.client().script_exists(*shas) == [True] * len(shas), node.port
    names = one_queue_per_primary(cluster, "dl")
    lib = ScriptLibrary(client, Keyspace())
    rejected = {}
    for name in names:
        lib.publish(name, "doomed")
        [delivery] = lib.consume([name], 1).deliveries
        lib.reject(name, [delivery.id], requeue=False)
        rejected[name] = delivery.id
    for name, message_id in rejected.items():
        listed = CliRunner().invoke(main, ["dead", "list", name, "--url", cluster_url(cluster)])
        assert listed.exit_code == 0, listed.output
        assert message_id in listed.stdout and "rejected" in listed.stdout, listed.stdout


def test_the_cli_reaches_a_cluster_the_way_the_apps_workers_do(cluster: Cluster, tmp_path: Any) -> None:
    """-A an app whose broker is a cluster by its transport options (a plain URL naming one
    seed, the class route): the CLI's client is the transport's own, so it sees every primary."""
    import os
    import subprocess
    import sys

    names = one_queue_per_primary(cluster, "app")
    lib = ScriptLibrary(cluster.client(), Keyspace())
    for name in names:
        lib.publish(name, "m")
    seed = cluster.nodes[0].port
    (tmp_path / "proj.py").write_text(
        "from celery import Celery\n"
        f"app = Celery('proj', broker='redislua://127.0.0.1:{seed}/0')\n"
        "app.conf.broker_transport_options = {'cluster': True}\n")
    env = {k: v for k, v in os.environ.items() if k != "CELERY_BROKER_URL"}
    done = subprocess.run([sys.executable, "-m", "celery_redis_lua", "status", "--json", "-A", "proj"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    import json
    found = {row["queue"]: row["ready"] for row in json.loads(done.stdout)["queues"]}
    assert {name: found.get(name) for name in names} == {name: 1 for name in names}
