"""Exchanges: the binding tables of direct and topic exchanges (and the cached routes a
publish may refuse), and the streams of fanout exchanges with a consumer group per queue."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..call import Call
from ..keys import Binding, Keyspace
from ..policy import Policy
from .base import Payload, as_bytes, operation, optional_arg, text

# -- bindings -----------------------------------------------------------------------------

class Routes(list[Binding]):
    """The live bindings of an exchange, as lookup found them: a list, plus the binding
    table server's unix ms at the lookup and the ms until the first of them goes stale
    (None: none ever does). A producer caches them no longer than that."""

    def __init__(self, bindings: Iterable[Binding], looked_up_ms: int, stale_in_ms: int | None) -> None:
        super().__init__(bindings)
        self.looked_up_ms = looked_up_ms
        self.stale_in_ms = stale_in_ms


class StaleRoute(Exception):
    """publish refused a cached route: the queue's bindings to its exchange changed after
    the route was looked up (or the queue is gone). Nothing was written."""

    def __init__(self, queue: str, changed_ms: int | None) -> None:
        super().__init__(f"the route to queue {queue!r} changed (at {changed_ms}) after it was cached")
        self.queue = queue
        self.changed_ms = changed_ms


@operation
def bind(k: Keyspace, p: Policy, exchange: str, members: Iterable[str], *,
         lifetime_ms: int | None = None) -> Call[int]:
    return Call("bind", [k.binding(exchange)], [optional_arg(lifetime_ms), *members], int)


@operation
def unbind(k: Keyspace, p: Policy, exchange: str, members: Iterable[str]) -> Call[int]:
    return Call("unbind", [k.binding(exchange)], list(members), int)


@operation
def lookup(k: Keyspace, p: Policy, exchange: str) -> Call[Routes]:
    """The live bindings of ``exchange``, with when they were looked up and how long they hold."""
    def decode(reply: Sequence[Any]) -> Routes:
        stale_in = int(reply[1])
        return Routes([k.parse_binding(m) for m in reply[2:]], int(reply[0]),
                      None if stale_in < 0 else stale_in)

    return Call("lookup", [k.binding(exchange)], [], decode)


@operation
def rerouted(k: Keyspace, p: Policy, queue: str, exchange: str, changed_ms: int) -> Call[bool]:
    """Record that ``exchange``'s bindings to ``queue`` changed (at the binding table's
    ``changed_ms``): cached routes looked up before it are refused by publish."""
    return Call("rerouted", [k.meta(queue)], [exchange, changed_ms], lambda reply: bool(int(reply)))


# -- fanout streams -----------------------------------------------------------------------

@dataclass(frozen=True)
class FanoutBatch:
    next_id: str  # block on XREAD after this id: it returns as soon as there is more to read
    entries: list[tuple[str, str, bytes]]  # (entry id, routing key, payload)
    skipped: int = 0  # entries older than the queue's x-message-ttl, not delivered


@dataclass(frozen=True)
class FanoutBound:
    created: bool  # the queue's group was made now, at the stream's end
    groups_removed: int  # expired groups of other queues
    consumers_removed: int  # idle consumers of this queue's group


def _fanout_keys(k: Keyspace, exchange: str) -> list[str]:
    stream = k.fanout(exchange)
    return [stream, k.fanout_groups(stream)]


@operation
def fanout_publish(k: Keyspace, p: Policy, exchange: str, payload: Payload, *, maxlen: int = 10_000,
                   expires_ms: int | None = None, routing_key: str = "") -> Call[str]:
    return Call("fanout_publish", _fanout_keys(k, exchange),
                [payload, maxlen, optional_arg(expires_ms), routing_key or ""], text)


@operation
def fanout_bind(k: Keyspace, p: Policy, exchange: str, queue: str, *, expires_ms: int | None = None,
                message_ttl_ms: int | None = None, stream_expires_ms: int | None = None) -> Call[FanoutBound]:
    return Call("fanout_bind", _fanout_keys(k, exchange),
                [queue, optional_arg(expires_ms), optional_arg(message_ttl_ms),
                 optional_arg(stream_expires_ms)],
                lambda reply: FanoutBound(bool(int(reply[0])), int(reply[1]), int(reply[2])))


@operation
def fanout_consume(k: Keyspace, p: Policy, exchange: str, queue: str, consumer: str, *, count: int = 100,
                   stream_expires_ms: int | None = None) -> Call[FanoutBatch]:
    def decode(reply: Sequence[Any]) -> FanoutBatch:
        entries = [(text(reply[i]), text(reply[i + 1]), as_bytes(reply[i + 2]))
                   for i in range(2, len(reply), 3)]
        return FanoutBatch(text(reply[0]), entries, int(reply[1]))

    return Call("fanout_consume", _fanout_keys(k, exchange),
                [queue, consumer, count, optional_arg(stream_expires_ms)], decode)


@operation
def fanout_unbind(k: Keyspace, p: Policy, exchange: str, queue: str) -> Call[bool]:
    return Call("fanout_unbind", _fanout_keys(k, exchange), [queue], bool)


@operation
def fanout_leave(k: Keyspace, p: Policy, exchange: str, queue: str, consumer: str) -> Call[bool]:
    return Call("fanout_leave", [k.fanout(exchange)], [queue, consumer], bool)
