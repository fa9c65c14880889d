"""Shutting a worker down: prefetched messages go back at once, and an idle worker
does not wait out its blocking poll.

Warm shutdown (SIGTERM) with ``task_acks_late``: the running tasks finish and are
acked; the messages the worker had only prefetched are handed back to the ready
queue right away (not after the visibility timeout, set long here), counted as a
delivery (``x-delivery-count`` 1), and a second worker runs exactly those.

An idle worker blocked in BLPOP with ``blocking_timeout`` 10 s stops within a few
seconds of SIGTERM (the transport unblocks its own wait), for both pools.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Server

from .harness import Broker, Worker, running, wait_for

QUEUE = "celery"
VISIBILITY_S = 300  # long: anything that comes back sooner was handed back, not timed out
SLOW_SECONDS = 3.0  # long enough that none finishes between the checks below
TASKS = 8
CONCURRENCY = 2
PREFETCH = 2  # multiplier: the worker reserves CONCURRENCY * PREFETCH = 4 messages


def broker_client(servers: tuple[Server, Server]) -> redis.Redis:
    return servers[0].client()


def blocked_in_blpop(client: redis.Redis) -> bool:
    """Some connection is blocked in BLPOP (the worker's queue wait, not its XREAD)."""
    return any("b" in c["flags"] and c["cmd"] == "blpop" for c in client.client_list())


def ready_delivery_counts(client: redis.Redis, keys: Keyspace) -> dict[str, int]:
    """Message id -> delivery_count of every message in the ready ZSET."""
    ids = [m.decode() for m in client.zrange(keys.queue(QUEUE), 0, -1) if m != b"~wake"]
    states = [client.hget(keys.state(QUEUE), i) for i in ids]
    return {i: int(state.split()[1]) if state else -1 for i, state in zip(ids, states, strict=True)}


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_warm_shutdown_hands_prefetched_messages_back_at_once(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path,
        pool: str) -> None:
    broker.transport_options = {**broker.transport_options, "visibility_timeout": VISIBILITY_S}
    client = broker_client(servers)
    keys = Keyspace()
    lib = ScriptLibrary(client, keys, visibility_ms=VISIBILITY_S * 1000)
    labels = [f"s{i}" for i in range(TASKS)]
    for label in labels:  # published before the worker starts: it reserves a full prefetch at once
        producer.send_task("celery_e2e.app.slow", (label, SLOW_SECONDS))
    env = {"CRL_ACKS_LATE": "1", "CRL_PREFETCH": str(PREFETCH)}
    first = Worker(broker, name="first", pool=pool, concurrency=CONCURRENCY, env=env,
                   log_dir=log_dir)
    reserved = CONCURRENCY * PREFETCH
    with running(first):
        wait_for(lambda: len(broker.entries("started")) == CONCURRENCY, timeout=30,
                 what="both pool slots running a task")
        stats = lib.stats([QUEUE])[0]
        assert (stats.ready, stats.in_flight) == (TASKS - reserved, reserved)
        sent_at = time.monotonic()
        first.signal(signal.SIGTERM)
        code = first.wait(60)
        exit_seconds = time.monotonic() - sent_at
    started = {e["label"] for e in broker.entries("started")}
    finished = {e["label"] for e in broker.entries("finished")}
    print(f"{pool}: warm shutdown with {CONCURRENCY} running took {exit_seconds:.2f}s")
    assert code == 0
    # Warm shutdown let the running tasks finish (and acked them: nothing stays in flight).
    assert len(started) == CONCURRENCY and finished == started
    after = lib.stats([QUEUE])[0]
    # The prefetched-only messages are ready again at once, next to the never-fetched ones.
    assert (after.ready, after.in_flight, after.delayed, after.dead) == (TASKS - CONCURRENCY, 0, 0, 0)
    counts = Counter(ready_delivery_counts(client, keys).values())
    # Handed back by a consumer that had them: counted once (x-delivery-count 1); the rest 0.
    assert counts == {1: reserved - CONCURRENCY, 0: TASKS - reserved}

    second = Worker(broker, name="second", pool=pool, concurrency=TASKS - CONCURRENCY, env=env,
                    log_dir=log_dir)
    with running(second):
        wait_for(lambda: len(broker.entries("finished")) == TASKS, timeout=60,
                 what="the second worker to run the rest")
        wait_for(lambda: lib.stats([QUEUE])[0].in_flight == 0, timeout=10, what="all acked")
    runs = broker.entries("started")
    assert sorted(e["label"] for e in runs) == sorted(labels)  # each exactly once
    rerun = runs[CONCURRENCY:]  # the ledger is in run order: the first worker's two come first
    by_count = Counter((e["delivery_count"], e["redelivered"]) for e in rerun)
    assert by_count == {(1, True): reserved - CONCURRENCY, (0, False): TASKS - reserved}
    final = lib.stats([QUEUE])[0]
    assert (final.ready, final.in_flight, final.delayed, final.dead) == (0, 0, 0, 0)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_idle_worker_stops_soon_after_sigterm(
        broker: Broker, servers: tuple[Server, Server], log_dir: Path, pool: str) -> None:
    broker.transport_options = {**broker.transport_options, "blocking_timeout": 10}
    client = broker_client(servers)
    worker = Worker(broker, name="idle", pool=pool, concurrency=2, log_dir=log_dir)
    with running(worker):
        wait_for(lambda: blocked_in_blpop(client), timeout=30,
                 what="the worker blocked in BLPOP")
        sent_at = time.monotonic()
        worker.signal(signal.SIGTERM)
        code = worker.wait(30)
        exit_seconds = time.monotonic() - sent_at
    print(f"{pool}: idle worker exited {exit_seconds:.2f}s after SIGTERM (code {code})")
    assert code == 0
    # The 10 s poll was not waited out (the issue aims for about 1 s).
    assert exit_seconds < 5, f"idle {pool} worker took {exit_seconds:.2f}s to stop"


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_warm_shutdown_keeps_running_tasks_in_flight_until_they_finish(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path,
        pool: str) -> None:
    """Found by the chaos harness: during a warm shutdown the event loop no longer turns, so
    the heartbeat stopped, and tasks running longer than the visibility timeout were
    restored by another worker's sweep and ran twice. The keeper's thread extends them."""
    visibility, runtime = 2, 6.0  # the task outlives three visibility timeouts after SIGTERM
    broker.transport_options = {"visibility_timeout": visibility, "sweep_interval": 0.5}
    env = {"CRL_ACKS_LATE": "1", "CRL_PREFETCH": "1"}
    stopping = Worker(broker, name="stopping", pool=pool, concurrency=1, env=env, log_dir=log_dir)
    sweeper = Worker(broker, name="sweeper", pool=pool, concurrency=1, env=env, log_dir=log_dir)
    lib = ScriptLibrary(broker_client(servers), Keyspace(), visibility_ms=visibility * 1000)
    with running(stopping):
        producer.send_task("celery_e2e.app.slow", ("long", runtime))
        wait_for(lambda: broker.entries("started"), timeout=30, what="'long' started")
        with running(sweeper):  # idle, sweeping every 0.5 s: it would take a restored copy
            stopping.signal(signal.SIGTERM)
            assert stopping.wait(60) == 0
            wait_for(lambda: lib.stats([QUEUE])[0].in_flight == 0, timeout=10, what="the ack")
    started = broker.entries("started")
    assert [(s["label"], s["delivery_count"]) for s in started] == [("long", 0)], started
    assert [f["label"] for f in broker.entries("finished")] == ["long"]
    final = lib.stats([QUEUE])[0]
    assert (final.ready, final.in_flight, final.delayed, final.dead) == (0, 0, 0, 0)


# Prefork only: Celery 5.7's threads pool cannot interrupt a running task (its cold
# shutdown raises NotImplementedError from terminate_job and lets the task run to its end).
@pytest.mark.parametrize("pool", ["prefork"])
def test_cold_shutdown_hands_the_interrupted_task_back_at_once(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path,
        pool: str) -> None:
    """SIGQUIT stops the worker without letting its task finish: the message is handed
    back, counted, when the process exits (the keeper's exit hook, or the close), not
    after the visibility timeout (set long here)."""
    broker.transport_options = {**broker.transport_options, "visibility_timeout": VISIBILITY_S}
    client = broker_client(servers)
    lib = ScriptLibrary(client, Keyspace(), visibility_ms=VISIBILITY_S * 1000)
    worker = Worker(broker, name="cold", pool=pool, concurrency=1, log_dir=log_dir,
                    env={"CRL_ACKS_LATE": "1", "CRL_PREFETCH": "1"})
    with running(worker):
        producer.send_task("celery_e2e.app.slow", ("interrupted", 30.0))
        wait_for(lambda: broker.entries("started"), timeout=30, what="the task started")
        worker.signal(signal.SIGQUIT)
        worker.wait(30)
    assert broker.entries("finished") == []
    stats = lib.stats([QUEUE])[0]
    assert (stats.ready, stats.in_flight, stats.dead) == (1, 0, 0)
    assert list(ready_delivery_counts(client, Keyspace()).values()) == [1]
