"""A queue's life: declare it (with its arguments), purge it, delete it, and the small
questions about it (does it exist, how many are ready), plus migrate's record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..call import Call
from ..keys import Keyspace
from ..policy import Policy
from ..retry import DISABLED, DelayedRetry
from .base import int_or_none, operation, optional_arg, text

# -- what the scripts reply ---------------------------------------------------------------

@dataclass(frozen=True)
class Declared:
    """What declare reports: message counts, and the queue arguments now in force."""

    ready: int
    delayed: int
    in_flight: int
    expires_ms: int | None
    message_ttl_ms: int | None
    max_priority: int | None
    retry: DelayedRetry = DISABLED
    # Stored arguments out of range (an older version's, or set by hand): 'x-name=VALUE'
    # each; in force (above) as their bound when past it, as not set when no number.
    out_of_range: tuple[str, ...] = ()
    consumer_timeout_ms: int | None = None  # x-consumer-timeout: how long a delivery is kept alive


@dataclass(frozen=True)
class Deleted:
    """What delete reports: how many messages the queue held, and the fanout exchanges it
    was bound to (their groups are in other slots: remove each with fanout_unbind)."""

    messages: int
    fanout_exchanges: tuple[str, ...] = ()


# -- the scripts --------------------------------------------------------------------------

@operation
def declare(k: Keyspace, p: Policy, queue: str, *, expires_ms: int | None = None,
            message_ttl_ms: int | None = None, max_priority: int | None = None,
            fanout_exchange: str | None = None, retry: DelayedRetry | None = None,
            consumer_timeout_ms: int | None = None) -> Call[Declared]:
    """``fanout_exchange``: record that the queue is bound to it, so that delete names it.
    ``retry``: the queue's delayed retry (None: not declared, the stored one stays)."""
    args = [optional_arg(expires_ms), optional_arg(message_ttl_ms), optional_arg(max_priority),
            fanout_exchange or "", *(retry.arguments() if retry is not None else ["", "", ""]),
            optional_arg(consumer_timeout_ms)]

    def decode(reply: Sequence[Any]) -> Declared:
        retry = DelayedRetry(text(reply[6]), int_or_none(reply[7]), int_or_none(reply[8]))
        ready, delayed, in_flight = (int(n) for n in reply[:3])
        expires, ttl, max_priority = (int_or_none(n) for n in reply[3:6])
        out_of_range = tuple(text(item) for item in reply[9]) if len(reply) > 9 else ()
        consumer_timeout = int_or_none(reply[10]) if len(reply) > 10 else None
        return Declared(ready, delayed, in_flight, expires, ttl, max_priority, retry, out_of_range,
                        consumer_timeout)

    return Call("declare", k.queue_keys(queue), args, decode)


@operation
def purge(k: Keyspace, p: Policy, queue: str, *, batch: int = 10000) -> Call[tuple[int, int]]:
    """One batch: (purged, remaining); :meth:`ScriptLibrary.purge` repeats it."""
    return Call("purge", k.queue_keys(queue), [batch], lambda reply: (int(reply[0]), int(reply[1])))


@operation
def delete(k: Keyspace, p: Policy, queue: str) -> Call[Deleted]:
    return Call("delete", k.queue_keys(queue), [],
                lambda reply: Deleted(int(reply[0]), tuple(text(e) for e in reply[1:])))


@operation
def exists(k: Keyspace, p: Policy, queue: str) -> Call[bool]:
    return Call("exists", [k.meta(queue)], [], bool)


@operation
def size(k: Keyspace, p: Policy, queue: str) -> Call[int]:
    return Call("size", [k.queue(queue)], [], int)


@operation
def migrated(k: Keyspace, p: Policy, queue: str, action: str, identity: str | None = None) -> Call[int]:
    """``migrate``'s record of what it published into ``queue``: mark, forget or clear."""
    return Call("migrated", [k.migrated(queue)], [action] if identity is None else [action, identity], int)
