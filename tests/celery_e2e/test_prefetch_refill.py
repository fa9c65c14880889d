"""A prefork child left idle beside long tasks gets its next task at once, though the refill
of the prefetch window is held back while most of it is held (channel.py ``_gathering``):
the hold is bounded, and Celery's hub comes back for it by a timer, not at its next tick."""

from __future__ import annotations

from pathlib import Path

from celery import Celery

from .harness import Broker, Worker, running, wait_for

SLOW = "celery_e2e.app.slow"
LONG_SECONDS = 8.0
SHORT = 10
# With the timer, the short tasks follow each other within a few milliseconds each. Without
# it, each waits for the hub's next event or 1 s tick: about 0.5 s apiece, 4.5 s for ten.
SHORT_SPAN_LIMIT = 2.0


def test_an_idle_child_beside_long_tasks_is_refilled_at_once(
        broker: Broker, producer: Celery, log_dir: Path) -> None:
    # Four children, prefetch multiplier 1, late acks: a window of four, three held by the
    # long tasks, so each short task's ack frees one slot of four (held back, bounded).
    worker = Worker(broker, name="refill", pool="prefork", concurrency=4, log_dir=log_dir,
                    env={"CRL_ACKS_LATE": "1", "CRL_PREFETCH": "1"})
    with running(worker):
        for i in range(3):
            producer.send_task(SLOW, (f"long{i}", LONG_SECONDS))
        wait_for(lambda: len(broker.entries("started")) == 3, timeout=30, what="the long tasks started")
        for i in range(SHORT):
            producer.send_task(SLOW, (f"short{i}", 0.0))
        wait_for(lambda: sum(f["label"].startswith("short") for f in broker.entries("finished")) == SHORT,
                 timeout=30, what="the short tasks finished")
        starts = sorted(s["at"] for s in broker.entries("started") if s["label"].startswith("short"))
        finished_long = [f for f in broker.entries("finished") if f["label"].startswith("long")]
    assert finished_long == [] or min(f["at"] for f in finished_long) > starts[-1], \
        "a long task ended before the short ones did: the test proves nothing"
    assert starts[-1] - starts[0] < SHORT_SPAN_LIMIT, starts
