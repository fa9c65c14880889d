"""Celery on a sharded queue (``x-shards: 3``) of a three-primary cluster, Valkey and Redis:
the producer spreads its tasks over the three shards (one per primary, asserted), by a shard
key too, and a worker consuming the logical queue runs every task exactly once.

The slow test puts a Celery load on one logical queue and measures each primary's share of
the server CPU (INFO CPU, used_cpu_sys + used_cpu_user, before and after): each must be
within 15% of a third. It prints the server CPU per task, sharded and on a plain queue.
"""

from __future__ import annotations

import zlib
from collections import Counter
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol import shards
from scripts.servers import Cluster

from .app import sharded_queue
from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for


def sharded_producer(broker: Broker, spec: str) -> Celery:
    producer = make_producer(broker)
    producer.conf.task_queues = [sharded_queue(spec)]
    return producer


def test_celery_runs_every_task_of_a_sharded_queue_once(cluster_broker: tuple[Broker, Cluster],
                                                        tmp_path: Path) -> None:
    broker, cluster = cluster_broker
    names = list(shards.shard_names("hot", 3))
    client = cluster.client()
    assert len({client.get_node_from_key(Keyspace().queue(n)).name for n in names}) == 3
    producer = sharded_producer(broker, "hot:3")
    for i in range(60):  # queued before the worker starts: the shards hold them
        producer.send_task("celery_e2e.app.note", (f"t{i}",), queue="hot")
    for i in range(12):
        producer.send_task("celery_e2e.app.note", (f"k{i}",), queue="hot", headers={"x-shard-key": "one"})
    lib = ScriptLibrary(client, Keyspace())
    ready = {s.queue: s.ready for s in lib.stats(["hot", *names])}
    keyed = names[zlib.crc32(b"one") % 3]
    assert ready == {"hot": 0, **{n: 20 + (12 if n == keyed else 0) for n in names}}
    worker = Worker(broker, name="sw", pool="threads", concurrency=4, log_dir=tmp_path,
                    extra_args=["-Q", "hot"], env={"CRL_SHARDED": "hot:3"})
    with running(worker):
        wait_for(lambda: len(broker.entries("ran")) >= 72, timeout=90, what="every task ran")
        for i in range(30):  # and while it runs
            producer.send_task("celery_e2e.app.note", (f"l{i}",), queue="hot")
        wait_for(lambda: len(broker.entries("ran")) >= 102, timeout=90, what="every later task ran")
        ran = Counter(e["label"] for e in broker.entries("ran"))
        expected = [f"t{i}" for i in range(60)] + [f"k{i}" for i in range(12)] + [f"l{i}" for i in range(30)]
        assert ran == Counter(expected)  # each once
        wait_for(lambda: all(s.ready == s.in_flight == 0 for s in lib.stats(["hot", *names])), timeout=30,
                 what="every shard drained and acked")
    client.close()


def cpu_seconds(port: int) -> float:
    with redis.Redis(port=port) as node:
        info = node.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def cpu_of_a_load(broker: Broker, cluster: Cluster, tmp_path: Path, queue: str, spec: str | None,
                  tasks: int) -> list[float]:
    """Each primary's server CPU (s) while ``tasks`` Celery tasks go through ``queue``:
    published by this process, run by a threads worker, acked."""
    producer = sharded_producer(broker, spec) if spec else make_producer(broker)
    env = {"CRL_SHARDED": spec} if spec else {}
    worker = Worker(broker, name=f"cpu-{queue}", pool="threads", concurrency=4, log_dir=tmp_path,
                    extra_args=["-Q", queue], env={**env, "CRL_PREFETCH": "8"})
    ledger = redis.Redis.from_url(broker.result_url)
    ledger.delete("ledger:ran")
    with running(worker):
        producer.send_task("celery_e2e.app.note", ("warm",), queue=queue)
        wait_for(lambda: ledger.llen("ledger:ran") >= 1, timeout=60, what="the worker runs")
        before = [cpu_seconds(node.port) for node in cluster.nodes]
        for i in range(tasks):
            producer.send_task("celery_e2e.app.note", (f"c{i}",), queue=queue, ignore_result=True)
        wait_for(lambda: ledger.llen("ledger:ran") >= tasks + 1, timeout=300, interval=0.2,
                 what="every task ran")
        after = [cpu_seconds(node.port) for node in cluster.nodes]
    ledger.close()
    return [b - a for a, b in zip(before, after, strict=True)]


@pytest.mark.slow
def test_each_primary_takes_a_third_of_a_sharded_queue_s_load(cluster_broker: tuple[Broker, Cluster],
                                                              tmp_path: Path) -> None:
    broker, cluster = cluster_broker
    tasks = 6000
    sharded = cpu_of_a_load(broker, cluster, tmp_path, "spread", "spread:3", tasks)
    shares = [cpu / sum(sharded) for cpu in sharded]
    plain = cpu_of_a_load(broker, cluster, tmp_path, "plain", None, tasks)
    print(f"\nshares of server CPU, sharded: {', '.join(f'{s:.3f}' for s in shares)}; "
          f"server CPU per task: sharded {sum(sharded) / tasks * 1e6:.0f} us, "
          f"plain {sum(plain) / tasks * 1e6:.0f} us ({sum(sharded) / sum(plain):.2f}x); "
          f"plain's busiest primary {max(plain) / sum(plain):.3f}")
    assert all(abs(share - 1 / 3) <= 0.15 / 3 for share in shares), shares
