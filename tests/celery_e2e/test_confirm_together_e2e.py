"""confirm_together() with Celery's canvas (issue 41 §1): a group's tasks and a chord's header,
sent in one thread, are stored by one script call when the block ends, not a round trip
each; a real worker then runs every one of them."""

from __future__ import annotations

from pathlib import Path

from celery import Celery, chord, group

from celery_redis_lua import confirm_groups, confirm_together
from helpers import ScriptCalls

from .harness import Broker, Worker, running

ADD, TSUM = "celery_e2e.app.add", "celery_e2e.app.tsum"
N = 60  # under publish_pipeline (100): nothing goes before the block ends


def test_a_group_is_stored_when_the_block_ends_and_every_task_runs(broker: Broker, producer: Celery,
                                                                    log_dir: Path) -> None:
    lib = broker.lib()
    producer.send_task(ADD, (0, 0)).forget()  # the queue declared, the producer's connection made
    with running(Worker(broker, name="together", concurrency=4, log_dir=log_dir)):
        counted = ScriptCalls(broker.client())
        with confirm_together():
            result = group(producer.signature(ADD, (i, i)) for i in range(N)).apply_async()
            [stats] = lib.stats(["celery"])
            assert stats.ready + stats.in_flight == 0  # none stored yet, so none could run
        calls = counted.stop()
        assert sorted(result.get(timeout=60)) == [2 * i for i in range(N)]
    assert calls.get("publish") == 1, calls  # the sixty in one script call


def test_a_chords_header_rides_one_block(broker: Broker, producer: Celery, log_dir: Path) -> None:
    with running(Worker(broker, name="chorus", concurrency=4, log_dir=log_dir)):
        with confirm_together():
            header = group(producer.signature(ADD, (i, i)) for i in range(10))
            result = chord(header, producer.signature(TSUM), app=producer).apply_async()
            [stats] = broker.lib().stats(["celery"])
            assert stats.ready + stats.in_flight == 0  # the header waits for the block's end
        assert result.get(timeout=60) == sum(2 * i for i in range(10))
    [stats] = broker.lib().stats(["celery"])
    assert (stats.ready, stats.in_flight, stats.dead) == (0, 0, 0)


def test_confirm_groups_batches_every_group_and_leaves_a_single_send_as_it_was(
        broker: Broker, producer: Celery, log_dir: Path) -> None:
    """One line for the app: a group sent with no block in sight is one script call, and is
    stored when apply_async returns; a single send_task is stored when it returns."""
    confirm_groups(producer)
    lib = broker.lib()
    producer.send_task(ADD, (0, 0)).forget()  # declared, connected; stored on return
    [stats] = lib.stats(["celery"])
    assert stats.ready == 1
    counted = ScriptCalls(broker.client())
    result = group(producer.signature(ADD, (i, i)) for i in range(N)).apply_async()
    [stats] = lib.stats(["celery"])
    assert stats.ready == N + 1  # all stored when apply_async returned (no worker yet)
    calls = counted.stop()
    assert calls.get("publish") == 1, calls
    with running(Worker(broker, name="grouped", concurrency=4, log_dir=log_dir)):
        assert sorted(result.get(timeout=60)) == [2 * i for i in range(N)]
