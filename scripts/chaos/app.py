"""The Celery app the chaos workers run (``celery -A scripts.chaos.app worker``).

Configured from the environment: CHAOS_BROKER_URL (redislua:// or redis://),
CHAOS_LEDGER_URL, CHAOS_TRANSPORT_OPTIONS (JSON), CHAOS_ACKS_LATE ("1" by default).
The one task records its start (worker, pid, delivery count) and finish in the ledger.
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery
from scripts.chaos import ledger

import celery_redis_lua  # noqa: F401  (registers redislua://)

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


@app.task(name="chaos.work", bind=True)
def work(self, kind: str, seconds: float) -> None:
    request = self.request
    info = request.delivery_info or {}
    ledger.record("start", id=request.id, kind=kind, t=time.time(), worker=request.hostname,
                  pid=os.getpid(), delivery_count=vars(request).get("x-delivery-count"),
                  redelivered=info.get("redelivered"))
    time.sleep(seconds)
    ledger.record("finish", id=request.id, t=time.time(), worker=request.hostname, pid=os.getpid())
