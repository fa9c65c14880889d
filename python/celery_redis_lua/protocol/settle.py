"""Rejecting deliveries: the one path every reject and hand-back outside the outbox takes
(which reports the same way), with the log line an operator needs at the delivery limit."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .library import ScriptLibrary
from .ops import Rejected

logger = logging.getLogger(__name__)


def reject(lib: ScriptLibrary, queue: str, ids: Sequence[str], *, requeue: bool,
           counts: Sequence[int | None] | None = None, returned: bool = False,
           timeout: float | None = None) -> Rejected:
    """Reject through the script; with ``counts`` (the x-delivery-count each was delivered
    with) a message delivered again since is left alone (counted stale). ``returned``: handed
    back unstarted, which x-delayed-retry-type tells from a failed delivery. With a
    ``timeout`` (what is left of the exit's budget) its socket operations give up by then."""
    if timeout is None:
        result = lib.reject(queue, list(ids), requeue=requeue, counts=counts, returned=returned)
    else:
        call = lib.calls.reject(queue, list(ids), requeue=requeue, counts=counts, returned=returned)
        [result] = lib.run_many([call], timeout=timeout)
    report(lib, queue, ids, result, requeue=requeue)
    return result


def report(lib: ScriptLibrary, queue: str, ids: Sequence[str], result: Rejected, *, requeue: bool) -> None:
    """Log what an operator must see of a reject's result: a requeue that dead-lettered."""
    if result.dead_lettered and requeue:
        logger.error("celery-redis-lua: message %s of queue %r reached delivery_limit=%s and "
                     "was dead-lettered", ", ".join(ids), queue, lib.policy.delivery_limit)


def hand_back(lib: ScriptLibrary, queue: str, ids: Sequence[str],
              counts: Sequence[int | None], timeout: float | None = None) -> Rejected:
    """Give deliveries nobody will finish back to their queue, counted as a delivery (a
    returned one: its retry delay is x-delayed-retry-type 'returned' or 'all')."""
    return reject(lib, queue, ids, requeue=True, counts=counts, returned=True, timeout=timeout)
