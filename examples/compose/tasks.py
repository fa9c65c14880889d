"""The example's Celery app: the broker URL comes from CELERY_BROKER_URL
(redislua://valkey:6379/0 in docker-compose.yml). Run with `celery -A tasks worker`."""

import os

from celery import Celery

import celery_redis_lua  # noqa: F401  registers the redislua:// schemes with kombu

app = Celery("tasks", broker=os.environ["CELERY_BROKER_URL"])


@app.task
def add(x: int, y: int) -> int:
    return x + y
