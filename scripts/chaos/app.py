"""The Celery app the chaos workers run (``celery -A scripts.chaos.app worker``).

Configured from the environment: CHAOS_BROKER_URL (redislua:// or redis://),
CHAOS_LEDGER_URL, CHAOS_TRANSPORT_OPTIONS (JSON), CHAOS_ACKS_LATE ("1" by default).
The one task records its start (worker, pid, delivery count, and when the worker received
that delivery) and finish in the ledger; a worker also records each consume batch it took
(batches.py: the verdict's order check; with kombu's stock transport, each BRPOP's message).
Workers consume the default queue and ``expiring``: a queue with x-expires bound to the
topic exchange ``chaos.jobs`` (a named-exchange route, as in Celery's routing guide), so a
run also proves that an expiring queue and its binding outlive every refresh interval.
With CHAOS_SHARDS=N (``--shards N``) the default queue is declared with ``x-shards: N``
(docs/sharding.md): one logical queue over N queues, on a cluster one per primary.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery
from celery.exceptions import Reject
from celery.signals import task_received
from kombu import Exchange, Queue

import celery_redis_lua  # noqa: F401  (registers redislua://)
from scripts.chaos import batches, flow, ledger

app = Celery("chaos", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("CHAOS_BROKER_URL", "redislua://127.0.0.1:6379/0"),
    broker_transport_options=json.loads(os.environ.get("CHAOS_TRANSPORT_OPTIONS", "{}")),
    task_acks_late=os.environ.get("CHAOS_ACKS_LATE", "1") == "1",
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    worker_hijack_root_logger=False,
    worker_cancel_long_running_tasks_on_connection_loss=False,
)

if "CHAOS_LEDGER_URL" in os.environ and "CHAOS_BROKER_URL" in os.environ:  # a worker
    if os.environ["CHAOS_BROKER_URL"].startswith("redislua"):
        batches.install()  # which consume batch took each message
    else:
        batches.install_stock()  # kombu's stock Redis transport: each BRPOP's message

# x-expires longer than any fault keeps consumers away (a broker restart, a pause): the
# queue must live as long as it has consumers, and its binding be refreshed meanwhile.
EXPIRING_QUEUE_SECONDS = 60
JOBS = Exchange("chaos.jobs", "topic")


def main_queues(shards: int | None = None) -> tuple[Queue, Queue]:
    """The default queue (``x-shards`` when sharded) and the expiring one."""
    arguments = {"x-shards": shards} if shards else None
    return (Queue("celery", queue_arguments=arguments),
            Queue("expiring", JOBS, routing_key="jobs.#", expires=EXPIRING_QUEUE_SECONDS))


SHARDS = int(os.environ.get("CHAOS_SHARDS") or 0) or None
app.conf.task_queues = main_queues(SHARDS)
# With --flow (CHAOS_FLOW=1): the capped and the retrying queue too (scripts/chaos/flow.py).
FLOW = os.environ.get("CHAOS_FLOW") == "1"
if FLOW:
    app.conf.task_queues = (*app.conf.task_queues, *flow.queues())


# The header the worker's consumer stamps a delivery with when it receives it: a task can
# start long after (prefetched behind others, or held across a reconnect), and a fault in
# between explains a second run as much as one after the start (verdict.attribute).
RECEIVED = "chaos-received"


@task_received.connect
def _stamp_receipt(request: Any, **_: Any) -> None:
    # The request's dict is what the pool's child (or thread) builds the task's request from.
    request.request_dict[RECEIVED] = time.time()


def record_start(request: Any, kind: str) -> float:
    info = request.delivery_info or {}
    started = time.time()
    ledger.record("start", id=request.id, kind=kind, t=started, worker=request.hostname,
                  pid=os.getpid(), delivery_count=vars(request).get("x-delivery-count"),
                  redelivered=info.get("redelivered"), received=vars(request).get(RECEIVED))
    return started


@app.task(name="chaos.work", bind=True)
def work(self, kind: str, seconds: float) -> None:
    request = self.request
    record_start(request, kind)
    time.sleep(seconds)
    ledger.record("finish", id=request.id, t=time.time(), worker=request.hostname, pid=os.getpid())


@app.task(name="chaos.flow", bind=True)
def flow_work(self, kind: str, seconds: float, failures: int) -> None:
    """A task of a flow queue: its end goes to the ledger too (``flow_end``, keyed by the
    start's time); a retrying one fails its first ``failures`` deliveries by rejecting them
    with requeue, so the queue's delayed retry holds them back."""
    request = self.request
    started = record_start(request, kind)
    count = vars(request).get("x-delivery-count") or 0
    time.sleep(seconds)
    failing = count < failures
    ledger.record("flow_end", id=request.id, t=time.time(), started=started, worker=request.hostname,
                  pid=os.getpid(), kind=kind, delivery_count=count, outcome="retry" if failing else "ok")
    if failing:
        raise Reject(f"chaos: delivery {count} of {failures} failing", requeue=True)
    ledger.record("finish", id=request.id, t=time.time(), worker=request.hostname, pid=os.getpid())
