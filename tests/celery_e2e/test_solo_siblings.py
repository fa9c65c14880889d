"""Issue 31 item 1: the prefetched siblings of a long task on ``--pool=solo`` are kept alive.

Worker A takes the three queued tasks in one consume; the solo pool runs the first (5 s)
inside kombu's callback, so the other two are held by A but not yet handed to kombu. With a
visibility timeout of 2 s their deadlines must still be pushed forward while A lives;
otherwise a sweep restores them, idle worker B runs them, and A runs them again once the
long task ends.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from celery import Celery

from .conftest import make_producer
from .harness import Broker, Worker, running, wait_for

SLOW = "celery_e2e.app.slow"
LONG_SECONDS = 5.0


def test_siblings_of_a_long_solo_task_do_not_run_twice_while_their_worker_lives(
        broker: Broker, log_dir: Path) -> None:
    broker.transport_options = {"visibility_timeout": 2, "sweep_interval": 1}
    producer: Celery = make_producer(broker)
    labels = ["long", "second", "third"]
    producer.send_task(SLOW, ("long", LONG_SECONDS))
    for label in labels[1:]:
        producer.send_task(SLOW, (label, 0.0))
    a = Worker(broker, name="a", pool="solo", concurrency=1, log_dir=log_dir)
    b = Worker(broker, name="b", pool="solo", concurrency=1, log_dir=log_dir)
    with running(a):
        wait_for(lambda: broker.entries("started"), timeout=30, what="worker A starting the long task")
        with running(b):
            # Done when every task finished at least once. A runs whatever it still holds right
            # after the long task, inside the same kombu callback loop, before it sees SIGTERM.
            wait_for(lambda: {f["label"] for f in broker.entries("finished")} == set(labels),
                     timeout=30, what="every task to finish")
            a_pid = a.process.pid if a.process else None
            assert a.process is not None and a.process.poll() is None, "worker A died"
    started = broker.entries("started")
    assert started[0]["label"] == "long" and started[0]["pid"] == a_pid
    runs = Counter(s["label"] for s in started)
    twice = [(s["label"], "A" if s["pid"] == a_pid else "B", s["delivery_count"]) for s in started
             if runs[s["label"]] > 1]
    assert runs == Counter(labels), f"tasks ran more than once while worker A lived (label, worker, " \
                                    f"x-delivery-count): {twice}"
