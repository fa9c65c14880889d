"""A primary fenced by ``min-replicas-to-write``: its refusal, and a wait that rides it out.

With ``min-replicas-to-write N`` a primary with fewer than N replicas that acknowledged
within ``min-replicas-max-lag`` seconds refuses every command that may write with
``NOREPLICAS Not enough good replicas to write.``: our scripts (their ``#!lua`` flags say they
may write) and the wake-list BLPOP, before running them. So a refused call never ran, and
running it again stores nothing twice. redis-py has no class of its own for the refusal.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from .liveness import ride_out_failover

NOREPLICAS = "NOREPLICAS"
# A refused or failed call goes again after FIRST_RETRY_SECONDS, then doubling up to
# RETRY_SECONDS: a fence, a failover's CLUSTERDOWN or READONLY lasts a second or a few, and
# nothing tells when it is over (a replica catching up sends no event to wait on).
FIRST_RETRY_SECONDS, RETRY_SECONDS = 0.05, 1.0
T = TypeVar("T")
logger = logging.getLogger(__name__)
# What each queue's declare answered in this process on a cluster, by broker (URL), queue and
# arguments: given back when a fenced primary refuses the same declare again (redeclare). The
# newest DECLARED_KEPT only: reply queues named by uuid come and go.
_declared: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
DECLARED_KEPT = 4096


class NoReplicasError(ResponseError):
    """``NOREPLICAS``: a fenced primary refused a command that may write, before running it. A
    moment's refusal, like READONLY from a demoted primary: the kombu transport counts it among
    its connection errors (a consume reconnects), an outbox sends its acks again, and a
    producer's calls wait it out (:func:`wait_out`, the ``fence_timeout`` option)."""


def refusal(error: ResponseError) -> ResponseError:
    """``error`` as :class:`NoReplicasError` when it is a fenced primary's refusal; else as it is."""
    if not isinstance(error, NoReplicasError) and str(error).startswith(NOREPLICAS):
        return NoReplicasError(*error.args)
    return error


def pauses() -> Iterator[float]:
    """The waits between a call's tries: FIRST_RETRY_SECONDS, doubling up to RETRY_SECONDS."""
    pause = FIRST_RETRY_SECONDS
    while True:
        yield pause
        pause = min(pause * 2, RETRY_SECONDS)


def wait_out(run: Callable[[], T], timeout: float, *, failover: float = 0.0) -> T:
    """``run()``, run again while a fenced primary refuses it, backing off (:func:`pauses`),
    for up to ``timeout`` seconds; then its refusal is raised (0: at once). ``failover`` (a
    cluster's): each run also rides out its slot's failover for up to that many seconds
    (liveness.ride_out_failover)."""
    deadline = time.monotonic() + timeout
    waits = pauses()
    while True:
        try:
            return ride_out_failover(run, failover) if failover else run()
        except NoReplicasError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(next(waits), left))


def redeclare(lib: Any, queue: str, arguments: dict[str, Any], timeout: float, broker: str | None) -> Any:
    """``lib.declare(queue, **arguments)``, waited out as :func:`wait_out` does. On a cluster
    (``broker``: its URL; None elsewhere), a declare this process made before with the same
    arguments that a fenced primary now refuses gives back what it answered then, at once:
    Celery declares its queues at every reconnect, and waiting each out (then raising, and
    reconnecting) stopped every queue of the worker while one shard was fenced (chaos seed
    1005). Declaring an existing queue again with the same arguments changes nothing."""
    if broker is None:
        return wait_out(lambda: lib.declare(queue, **arguments), timeout)
    key = (broker, queue, repr(sorted(arguments.items())))
    if key not in _declared:
        declared = wait_out(lambda: lib.declare(queue, **arguments), timeout)
    else:
        try:
            declared = lib.declare(queue, **arguments)
        except NoReplicasError as error:
            logger.warning("celery-redis-lua: declaring %r again was refused (%s); it was declared with "
                           "the same arguments before, going on", queue, error)
            return _declared[key]
    _declared[key] = declared
    _declared.move_to_end(key)
    while len(_declared) > DECLARED_KEPT:
        _declared.popitem(last=False)
    return declared
