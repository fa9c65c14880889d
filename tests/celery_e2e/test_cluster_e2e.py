"""Celery on a three-primary cluster (Valkey and Redis): a worker consuming queues placed on
different primaries (asserted) runs every task exactly once, in priority order within a
queue, with a countdown held in the broker; remote control (ping, a broadcast, shutdown)
works."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from celery import Celery

from celery_redis_lua import Keyspace
from scripts.servers import Cluster

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for


def queues_on_two_primaries(cluster: Cluster) -> list[str]:
    client, keys = cluster.client(), Keyspace()
    nodes: dict[str, str] = {}
    for i in itertools.count():
        name = f"work-{i}"
        nodes.setdefault(client.get_node_from_key(keys.queue(name)).name, name)
        if len(nodes) == 2:
            client.close()
            return list(nodes.values())


def test_celery_runs_on_a_cluster(cluster_broker: tuple[Broker, Cluster], tmp_path: Path) -> None:
    broker, cluster = cluster_broker
    first, second = queues_on_two_primaries(cluster)
    producer: Celery = make_producer(broker)
    worker = Worker(broker, name="cw", pool="threads", concurrency=1, log_dir=tmp_path,
                    extra_args=["-Q", f"{first},{second}"], env={"CRL_PREFETCH": "1"})
    # Queued before the worker starts: it must take them highest priority first.
    for priority in (1, 9, 5):
        producer.send_task("celery_e2e.app.note", (f"p{priority}",), queue=first, priority=priority)
    with running(worker):
        wait_for(lambda: len(broker.entries("ran")) >= 3, timeout=60, what="the queued tasks ran")
        assert [e["label"] for e in broker.entries("ran")][:3] == ["p9", "p5", "p1"]
        for i in range(40):
            producer.send_task("celery_e2e.app.note", (f"t{i}",), queue=(first, second)[i % 2])
        sent = time.time()
        producer.send_task("celery_e2e.app.note", ("later",), queue=second, countdown=2)
        wait_for(lambda: len(broker.entries("ran")) >= 3 + 41, timeout=90, what="every task ran")
        ran = [e["label"] for e in broker.entries("ran")]
        assert sorted(ran) == sorted(["p1", "p5", "p9", *(f"t{i}" for i in range(40)), "later"])
        later = next(e for e in broker.entries("ran") if e["label"] == "later")
        assert later["at"] - sent >= 1.9  # held in the broker until its ETA
        replies = producer.control.ping(timeout=5)
        assert any("cw@" in name for reply in replies for name in reply), replies
        producer.control.broadcast("rate_limit", arguments={"task_name": "celery_e2e.app.note",
                                                            "rate_limit": "100/s"}, reply=True, timeout=5)
        # `celery control shutdown` through the fanout stream: the worker ends, warm (exit 0).
        [name] = [name for reply in replies for name in reply if name.startswith("cw@")]
        producer.control.shutdown(destination=[name])
        assert worker.wait(30) == 0
