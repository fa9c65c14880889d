"""Flow control held in the broker: pause and resume a queue.

A pause is a field of the queue's meta hash (lua/pause.lua), so it holds for every
consumer at once, for workers started later, and across a restart or a failover; the
consume script reads it in the same call that would take messages. Resume removes it and
pushes the queue's wake token, so a blocked consumer starts at once. The scripts refuse a
queue that does not exist and a reason over 256 bytes, naming them.
"""

from __future__ import annotations

from typing import Any

from .locate import library_of


def pause(app: Any, queue: str, reason: str = "") -> bool:
    """``celery_redis_lua.pause(app, queue, reason)``, through the app's broker connection:
    True unless the queue was paused already (its reason is then replaced)."""
    with library_of(app) as lib:
        return lib.pause(queue, reason)


def resume(app: Any, queue: str) -> bool:
    """``celery_redis_lua.resume(app, queue)``: True if the queue was paused."""
    with library_of(app) as lib:
        return lib.resume(queue)
