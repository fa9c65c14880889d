"""Issue 40 §3 with a real Celery worker: the broker is fenced (``min-replicas-to-write 1``, no
replica: every write refused with NOREPLICAS) for a few seconds while a task runs across the
fence with ``acks_late`` (its ack is refused) and a producer publishes during it. The worker
rides it out (its refused consumes end as lost connections, Celery reconnects), the publish
is retried until the fence lifts and runs once, and the refused ack lands: nothing runs twice,
nothing is left in the broker."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from celery import Celery

from .harness import Broker, Worker, running, wait_for

# kombu's ensure() for the publish: retried every 50-200 ms, for up to about 20 s.
RETRY = {"max_retries": 100, "interval_start": 0.05, "interval_step": 0.05, "interval_max": 0.2}


def fence(client: Any, on: bool) -> None:
    client.config_set("min-replicas-to-write", 1 if on else 0)


def refused(client: Any) -> int:
    """Commands the server refused before running them (NOREPLICAS among them)."""
    return sum(int(stats.get("rejected_calls", 0)) for stats in client.info("commandstats").values())


def test_a_worker_and_a_producer_ride_out_a_fenced_primary(
        broker: Broker, producer: Celery, log_dir: Path, servers: Any) -> None:
    admin = servers[0].client()
    outcome: list[BaseException | None] = []

    def publish() -> None:
        try:
            producer.send_task("celery_e2e.app.note", ("during",), retry=True, retry_policy=RETRY)
        except BaseException as error:  # the test reads it
            outcome.append(error)
        else:
            outcome.append(None)

    labels = lambda kind: [e["label"] for e in broker.entries(kind)]  # noqa: E731
    with running(Worker(broker, pool="threads", log_dir=log_dir, env={"CRL_ACKS_LATE": "1"})) as (worker,):
        producer.send_task("celery_e2e.app.slow", ("across", 1.5))
        wait_for(lambda: "across" in labels("started"), timeout=30, what="the task started")
        fence(admin, on=True)
        try:
            before = refused(admin)
            publisher = threading.Thread(target=publish, daemon=True)
            publisher.start()
            wait_for(lambda: "across" in labels("finished"), timeout=30, what="the task ended in the fence")
            # The worker's consumes and the task's ack, and the publish, refused meanwhile.
            wait_for(lambda: refused(admin) >= before + 10, timeout=30, what="writes refused")
            assert not outcome, f"the publish ended while the primary was fenced: {outcome!r}"
            assert "during" not in labels("ran")
        finally:
            fence(admin, on=False)
        publisher.join(30)
        assert outcome == [None], "the publish did not land once the fence lifted"
        wait_for(lambda: "during" in labels("ran"), timeout=30, what="the task published in the fence ran")
        lib = broker.lib()
        wait_for(lambda: all((s.ready, s.in_flight, s.delayed) == (0, 0, 0) for s in lib.stats(["celery"])),
                 timeout=30, what="the refused ack landed (nothing in flight)")
        assert worker.process is not None and worker.process.poll() is None, "the worker died"
    assert labels("started") == ["across"] and labels("ran") == ["during"], "something ran twice"
