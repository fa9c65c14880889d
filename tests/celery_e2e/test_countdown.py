"""Countdowns wait in the broker (delayed:{celery}), not in the worker, and run on time.

Clock: the broker judges an ETA by its own clock (TIME). The tests read the
broker's TIME right before sending and compare it with the 'at' the task
records in the ledger, which is ``time.time()`` in the worker process. The
broker server and the worker run on this machine, so both read the same kernel
real-time clock: a server TIME and a worker ``time.time()`` are directly
comparable (there is no skew to convert), and reading TIME (not the test's own
clock) keeps the reference the same one the scripts use for the ETA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Server

from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True  # also on three-primary clusters (conftest.py)

QUEUE = "celery"
# The sweep also promotes due delayed messages; at the default 60 s period it cannot be
# what makes a countdown punctual here (the fixture's 1 s would mask a missing wake-up).
PUNCTUAL_OPTIONS = {"sweep_interval": 60, "blocking_timeout": 10}


def server_time(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1_000_000


def blocked_in_blpop(client: redis.Redis) -> bool:
    """Some connection is blocked in BLPOP (the worker's queue wait, not its XREAD)."""
    return any("b" in c["flags"] and c["cmd"] == "blpop" for c in client.client_list())


def ran_entry(broker: Broker, label: str) -> dict[str, Any] | None:
    return next((e for e in broker.entries("ran") if e["label"] == label), None)


def test_five_second_countdown_runs_between_five_and_six_seconds_after_send(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path) -> None:
    broker.transport_options = {**broker.transport_options, **PUNCTUAL_OPTIONS}
    client = servers[0].client()
    with running(Worker(broker, name="cd5", log_dir=log_dir)):
        sent = server_time(client)
        producer.send_task("celery_e2e.app.note", ("cd5",), countdown=5)
        entry = wait_for(lambda: ran_entry(broker, "cd5"), timeout=20, what="the countdown task")
    after = entry["at"] - sent
    print(f"5 s countdown ran {after:.3f}s after send (lateness {after - 5:.3f}s)")
    assert 5.0 <= after <= 6.0, f"ran {after:.3f}s after send"
    # The broker held it: the worker saw a first delivery with no ETA left to wait for.
    assert (entry["delivery_count"], entry["redelivered"]) == (0, False)


def test_an_hour_countdown_sits_in_the_broker_not_in_the_worker(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path) -> None:
    client = servers[0].client()
    keys = Keyspace()
    lib = ScriptLibrary(client, keys)
    worker = Worker(broker, name="cd3600", log_dir=log_dir)
    with running(worker):
        sent_ms = int(server_time(client) * 1000)
        later = producer.send_task("celery_e2e.app.note", ("hour",), countdown=3600)
        # Published after it, same priority: once this one has run, the worker has consumed
        # past the hour task, so a transport that delivered it early would have done so.
        producer.send_task("celery_e2e.app.note", ("marker",)).get(timeout=30)
        replies = producer.control.inspect(timeout=1).scheduled()
        reserved = producer.control.inspect(timeout=1).reserved()
        stats = lib.stats([QUEUE])[0]
    hostname = next(iter(replies or {}), None)
    assert hostname is not None and hostname.startswith(f"{worker.name}@")  # it did answer
    assert replies == {hostname: []}, f"scheduled in the worker: {replies}"
    assert reserved == {hostname: []}, f"reserved in the worker: {reserved}"
    assert [e["label"] for e in broker.entries("ran")] == ["marker"]
    assert (stats.ready, stats.delayed, stats.in_flight) == (0, 1, 0)
    # delayed:{celery} holds it with its ETA (ms by the server's clock) as the score.
    [(member, score)] = client.zrange(keys.delayed(QUEUE), 0, -1, withscores=True)
    assert sent_ms + 3_600_000 <= score <= sent_ms + 3_600_000 + 2_000
    payload = json.loads(client.hget(keys.message(QUEUE), member))
    assert payload["headers"]["id"] == later.id


def test_countdown_published_while_the_worker_is_blocked_runs_on_time(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path) -> None:
    broker.transport_options = {**broker.transport_options, **PUNCTUAL_OPTIONS}
    client = servers[0].client()
    with running(Worker(broker, name="cdblocked", concurrency=1, log_dir=log_dir)):
        # The only worker is idle in a 10 s BLPOP on the empty queue's wake list.
        wait_for(lambda: blocked_in_blpop(client), timeout=30, what="the worker to block")
        sent = server_time(client)
        producer.send_task("celery_e2e.app.note", ("cd2",), countdown=2)
        entry = wait_for(lambda: ran_entry(broker, "cd2"), timeout=20, what="the countdown task")
    after = entry["at"] - sent
    print(f"2 s countdown (worker blocked) ran {after:.3f}s after send (lateness {after - 2:.3f}s)")
    # Within 1 s of its ETA, not after the 10 s block ran out.
    assert 2.0 <= after < 3.0, f"ran {after:.3f}s after send"
