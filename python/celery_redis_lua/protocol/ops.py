"""One typed definition per script: the arguments it takes, the :class:`Call` it makes, and
the reply it decodes. No protocol logic lives here; the scripts validate their input.

Every operation takes the keyspace and the policy first, so :class:`ScriptLibrary` binds
them all the same way (``lib.ack(queue, ids)``, or ``lib.calls.ack(queue, ids)`` for a
pipeline). A new script needs its Lua file and one function here, marked ``@operation``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .keys import Binding, Keyspace
from .policy import Policy
from .retry import DISABLED, DelayedRetry
from .runner import Call

Payload = str | bytes
Operation = Callable[..., Call[Any]]
OPERATIONS: dict[str, Operation] = {}
F = TypeVar("F", bound=Operation)


def operation(function: F) -> F:
    """Register ``function`` as the definition of the script of the same name."""
    OPERATIONS[function.__name__] = function
    return function


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _optional(value: int | None) -> str | int:
    """``None`` travels as the empty string, which the scripts read as "not set"."""
    return "" if value is None else value


def _keys_of(k: Keyspace, queues: Sequence[str]) -> list[str]:
    return [key for queue in queues for key in k.queue_keys(queue)]


# -- what the scripts reply ---------------------------------------------------------------

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


@dataclass(frozen=True)
class Delivery:
    """A message handed to a consumer."""

    queue: str
    id: str
    delivery_count: int
    payload: bytes


@dataclass(frozen=True)
class Consumed:
    deliveries: list[Delivery]
    wake_in_ms: int | None  # ms until the earliest ETA or a rate's next token; None: neither
    expired: int = 0  # messages whose TTL had passed: dead-lettered (reason 'expired') instead
    # ms until the next token of a rate that holds back ready messages (also in wake_in_ms):
    # the consumer times this wait itself, the server's block timeouts being 1/hz coarse
    rate_in_ms: int | None = None


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
    """What one or more sweep calls did. ``limit_reached`` and ``expired`` messages went to
    the dead-letter stream, or were deleted when dead_letter_maxlen is 0."""

    promoted: int
    requeued: int
    unclaimed: int
    backlog: int
    limit_reached: int
    expired: int
    orphans: int
    more: bool
    dropped_messages: list[Dropped]

    def __add__(self, other: SweepReport) -> SweepReport:
        return SweepReport(
            self.promoted + other.promoted, self.requeued + other.requeued,
            self.unclaimed + other.unclaimed, self.backlog + other.backlog,
            self.limit_reached + other.limit_reached, self.expired + other.expired,
            self.orphans + other.orphans, other.more, self.dropped_messages + other.dropped_messages,
        )


EMPTY_SWEEP = SweepReport(0, 0, 0, 0, 0, 0, 0, False, [])


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


@dataclass(frozen=True)
class QueueStats:
    queue: str
    ready: int
    delayed: int
    in_flight: int
    dead: int


@dataclass(frozen=True)
class Limits:
    """A queue's limits for all its consumers together (lua/limit.lua): most messages in
    flight, and a rate as the script stores it ('20/s', '100/m', '5/h'); None: unset."""

    in_flight: int | None = None
    rate: str | None = None

    @property
    def rate_per_second(self) -> float | None:
        if self.rate is None:
            return None
        count, _, unit = self.rate.partition("/")
        return int(count) / RATE_PERIOD_SECONDS[unit]

    def __str__(self) -> str:
        """'8 in flight, 20/s', '20/s', or '-' when there is none."""
        parts = ([] if self.in_flight is None else [f"{self.in_flight} in flight"]) + \
            ([] if self.rate is None else [self.rate])
        return ", ".join(parts) or "-"


RATE_PERIOD_SECONDS = {"s": 1, "m": 60, "h": 3600}


def _limits(in_flight: Any, rate: Any) -> Limits:
    """The script's pair (in_flight, rate), '' for unset."""
    return Limits(int(in_flight) if _text(in_flight) else None, _text(rate) or None)


@dataclass(frozen=True)
class QueueMetrics:
    """What a dashboard shows of one queue, from one snapshot (metrics.lua). Times are the
    server's unix ms; ``oldest_ready_at`` and ``next_eta`` are None when there is none."""

    queue: str
    now: int
    ready: int
    delayed: int
    in_flight: int
    dead: int
    oldest_ready_at: int | None
    next_eta: int | None
    redelivered: int
    dropped: dict[str, int]
    paused: str | None = None  # the reason given to pause ('' for none); None: running
    retrying: int = 0  # of the delayed, how many wait for a delayed retry (x-delayed-retry-type)
    limits: Limits = Limits()  # the queue's limits (the limit script); Limits() when it has none
    exists: bool = True  # its meta hash exists; False: gone (expired, deleted) or only bound

    @property
    def oldest_ready_age_ms(self) -> int | None:
        return None if self.oldest_ready_at is None else max(0, self.now - self.oldest_ready_at)

    @property
    def next_eta_in_ms(self) -> int | None:
        return None if self.next_eta is None else max(0, self.next_eta - self.now)


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


@dataclass(frozen=True)
class DeadLetter:
    entry_id: str
    id: str
    reason: str
    delivery_count: int
    priority: int
    payload: bytes


@dataclass(frozen=True)
class FanoutBatch:
    next_id: str  # block on XREAD after this id: it returns as soon as there is more to read
    entries: list[tuple[str, str, bytes]]  # (entry id, routing key, payload)
    skipped: int = 0  # entries older than the queue's x-message-ttl, not delivered


@dataclass(frozen=True)
class Deleted:
    """What delete reports: how many messages the queue held, and the fanout exchanges it
    was bound to (their groups are in other slots: remove each with fanout_unbind)."""

    messages: int
    fanout_exchanges: tuple[str, ...] = ()


@dataclass(frozen=True)
class FanoutBound:
    created: bool  # the queue's group was made now, at the stream's end
    groups_removed: int  # expired groups of other queues
    consumers_removed: int  # idle consumers of this queue's group


def _deliveries(queues: Sequence[str], flat: Sequence[Any]) -> list[Delivery]:
    """The 4-items-per-message tail of a consume reply."""
    return [Delivery(queues[int(flat[i]) - 1], _text(flat[i + 1]), int(flat[i + 2]), _bytes(flat[i + 3]))
            for i in range(0, len(flat), 4)]


def _consumed(queues: Sequence[str], reply: Sequence[Any]) -> Consumed:
    wake, flat = int(reply[0]), reply[2:]
    rate = int(flat[-1]) if len(flat) % 4 else None  # a last item past the messages: rate_in_ms
    return Consumed(_deliveries(queues, flat[:len(flat) - len(flat) % 4]), None if wake < 0 else wake,
                    int(reply[1]), rate)


# -- the queue scripts (the eight keys of each queue) --------------------------------------

@operation
def publish(k: Keyspace, p: Policy, queue: str, payload: Payload, *, priority: int | str = 0,
            eta_ms: int | None = None, ttl_ms: int | None = None, task_id: str | None = None,
            route: tuple[str, int] | None = None) -> Call[str]:
    """Store a message; ``eta_ms`` is an absolute unix time in ms (server clock); ``task_id``
    (the Celery task id) is indexed so that :func:`locate` and :func:`cancel` find it.
    ``route`` is (exchange, looked_up_ms) of a cached route: the call raises
    :class:`StaleRoute`, writing nothing, when the queue's bindings changed since."""
    args = [payload, priority, _optional(eta_ms), _optional(ttl_ms), p.visibility_ms, task_id or ""]
    if route is not None:
        args += [route[0], route[1]]

    def decode(reply: Any) -> str:
        if isinstance(reply, list):  # ['stale-route', changed_ms or -1]
            changed = int(reply[1])
            raise StaleRoute(queue, None if changed < 0 else changed)
        return _text(reply)

    return Call("publish", k.queue_keys(queue), args, decode)


@operation
def consume(k: Keyspace, p: Policy, queues: Sequence[str], count: int = 1, *,
            no_ack: bool = False) -> Call[Consumed]:
    """Deliver up to ``count`` messages across ``queues`` (which must share a cluster slot;
    :meth:`ScriptLibrary.consume` groups them)."""
    names = list(queues)
    return Call("consume", _keys_of(k, names), [count, p.visibility_ms, int(no_ack), p.dead_letter_maxlen],
                lambda reply: _consumed(names, reply))


@operation
def unpop(k: Keyspace, p: Policy, queue: str) -> Call[int]:
    """Give back the wake token a blocked consumer's BLPOP took from ``queue`` when it stops
    before it consumes (1: it went back; 0: nothing is queued, or a token already waits)."""
    return Call("unpop", k.queue_keys(queue), [], int)


@operation
def pause(k: Keyspace, p: Policy, queue: str, reason: str = "") -> Call[bool]:
    """Pause ``queue`` (it takes publishes and delivers nothing); True unless it was paused."""
    return Call("pause", k.queue_keys(queue), [reason], bool)


@operation
def resume(k: Keyspace, p: Policy, queue: str) -> Call[bool]:
    """Resume ``queue`` and wake a blocked consumer; True if it was paused."""
    return Call("resume", k.queue_keys(queue), [], bool)


@operation
def limit(k: Keyspace, p: Policy, queue: str, *, in_flight: int | str | None = None,
          rate: str | None = None, clear_in_flight: bool = False, clear_rate: bool = False) -> Call[Limits]:
    """Set (``in_flight``, ``rate`` as 'N/s', 'N/m' or 'N/h') or clear a limit of ``queue``
    for all its consumers together; None leaves it as it is. Returns the limits in force.
    The script judges the values (and refuses a queue that does not exist, naming it), so
    ``in_flight`` may be the text an operator typed."""
    if (in_flight is not None and clear_in_flight) or (rate is not None and clear_rate):
        raise ValueError("celery-redis-lua: limit: set a limit or clear it, not both")
    args = ["clear" if clear_in_flight else "" if in_flight is None else str(in_flight),
            "clear" if clear_rate else "" if rate is None else str(rate)]
    return Call("limit", k.queue_keys(queue), args, lambda reply: _limits(*reply))


def _paused_reason(value: Any) -> str | None:
    """meta's 'paused' field ('<unix ms> <reason>') as the reason; None when not paused."""
    if not value:
        return None
    return _text(value).partition(" ")[2]


class Acked(int):
    """How many messages an ack deleted (an int, as the reply's first item), and ``stale``:
    the ids it left alone because another consumer holds them now (fenced by a count)."""

    stale: tuple[str, ...]

    def __new__(cls, acked: int, stale: Iterable[str] = ()) -> Acked:
        self = super().__new__(cls, acked)
        self.stale = tuple(stale)
        return self


@operation
def ack(k: Keyspace, p: Policy, queue: str, ids: Sequence[str], *,
        counts: Sequence[int | None] | None = None) -> Call[Acked]:
    """With ``counts`` (the x-delivery-count each was delivered with), an ack of a message
    delivered again since, to a consumer that holds it now, is left alone (``Acked.stale``)."""
    return Call("ack", k.queue_keys(queue), fenced(ids, counts),
                lambda reply: Acked(int(reply[0]), (_text(i) for i in reply[1:])))


def fenced(ids: Sequence[str], counts: Sequence[int | None] | None) -> list[str]:
    """``id:delivery_count`` for each id whose count is known: reject then acts only on
    that delivery, not on one made to another consumer after a restore."""
    if counts is None:
        return list(ids)
    return [i if c is None else f"{i}:{int(c)}" for i, c in zip(ids, counts, strict=True)]


@operation
def reject(k: Keyspace, p: Policy, queue: str, ids: Sequence[str], *, requeue: bool,
           counts: Sequence[int | None] | None = None, returned: bool = False) -> Call[Rejected]:
    """``returned``: the deliveries are handed back unstarted (RabbitMQ's returned, not
    failed: the two kinds x-delayed-retry-type tells apart)."""
    cause = ("returned" if returned else "failed") if requeue else "drop"
    return Call("reject", k.queue_keys(queue),
                [cause, p.delivery_limit or 0, p.dead_letter_maxlen, p.visibility_ms,
                 *fenced(ids, counts)],
                lambda reply: Rejected(*(int(n) for n in reply)))


@operation
def extend(k: Keyspace, p: Policy, queue: str, ids: Sequence[str] = ()) -> Call[int]:
    return Call("extend", k.queue_keys(queue), [p.visibility_ms, *ids], int)


# Overdue deliveries one sweep call hands back at most. The server runs a call alone: with
# 100,000 overdue in a 1,000,000 backlog (scripts/bench/backlog.py) a call of 1,000 held it
# 9-18 ms, one of 200 2.3-3.3 ms on one host and 5.8-7.4 ms on a slower one (2026-12-02);
# 100 keeps a call to a few ms on both.
SWEEP_BATCH = 100


@operation
def sweep(k: Keyspace, p: Policy, queues: Sequence[str], *, batch: int = SWEEP_BATCH,
          report_limit: int = 10) -> Call[SweepReport]:
    names = list(queues)

    def decode(reply: Sequence[Any]) -> SweepReport:
        promoted, requeued, unclaimed, backlog, limit_reached, expired, orphans, more = (
            int(n) for n in reply[:8])
        tail = reply[8:]
        dropped = [Dropped(names[int(tail[i]) - 1], _text(tail[i + 1]), int(tail[i + 2]),
                           _text(tail[i + 3]), _bytes(tail[i + 4])) for i in range(0, len(tail), 5)]
        return SweepReport(promoted, requeued, unclaimed, backlog, limit_reached, expired, orphans,
                           more=bool(more), dropped_messages=dropped)

    return Call("sweep", _keys_of(k, names),
                [p.visibility_ms, p.delivery_limit or 0, p.dead_letter_maxlen, batch, report_limit], decode)


def _argument(value: Any) -> int | None:
    number = int(value)
    return None if number < 0 else number


@operation
def declare(k: Keyspace, p: Policy, queue: str, *, expires_ms: int | None = None,
            message_ttl_ms: int | None = None, max_priority: int | None = None,
            fanout_exchange: str | None = None, retry: DelayedRetry | None = None) -> Call[Declared]:
    """``fanout_exchange``: record that the queue is bound to it, so that delete names it.
    ``retry``: the queue's delayed retry (None: not declared, the stored one stays)."""
    args = [_optional(expires_ms), _optional(message_ttl_ms), _optional(max_priority), fanout_exchange or "",
            *(retry.arguments() if retry is not None else ["", "", ""])]

    def decode(reply: Sequence[Any]) -> Declared:
        retry = DelayedRetry(_text(reply[6]), _argument(reply[7]), _argument(reply[8]))
        ready, delayed, in_flight = (int(n) for n in reply[:3])
        expires, ttl, max_priority = (_argument(n) for n in reply[3:6])
        out_of_range = tuple(_text(item) for item in reply[9]) if len(reply) > 9 else ()
        return Declared(ready, delayed, in_flight, expires, ttl, max_priority, retry, out_of_range)

    return Call("declare", k.queue_keys(queue), args, decode)


@operation
def purge(k: Keyspace, p: Policy, queue: str, *, batch: int = 10000) -> Call[tuple[int, int]]:
    """One batch: (purged, remaining); :meth:`ScriptLibrary.purge` repeats it."""
    return Call("purge", k.queue_keys(queue), [batch], lambda reply: (int(reply[0]), int(reply[1])))


@operation
def delete(k: Keyspace, p: Policy, queue: str) -> Call[Deleted]:
    return Call("delete", k.queue_keys(queue), [],
                lambda reply: Deleted(int(reply[0]), tuple(_text(e) for e in reply[1:])))


@operation
def stats(k: Keyspace, p: Policy, queues: Sequence[str]) -> Call[list[QueueStats]]:
    names = list(queues)

    def decode(reply: Sequence[Any]) -> list[QueueStats]:
        return [QueueStats(names[i // 4], *(int(n) for n in reply[i:i + 4])) for i in range(0, len(reply), 4)]

    return Call("stats", _keys_of(k, names), [], decode)


METRICS_ITEMS = 13  # per queue in the metrics script's reply


@operation
def metrics(k: Keyspace, p: Policy, queues: Sequence[str]) -> Call[list[QueueMetrics]]:
    names = list(queues)

    def optional(value: Any) -> int | None:
        return None if int(value) < 0 else int(value)

    def decode(reply: Sequence[Any]) -> list[QueueMetrics]:
        now, rows = int(reply[0]), reply[1:]
        found = []
        for i in range(0, len(rows), METRICS_ITEMS):
            (ready, delayed, in_flight, dead, oldest, eta, redelivered, dropped, paused,
             retrying, cap, rate, exists) = rows[i:i + METRICS_ITEMS]
            found.append(QueueMetrics(
                names[i // METRICS_ITEMS], now, int(ready), int(delayed), int(in_flight), int(dead),
                optional(oldest), optional(eta), int(redelivered),
                {_text(dropped[j]): int(dropped[j + 1]) for j in range(0, len(dropped), 2)},
                _paused_reason(paused), int(retrying), _limits(cap, rate), bool(int(exists))))
        return found

    return Call("metrics", _keys_of(k, names), [], decode)


@operation
def locate(k: Keyspace, p: Policy, queue: str, task_id: str) -> Call[Located]:
    def decode(reply: Sequence[Any]) -> Located:
        state = _text(reply[0])
        if state == "missing":
            return Located(queue, state)
        expires = _text(reply[4])
        return Located(queue, state, _text(reply[1]), int(reply[2]), int(reply[3]),
                       None if expires == "-" else int(expires), int(reply[5]))

    return Call("locate", k.queue_keys(queue), [task_id], decode)


@operation
def cancel(k: Keyspace, p: Policy, queue: str, task_id: str) -> Call[Cancelled]:
    def decode(reply: Sequence[Any]) -> Cancelled:
        outcome = _text(reply[0])
        if outcome == "missing":
            return Cancelled(queue, outcome)
        return Cancelled(queue, outcome, _text(reply[1]), _text(reply[2]) if outcome == "cancelled" else None)

    return Call("cancel", k.queue_keys(queue), [task_id, p.dead_letter_maxlen], decode)


@operation
def dead_replay(k: Keyspace, p: Policy, queue: str, *, count: int = 100,
                entry_ids: Sequence[str] = ()) -> Call[list[str]]:
    return Call("dead_replay", k.queue_keys(queue), [p.visibility_ms, count, *entry_ids],
                lambda reply: [_text(i) for i in reply])


# -- queue scripts with one key --------------------------------------------------------------

@operation
def exists(k: Keyspace, p: Policy, queue: str) -> Call[bool]:
    return Call("exists", [k.meta(queue)], [], bool)


@operation
def size(k: Keyspace, p: Policy, queue: str) -> Call[int]:
    return Call("size", [k.queue(queue)], [], int)


def _dead_letter(entry: Sequence[Any]) -> DeadLetter:
    raw = entry[1]
    fields = {_text(raw[i]): raw[i + 1] for i in range(0, len(raw), 2)}
    return DeadLetter(
        _text(entry[0]), _text(fields.get("id", "")), _text(fields.get("reason", "")),
        int(fields.get("delivery_count", 0)), int(fields.get("priority", 0)),
        _bytes(fields.get("payload", b"")),
    )


@operation
def dead_list(k: Keyspace, p: Policy, queue: str, *, count: int = 100,
              after: str | None = None) -> Call[list[DeadLetter]]:
    return Call("dead_list", [k.dead(queue)], [count, after or ""],
                lambda reply: [_dead_letter(e) for e in reply])


@operation
def dead_purge(k: Keyspace, p: Policy, queue: str) -> Call[int]:
    return Call("dead_purge", [k.dead(queue)], [], int)


@operation
def migrated(k: Keyspace, p: Policy, queue: str, action: str, identity: str | None = None) -> Call[int]:
    """``migrate``'s record of what it published into ``queue``: mark, forget or clear."""
    return Call("migrated", [k.migrated(queue)], [action] if identity is None else [action, identity], int)


# -- bindings ---------------------------------------------------------------------------------

@operation
def bind(k: Keyspace, p: Policy, exchange: str, members: Iterable[str], *,
         lifetime_ms: int | None = None) -> Call[int]:
    return Call("bind", [k.binding(exchange)], [_optional(lifetime_ms), *members], int)


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


# -- fanout streams ---------------------------------------------------------------------------

def _fanout_keys(k: Keyspace, exchange: str) -> list[str]:
    stream = k.fanout(exchange)
    return [stream, k.fanout_groups(stream)]


@operation
def fanout_publish(k: Keyspace, p: Policy, exchange: str, payload: Payload, *, maxlen: int = 10_000,
                   expires_ms: int | None = None, routing_key: str = "") -> Call[str]:
    return Call("fanout_publish", _fanout_keys(k, exchange),
                [payload, maxlen, _optional(expires_ms), routing_key or ""], _text)


@operation
def fanout_bind(k: Keyspace, p: Policy, exchange: str, queue: str, *, expires_ms: int | None = None,
                message_ttl_ms: int | None = None, stream_expires_ms: int | None = None) -> Call[FanoutBound]:
    return Call("fanout_bind", _fanout_keys(k, exchange),
                [queue, _optional(expires_ms), _optional(message_ttl_ms), _optional(stream_expires_ms)],
                lambda reply: FanoutBound(bool(int(reply[0])), int(reply[1]), int(reply[2])))


@operation
def fanout_consume(k: Keyspace, p: Policy, exchange: str, queue: str, consumer: str, *, count: int = 100,
                   stream_expires_ms: int | None = None) -> Call[FanoutBatch]:
    def decode(reply: Sequence[Any]) -> FanoutBatch:
        entries = [(_text(reply[i]), _text(reply[i + 1]), _bytes(reply[i + 2]))
                   for i in range(2, len(reply), 3)]
        return FanoutBatch(_text(reply[0]), entries, int(reply[1]))

    return Call("fanout_consume", _fanout_keys(k, exchange),
                [queue, consumer, count, _optional(stream_expires_ms)], decode)


@operation
def fanout_unbind(k: Keyspace, p: Policy, exchange: str, queue: str) -> Call[bool]:
    return Call("fanout_unbind", _fanout_keys(k, exchange), [queue], bool)


@operation
def fanout_leave(k: Keyspace, p: Policy, exchange: str, queue: str, consumer: str) -> Call[bool]:
    return Call("fanout_leave", [k.fanout(exchange)], [queue, consumer], bool)
