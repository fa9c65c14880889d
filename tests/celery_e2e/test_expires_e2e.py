"""Celery's `expires` honoured in the broker, with a real worker: a task that expired while it
waited (queued, or a countdown) is dead-lettered with reason 'expired', never delivered, and
counted; `where` says so; `dead replay --renew-expires` makes one run, while one replayed as
it is is discarded by the worker. A countdown's expiry is Celery's time, not its TTL counted from the
ETA (Celery sends expires as ms from now; the broker counts a TTL from the ETA)."""

from __future__ import annotations

from pathlib import Path

from celery import Celery
from click.testing import CliRunner

from celery_redis_lua.tools.cli import main
from celery_redis_lua.tools.envelope import task_of
from celery_redis_lua.tools.locate import locate_task
from helpers import server_now_ms, wait_for_server_time

from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True  # also on a three-primary cluster (conftest.py)


def test_expired_tasks_are_dead_lettered_not_run(broker: Broker, producer: Celery, log_dir: Path) -> None:
    lib = broker.lib()
    sent_at = server_now_ms(lib.client)
    stale = producer.send_task("celery_e2e.app.note", ("stale",), expires=1)
    late = producer.send_task("celery_e2e.app.note", ("countdown",), countdown=1, expires=2)
    producer.send_task("celery_e2e.app.note", ("fresh",), expires=120)
    wait_for_server_time(lib.client, sent_at + 2_100)  # both have expired; no worker ran yet
    with running(Worker(broker, name="late", log_dir=log_dir)):
        wait_for(lambda: broker.entries("ran"), timeout=30, what="the fresh task runs")
        wait_for(lambda: len(lib.dead_list("celery")) == 2, timeout=30,
                 what="both expired tasks are dead-lettered")
    assert [e["label"] for e in broker.entries("ran")] == ["fresh"]
    letters = lib.dead_list("celery")
    assert sorted(letter.reason for letter in letters) == ["expired", "expired"]
    for result in (stale, late):
        found = locate_task(lib, result.id, ["celery"])
        assert (found.state, found.reason) == ("dead", "expired"), found
    assert lib.metrics(["celery"])[0].dropped.get("expired") == 2
    # Replayed as they are, they keep their Celery expires and the worker discards them; with
    # --renew-expires (or --clear-expires) they run.
    by_task = {task_of(letter.payload)[1]: letter.entry_id for letter in letters}
    for options in (["--renew-expires", "60", by_task[stale.id]], [by_task[late.id]]):
        replayed = CliRunner().invoke(main, ["dead", "replay", "celery", *options,
                                             "--url", broker.broker_url])
        assert replayed.exit_code == 0, replayed.output
    assert lib.stats(["celery"])[0].ready == 2
    with running(Worker(broker, name="replayed", log_dir=log_dir)):
        wait_for(lambda: len(broker.entries("ran")) == 2, timeout=30, what="the renewed task runs")
        wait_for(lambda: (lambda s: s.ready + s.in_flight)(lib.stats(["celery"])[0]) == 0, timeout=30,
                 what="the worker takes (and discards) the task replayed as it was")
    assert [e["label"] for e in broker.entries("ran")] == ["fresh", "stale"]
    assert lib.dead_list("celery") == []
