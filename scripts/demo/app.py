"""The Celery app of `make demo`: a few tasks that write what they saw to a ledger list."""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery
from kombu import Exchange, Queue
from kombu.common import Broadcast

import celery_redis_lua  # noqa: F401  (registers the redislua:// scheme)

app = Celery("demo", broker=os.environ["DEMO_BROKER_URL"])
broadcast_queue = Broadcast("demo-broadcast")
app.conf.update(
    broker_transport_options={"visibility_timeout": 3, "sweep_interval": 1},
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_queues=[Queue("demo", Exchange("demo"), routing_key="demo"), broadcast_queue],
    task_default_queue="demo",
)
_ledger = redis.Redis.from_url(os.environ["DEMO_LEDGER_URL"])


def note(kind: str, **fields: object) -> None:
    _ledger.rpush("demo:ledger", json.dumps({"kind": kind, "at": time.time(), **fields}))


@app.task(bind=True)
def job(self, label: str, seconds: float = 0.0) -> str:
    count = vars(self.request).get("x-delivery-count")
    note("start", label=label, worker=self.request.hostname, delivery_count=count,
         redelivered=bool((self.request.delivery_info or {}).get("redelivered")))
    time.sleep(seconds)
    note("done", label=label, worker=self.request.hostname)
    return label
