"""Flow control held in the broker: pause and resume a queue, and limit it.

A pause is a field of the queue's meta hash (lua/pause.lua), so it holds for every
consumer at once, for workers started later, and across a restart or a failover; the
consume script reads it in the same call that would take messages. Resume removes it and
pushes the queue's wake token, so a blocked consumer starts at once. The scripts refuse a
queue that does not exist and a reason over 256 bytes, naming them.

Limits (lua/limit.lua) are fields of the same hash: at most N messages in flight and at most
N deliveries per second, minute or hour, for all the queue's consumers together; consume
enforces them in the call that takes. The script judges the values and names a bad one.

On a sharded queue (x-shards) each applies to the logical queue: every shard is paused, and
a limit is split over the shards (protocol/logical.py says how it is rounded).
"""

from __future__ import annotations

from typing import Any

from ..protocol import logical
from ..protocol.ops import Limits
from .locate import library_of


def pause(app: Any, queue: str, reason: str = "") -> bool:
    """``celery_redis_lua.pause(app, queue, reason)``, through the app's broker connection:
    True unless the queue was paused already (its reason is then replaced)."""
    with library_of(app) as lib:
        return logical.pause(lib, queue, reason)


def resume(app: Any, queue: str) -> bool:
    """``celery_redis_lua.resume(app, queue)``: True if the queue was paused."""
    with library_of(app) as lib:
        return logical.resume(lib, queue)


def limit(app: Any, queue: str, *, in_flight: int | None = None, rate: str | None = None) -> Limits:
    """``celery_redis_lua.limit(app, queue, in_flight=8, rate="20/s")``: set the queue's limits
    for all its consumers together (None leaves one as it is); returns those in force.
    ``rate`` is 'N/s', 'N/m' or 'N/h'. Raises ScriptError naming a bad value or a missing queue."""
    with library_of(app) as lib:
        return logical.limit(lib, queue, in_flight=in_flight, rate=rate)


def clear_limits(app: Any, queue: str, *, in_flight: bool = True, rate: bool = True) -> Limits:
    """``celery_redis_lua.clear_limits(app, queue)``: clear both limits (or the one named);
    a consumer the limit held back wakes at once. Returns the limits left in force."""
    if not (in_flight or rate):
        raise ValueError("celery-redis-lua: clear_limits: nothing to clear "
                         "(in_flight and rate are both False)")
    with library_of(app) as lib:
        return logical.limit(lib, queue, clear_in_flight=in_flight, clear_rate=rate)
