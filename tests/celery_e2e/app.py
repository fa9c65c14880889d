"""The Celery app the end-to-end tests run in real worker processes.

Broker and result backend come from the environment (the tests start the
servers): CRL_BROKER_URL (a redislua:// URL), CRL_RESULT_URL (redis://),
CRL_TRANSPORT_OPTIONS (JSON). Tasks record what they saw in the result
backend's server under ``ledger:*`` keys, so a test can check exactly what ran.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery
from celery.exceptions import Reject
from kombu import Exchange, Queue

import celery_redis_lua  # noqa: F401  (registers the redislua:// scheme)


def sharded_queue(spec: str) -> Queue:
    """``<queue>:<N>`` as a kombu Queue with x-shards N, on a direct exchange of its name."""
    name, _, count = spec.partition(":")
    return Queue(name, Exchange(name, "direct"), routing_key=name, queue_arguments={"x-shards": int(count)})


app = Celery("crl_e2e")
app.conf.update(
    broker_url=os.environ.get("CRL_BROKER_URL", "redislua://127.0.0.1:6379/0"),
    result_backend=os.environ.get("CRL_RESULT_URL"),
    broker_transport_options=json.loads(os.environ.get("CRL_TRANSPORT_OPTIONS", "{}")),
    task_acks_late=os.environ.get("CRL_ACKS_LATE") == "1",
    worker_prefetch_multiplier=int(os.environ.get("CRL_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_default_priority=0,
    worker_cancel_long_running_tasks_on_connection_loss=False,
)
# CRL_QUEUE_EXPIRES=<seconds>: the x-expires of the worker's own queues (celeryev.<uuid>,
# <hostname>.celery.pidbox), 60 s and 10 s in Celery.
if os.environ.get("CRL_QUEUE_EXPIRES"):
    app.conf.event_queue_expires = app.conf.control_queue_expires = float(os.environ["CRL_QUEUE_EXPIRES"])

# CRL_SHARDED=<queue>:<N>: that queue is declared with x-shards N (docs/sharding.md).
if os.environ.get("CRL_SHARDED"):
    app.conf.task_queues = [sharded_queue(os.environ["CRL_SHARDED"])]

_ledger: redis.Redis | None = None


def ledger() -> redis.Redis:
    global _ledger
    if _ledger is None:
        _ledger = redis.Redis.from_url(os.environ["CRL_RESULT_URL"])
    return _ledger


def record(kind: str, **fields: object) -> None:
    ledger().rpush(f"ledger:{kind}", json.dumps(fields))


def delivery_count(request: object) -> object:
    """The x-delivery-count header as the task sees it (Celery copies headers into the request)."""
    return vars(request).get("x-delivery-count")


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task(bind=True)
def note(self, label: str) -> str:
    """Record that this task ran, with what the broker told it."""
    info = self.request.delivery_info or {}
    record("ran", label=label, id=self.request.id, at=time.time(),
           delivery_count=delivery_count(self.request), redelivered=info.get("redelivered"),
           pid=os.getpid(), hostname=self.request.hostname)
    return label


@app.task(bind=True)
def slow(self, label: str, seconds: float) -> str:
    record("started", label=label, pid=os.getpid(), at=time.time(),
           redelivered=(self.request.delivery_info or {}).get("redelivered"),
           delivery_count=delivery_count(self.request))
    time.sleep(seconds)
    record("finished", label=label, pid=os.getpid(), at=time.time())
    return label


@app.task(bind=True)
def always_reject(self, label: str) -> None:
    record("rejected", label=label, at=time.time())
    raise Reject("always", requeue=True)


# -- added for test_remote_control.py (append-only) ------------------------------------------
# CRL_BROADCAST=1: consume the default queue and a Broadcast('bcast') queue (a fanout exchange
# 'bcast' with a queue of its own per worker), so a task routed to 'bcast' reaches every worker.
if os.environ.get("CRL_BROADCAST") == "1":
    from kombu import Queue
    from kombu.common import Broadcast

    app.conf.task_queues = (Queue("celery"), Broadcast("bcast"))


@app.task
def tsum(values: list[int]) -> int:
    """The body of a chord: sums what the header's tasks returned."""
    return sum(values)


# -- added for test_lifetimes.py (append-only) ------------------------------------------------
# CRL_ROUTED=1: the worker consumes 'routed', bound to the topic exchange 'jobs' with 'jobs.#'
# (as in Celery's routing guide).
if os.environ.get("CRL_ROUTED") == "1":
    from kombu import Exchange, Queue

    app.conf.task_queues = (Queue("routed", Exchange("jobs", "topic"), routing_key="jobs.#"),)


from celery.worker.control import control_command  # noqa: E402


@control_command(args=[("label", str)], signature="<label>")
def record_command(state: object, label: str) -> dict[str, str]:
    """A remote-control command that records that it ran (and on which worker)."""
    record("control", label=label, hostname=getattr(state, "hostname", None), at=time.time())
    return {"ok": label}


# -- added for test_disable_prefetch.py (append-only) -----------------------------------------
# CRL_DISABLE_PREFETCH=1: Celery 5.6's worker_disable_prefetch (a worker takes a task only when
# a pool slot is free; Celery allows it on Redis transports only, by driver_type).
if os.environ.get("CRL_DISABLE_PREFETCH") == "1":
    app.conf.worker_disable_prefetch = True


# -- added for test_credential_rotation.py (append-only) --------------------------------------
# CRL_CREDENTIALS_FILE=path: the broker's credentials come from a redis-py credential provider
# that reads "username\npassword" from that file at every connection (as a rotating IAM token
# provider would), so a test can rotate the password under a running worker.
if os.environ.get("CRL_CREDENTIALS_FILE"):
    from redis.credentials import CredentialProvider

    class FileCredentials(CredentialProvider):
        def __init__(self, path: str) -> None:
            self.path = path

        def get_credentials(self) -> tuple[str, str]:
            with open(self.path) as file:
                username, password = file.read().split("\n")[:2]
            record("credentials", username=username, at=time.time())
            return username, password

    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "credential_provider": FileCredentials(os.environ["CRL_CREDENTIALS_FILE"]),
    }
