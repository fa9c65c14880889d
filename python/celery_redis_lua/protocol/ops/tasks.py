"""One task's message in a queue, found by its Celery task id (publish indexes it): where
it is, and taking it out before it is delivered."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..call import Call
from ..keys import Keyspace
from ..policy import Policy
from .base import operation, text


@dataclass(frozen=True)
class Located:
    """Where a task's message is in one queue (locate.lua). ``state`` is 'ready', 'delayed',
    'retry' (waiting for a delayed retry), 'in_flight' or 'missing'; ``detail`` is the messages
    ahead (ready), the time it is ready (delayed, retry) or the deadline (in flight), in the
    server's unix ms."""

    queue: str
    state: str
    id: str | None = None
    delivery_count: int | None = None
    priority: int | None = None
    expires_at: int | None = None
    detail: int | None = None


@dataclass(frozen=True)
class Cancelled:
    """What cancel.lua did: 'cancelled' (``was`` 'ready', 'delayed' or 'retry'), 'in_flight' (left
    alone) or 'missing'."""

    queue: str
    outcome: str
    id: str | None = None
    was: str | None = None


@operation
def locate(k: Keyspace, p: Policy, queue: str, task_id: str) -> Call[Located]:
    def decode(reply: Sequence[Any]) -> Located:
        state = text(reply[0])
        if state == "missing":
            return Located(queue, state)
        expires = text(reply[4])
        return Located(queue, state, text(reply[1]), int(reply[2]), int(reply[3]),
                       None if expires == "-" else int(expires), int(reply[5]))

    return Call("locate", k.queue_keys(queue), [task_id], decode)


@operation
def cancel(k: Keyspace, p: Policy, queue: str, task_id: str, *, reason: str = "cancelled") -> Call[Cancelled]:
    """``reason``: the dead letter's, 'cancelled' (the CLI's cancel) or 'revoked' (Celery's
    revoke(), seen on its way to the workers)."""
    def decode(reply: Sequence[Any]) -> Cancelled:
        outcome = text(reply[0])
        if outcome == "missing":
            return Cancelled(queue, outcome)
        return Cancelled(queue, outcome, text(reply[1]), text(reply[2]) if outcome == "cancelled" else None)

    return Call("cancel", k.queue_keys(queue), [task_id, p.dead_letter_maxlen, reason], decode)
