"""Typed wrappers: one function per script that marshals arguments into a :class:`Call`
and decodes the reply. No protocol logic lives here; the scripts validate their input.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .keys import Keyspace
from .scripts import Call

Payload = str | bytes


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(value: int | None) -> str | int:
    """``None`` travels as the empty string, which the scripts read as "not set"."""
    return "" if value is None else value


@dataclass(frozen=True)
class Delivery:
    """A message handed to a consumer (or reported dropped by the sweep)."""

    queue: str
    id: str
    delivery_count: int
    payload: bytes


@dataclass(frozen=True)
class Consumed:
    deliveries: list[Delivery]
    wake_in_ms: int | None  # ms until the earliest delayed message is due; None: none delayed
    expired: int = 0  # messages whose TTL had passed: dead-lettered (reason 'expired') instead


@dataclass(frozen=True)
class Rejected:
    requeued: int
    dead_lettered: int
    deleted: int
    stale: int = 0  # fenced ids delivered again since (left alone)


@dataclass(frozen=True)
class Dropped:
    """A message the sweep took out of its queue: dead-lettered, or deleted."""

    queue: str
    id: str
    delivery_count: int
    reason: str  # 'delivery-limit' or 'expired'
    payload: bytes


@dataclass(frozen=True)
class SweepReport:
    promoted: int
    requeued: int
    unclaimed: int
    backlog: int
    dead_lettered: int  # reached the delivery limit
    expired: int  # TTL passed while waiting
    orphans: int
    more: bool
    dropped_messages: list[Dropped]


@dataclass(frozen=True)
class Declared:
    """What declare reports: message counts, and the queue arguments now in force."""

    ready: int
    delayed: int
    in_flight: int
    expires_ms: int | None
    message_ttl_ms: int | None
    max_priority: int | None


@dataclass(frozen=True)
class QueueStats:
    queue: str
    ready: int
    delayed: int
    in_flight: int
    dead: int


@dataclass(frozen=True)
class DeadLetter:
    entry_id: str
    id: str
    reason: str
    delivery_count: int
    priority: int
    payload: bytes


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _deliveries(queues: Sequence[str], flat: Sequence[Any]) -> list[Delivery]:
    """Decode the 4-items-per-message tail of consume/claim replies."""
    return [
        Delivery(queues[int(flat[i]) - 1], _text(flat[i + 1]), int(flat[i + 2]), _bytes(flat[i + 3]))
        for i in range(0, len(flat), 4)
    ]


def _consumed(queues: Sequence[str], reply: Sequence[Any]) -> Consumed:
    wake = int(reply[0])
    return Consumed(_deliveries(queues, reply[2:]), None if wake < 0 else wake, int(reply[1]))


def publish(
    keys: Keyspace, queue: str, payload: Payload, *, priority: int | str = 0,
    eta_ms: int | None = None, ttl_ms: int | None = None, visibility_ms: int,
) -> Call:
    """Store a message; ``eta_ms`` is an absolute unix time in ms (server clock)."""
    return Call("publish", keys.queue_keys(queue),
                [payload, priority, _optional(eta_ms), _optional(ttl_ms), visibility_ms], _text)


def consume(
    keys: Keyspace, queues: Sequence[str], *, count: int, visibility_ms: int, no_ack: bool = False,
    dead_letter_maxlen: int = 10_000,
) -> Call:
    """Deliver up to ``count`` messages across ``queues`` (one cluster slot)."""
    names = list(queues)
    return Call("consume", [k for q in names for k in keys.queue_keys(q)],
                [count, visibility_ms, int(no_ack), dead_letter_maxlen],
                lambda reply: _consumed(names, reply))


def claim(
    keys: Keyspace, queue: str, ids: Sequence[str], *, visibility_ms: int, no_ack: bool = False,
    dead_letter_maxlen: int = 10_000,
) -> Call:
    """Index and fetch what BZMPOP popped from ``queue``."""
    return Call("claim", keys.queue_keys(queue),
                [visibility_ms, int(no_ack), dead_letter_maxlen, *ids],
                lambda reply: _consumed([queue], reply))


def unpop(keys: Keyspace, queue: str, popped: Sequence[tuple[str, float | str]]) -> Call:
    """Put back (id, score) pairs BZMPOP popped that nobody will claim, uncounted."""
    return Call("unpop", keys.queue_keys(queue),
                [part for message_id, score in popped for part in (score, message_id)], int)


def ack(keys: Keyspace, queue: str, ids: Sequence[str]) -> Call:
    return Call("ack", keys.queue_keys(queue), list(ids), int)

def fenced(ids: Sequence[str], counts: Sequence[int | None] | None) -> list[str]:
    """``id:delivery_count`` for each id whose count is known: reject then acts only on
    that delivery, not on one made to another consumer after a restore."""
    if counts is None:
        return list(ids)
    return [i if c is None else f"{i}:{int(c)}" for i, c in zip(ids, counts, strict=True)]


def reject(
    keys: Keyspace, queue: str, ids: Sequence[str], *, requeue: bool,
    delivery_limit: int | None, dead_letter_maxlen: int, visibility_ms: int,
    counts: Sequence[int | None] | None = None,
) -> Call:
    return Call(
        "reject", keys.queue_keys(queue),
        [int(requeue), delivery_limit or 0, dead_letter_maxlen, visibility_ms, *fenced(ids, counts)],
        lambda reply: Rejected(*(int(n) for n in reply)),
    )


def extend(keys: Keyspace, queue: str, ids: Sequence[str], *, visibility_ms: int) -> Call:
    return Call("extend", keys.queue_keys(queue), [visibility_ms, *ids], int)


def sweep(
    keys: Keyspace, queues: Sequence[str], *, visibility_ms: int, delivery_limit: int | None,
    dead_letter_maxlen: int, batch: int = 1000, report_limit: int = 10,
) -> Call:
    names = list(queues)

    def decode(reply: Sequence[Any]) -> SweepReport:
        counts = [int(n) for n in reply[:8]]
        tail = reply[8:]
        dropped = [Dropped(names[int(tail[i]) - 1], _text(tail[i + 1]), int(tail[i + 2]),
                           _text(tail[i + 3]), _bytes(tail[i + 4])) for i in range(0, len(tail), 5)]
        return SweepReport(*counts[:7], more=bool(counts[7]), dropped_messages=dropped)

    return Call(
        "sweep", [k for q in names for k in keys.queue_keys(q)],
        [visibility_ms, delivery_limit or 0, dead_letter_maxlen, batch, report_limit], decode,
    )


def _argument(value: Any) -> int | None:
    number = int(value)
    return None if number < 0 else number


def declare(
    keys: Keyspace, queue: str, *, expires_ms: int | None = None,
    message_ttl_ms: int | None = None, max_priority: int | None = None,
) -> Call:
    return Call(
        "declare", keys.queue_keys(queue),
        [_optional(expires_ms), _optional(message_ttl_ms), _optional(max_priority)],
        lambda reply: Declared(*(int(n) for n in reply[:3]), *(_argument(n) for n in reply[3:6])),
    )


def binding_member(routing_key: str, pattern: str, queue: str, sep: str) -> str:
    return sep.join([routing_key or "", pattern or "", queue or ""])


def bind(keys: Keyspace, exchange: str, members: Iterable[str], *, lifetime_ms: int | None) -> Call:
    return Call("bind", [keys.binding(exchange)], [_optional(lifetime_ms), *members], int)


def unbind(keys: Keyspace, exchange: str, members: Iterable[str]) -> Call:
    return Call("unbind", [keys.binding(exchange)], list(members), int)


def lookup(keys: Keyspace, exchange: str, sep: str) -> Call:
    """Live bindings as ``(routing_key, pattern, queue)`` tuples."""
    return Call(
        "lookup", [keys.binding(exchange)], [],
        lambda reply: [tuple(_text(m).split(sep)) for m in reply],
    )


def _fanout_keys(keys: Keyspace, stream_key: str) -> list[str]:
    return [stream_key, keys.fanout_groups(stream_key)]


def fanout_publish(keys: Keyspace, stream_key: str, payload: Payload, *, maxlen: int,
                   expires_ms: int | None = None, routing_key: str = "") -> Call:
    return Call("fanout_publish", _fanout_keys(keys, stream_key),
                [payload, maxlen, _optional(expires_ms), routing_key or ""], _text)


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


def fanout_bind(keys: Keyspace, stream_key: str, queue: str, *, expires_ms: int | None = None,
                message_ttl_ms: int | None = None, stream_expires_ms: int | None = None) -> Call:
    return Call("fanout_bind", _fanout_keys(keys, stream_key),
                [queue, _optional(expires_ms), _optional(message_ttl_ms), _optional(stream_expires_ms)],
                lambda reply: FanoutBound(bool(int(reply[0])), int(reply[1]), int(reply[2])))


def fanout_consume(keys: Keyspace, stream_key: str, queue: str, consumer: str, *, count: int,
                   stream_expires_ms: int | None = None) -> Call:
    def decode(reply: Sequence[Any]) -> FanoutBatch:
        entries = [(_text(reply[i]), _text(reply[i + 1]), _bytes(reply[i + 2]))
                   for i in range(2, len(reply), 3)]
        return FanoutBatch(_text(reply[0]), entries, int(reply[1]))

    return Call("fanout_consume", _fanout_keys(keys, stream_key),
                [queue, consumer, count, _optional(stream_expires_ms)], decode)


def fanout_unbind(keys: Keyspace, stream_key: str, queue: str) -> Call:
    return Call("fanout_unbind", _fanout_keys(keys, stream_key), [queue], bool)


def fanout_leave(keys: Keyspace, stream_key: str, queue: str, consumer: str) -> Call:
    return Call("fanout_leave", [stream_key], [queue, consumer], bool)


def exists(keys: Keyspace, queue: str) -> Call:
    return Call("exists", [keys.meta(queue)], [], bool)


def purge(keys: Keyspace, queue: str, *, batch: int = 10000) -> Call:
    return Call("purge", keys.queue_keys(queue), [batch],
                lambda reply: (int(reply[0]), int(reply[1])))


def delete(keys: Keyspace, queue: str) -> Call:
    return Call("delete", keys.queue_keys(queue), [], int)


def size(keys: Keyspace, queue: str) -> Call:
    return Call("size", [keys.queue(queue)], [], int)


def stats(keys: Keyspace, queues: Sequence[str]) -> Call:
    names = list(queues)

    def decode(reply: Sequence[Any]) -> list[QueueStats]:
        return [QueueStats(names[i // 4], *(int(n) for n in reply[i:i + 4]))
                for i in range(0, len(reply), 4)]

    return Call("stats", [k for q in names for k in keys.queue_keys(q)], [], decode)


def _dead_letter(entry: Sequence[Any]) -> DeadLetter:
    raw = entry[1]
    fields = {_text(raw[i]): raw[i + 1] for i in range(0, len(raw), 2)}
    return DeadLetter(
        _text(entry[0]), _text(fields.get("id", "")), _text(fields.get("reason", "")),
        int(fields.get("delivery_count", 0)), int(fields.get("priority", 0)),
        _bytes(fields.get("payload", b"")),
    )


def dead_list(keys: Keyspace, queue: str, *, count: int = 100, after: str | None = None) -> Call:
    return Call("dead_list", [keys.dead(queue)], [count, after or ""],
                lambda reply: [_dead_letter(e) for e in reply])


def dead_replay(keys: Keyspace, queue: str, *, visibility_ms: int, count: int = 100,
                entry_ids: Sequence[str] = ()) -> Call:
    return Call("dead_replay", keys.queue_keys(queue), [visibility_ms, count, *entry_ids],
                lambda reply: [_text(i) for i in reply])


def dead_purge(keys: Keyspace, queue: str) -> Call:
    return Call("dead_purge", [keys.dead(queue)], [], int)
