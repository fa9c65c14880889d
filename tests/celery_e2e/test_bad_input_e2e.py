"""Bad input end to end: a wrong transport option, a priority that is not a number, and a
stored payload that is not JSON. Each gives a clear error (or a logged rejection) that
names the culprit; nothing half-written, and every other message goes through."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_redis_lua import DeadLetter, Keyspace, ScriptLibrary

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

NOTE = "celery_e2e.app.note"


@pytest.fixture
def client(broker: Broker) -> Iterator[redis.Redis]:
    plain = broker.client()
    yield plain
    plain.close()


def with_options(broker: Broker, **options: object) -> Broker:
    return Broker(broker.broker_url, broker.result_url, {**broker.transport_options, **options})


@pytest.mark.parametrize(("option", "value"), [("visibility_timeout", "soon"),
                                               ("delivery_limit", 0),
                                               ("sweep_interval", -1)])
def test_an_invalid_option_value_fails_the_connection_naming_the_option(
        broker: Broker, client: redis.Redis, log_dir: Path, option: str, value: object) -> None:
    bad = with_options(broker, **{option: value})
    producer = make_producer(bad)
    try:
        with pytest.raises(ValueError, match=rf"transport option '{option}' must be .*got {value!r}"):
            producer.send_task(NOTE, ("never",))
        with pytest.raises(ValueError, match=option), producer.connection_for_write() as conn:
            conn.connect()
    finally:
        producer.close()
    # A worker with the same option refuses to start, and says why.
    with pytest.raises(RuntimeError, match="exited early") as failed:
        Worker(bad, name="badopt", log_dir=log_dir).start()
    assert f"transport option '{option}'" in str(failed.value)
    assert client.keys("*") == []  # nothing was declared or published


@pytest.mark.parametrize("priority", ["high", 256, -1])
def test_a_priority_that_is_not_0_to_255_raises_and_publishes_nothing(
        broker: Broker, producer: Celery, client: redis.Redis, priority: object) -> None:
    producer.send_task(NOTE, ("fine",), priority=5)
    seq = client.hget("meta:{celery}", "seq")
    with pytest.raises(Exception, match=rf"priority must be an integer in 0\.\.255, got '{priority}'"):
        producer.send_task(NOTE, ("bad",), priority=priority)
    with pytest.raises(Exception, match="priority"):
        producer.signature(NOTE, ("bad-too",)).apply_async(priority=priority)
    assert client.hget("meta:{celery}", "seq") == seq  # no id was even taken
    assert len(client.keys("message:*")) == 1
    [stats] = ScriptLibrary(client, Keyspace()).stats(["celery"])
    assert (stats.ready, stats.delayed, stats.in_flight, stats.dead) == (1, 0, 0, 0)


def test_a_payload_that_is_not_json_is_rejected_with_a_log_line_and_dead_lettered(
        broker: Broker, producer: Celery, client: redis.Redis, log_dir: Path) -> None:
    lib = ScriptLibrary(client, Keyspace())
    # Before the worker starts: good, broken, good in one queue (one consume batch).
    early = [producer.send_task(NOTE, (f"before-{i}",)) for i in range(3)]
    broken = [lib.publish("celery", "not json{")]
    late = [producer.send_task(NOTE, (f"between-{i}",)) for i in range(3)]
    worker = Worker(broker, name="sturdy", concurrency=2, log_dir=log_dir)
    with running(worker):
        assert [r.get(timeout=30) for r in early + late] == [
            "before-0", "before-1", "before-2", "between-0", "between-1", "between-2"]
        # While it runs (the blocking-wait path): another broken one, and a valid JSON
        # document that is not a kombu envelope, between good tasks.
        broken.append(lib.publish("celery", "not json{"))
        after = [producer.send_task(NOTE, ("after-0",))]
        broken.append(lib.publish("celery", '{"body": "no properties"}'))
        after.append(producer.send_task(NOTE, ("after-1",)))
        assert [r.get(timeout=30) for r in after] == ["after-0", "after-1"]
        dead = wait_for(lambda: _complete(lib.dead_list("celery"), len(broken)), timeout=30,
                        what="every broken message dead-lettered")
        assert worker.process is not None and worker.process.poll() is None
        log = worker.log_path.read_text(errors="replace")

    ran = sorted(e["label"] for e in broker.entries("ran"))
    assert ran == sorted([f"before-{i}" for i in range(3)] + [f"between-{i}" for i in range(3)]
                         + ["after-0", "after-1"])
    for message_id in broken:
        assert f"rejected a message: message {message_id} in queue 'celery'" in log, message_id
    assert [(d.id, d.reason, d.payload) for d in dead] == [
        (broken[0], "rejected", b"not json{"), (broken[1], "rejected", b"not json{"),
        (broken[2], "rejected", b'{"body": "no properties"}')]
    [stats] = lib.stats(["celery"])
    assert (stats.ready, stats.delayed, stats.in_flight, stats.dead) == (0, 0, 0, 3)


def _complete(dead: list[DeadLetter], count: int) -> list[DeadLetter] | None:
    return dead if len(dead) >= count else None
