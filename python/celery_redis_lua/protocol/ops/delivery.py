"""The delivery path of a queue: publish a message, consume it, settle it (ack, reject,
extend), and the sweep that hands back what nobody settled in time."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..call import Call
from ..dedup import Dedup
from ..fairness import checked
from ..keys import Keyspace
from ..policy import Policy
from .base import Payload, as_bytes, keys_of, operation, optional_arg, text
from .exchanges import StaleRoute

logger = logging.getLogger(__name__)

# -- what the scripts reply ---------------------------------------------------------------

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


class Published(str):
    """The id of the message that holds the place (a str, as the reply's id): the one just
    stored, or, ``deduplicated``, the one holding the dedup id (nothing was stored);
    ``replaced``: the waiting message a debounce took the place of (gone)."""

    deduplicated: bool
    replaced: str | None

    def __new__(cls, message_id: str, *, deduplicated: bool = False,
                replaced: str | None = None) -> Published:
        self = super().__new__(cls, message_id)
        self.deduplicated, self.replaced = deduplicated, replaced
        return self


class Acked(int):
    """How many messages an ack deleted (an int, as the reply's first item), and ``stale``:
    the ids it left alone because another consumer holds them now (fenced by a count)."""

    stale: tuple[str, ...]

    def __new__(cls, acked: int, stale: Iterable[str] = ()) -> Acked:
        self = super().__new__(cls, acked)
        self.stale = tuple(stale)
        return self


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
    revoked: int = 0  # timed-out deliveries Celery's revoke() named: dead-lettered, not put back

    def __add__(self, other: SweepReport) -> SweepReport:
        return SweepReport(
            self.promoted + other.promoted, self.requeued + other.requeued,
            self.unclaimed + other.unclaimed, self.backlog + other.backlog,
            self.limit_reached + other.limit_reached, self.expired + other.expired,
            self.orphans + other.orphans, other.more, self.dropped_messages + other.dropped_messages,
            self.revoked + other.revoked,
        )


EMPTY_SWEEP = SweepReport(0, 0, 0, 0, 0, 0, 0, False, [])


def _deliveries(queues: Sequence[str], flat: Sequence[Any]) -> list[Delivery]:
    """The 4-items-per-message tail of a consume reply."""
    return [Delivery(queues[int(flat[i]) - 1], text(flat[i + 1]), int(flat[i + 2]), as_bytes(flat[i + 3]))
            for i in range(0, len(flat), 4)]


def _consumed(queues: Sequence[str], reply: Sequence[Any]) -> Consumed:
    wake, flat = int(reply[0]), reply[2:]
    rate = int(flat[-1]) if len(flat) % 4 else None  # a last item past the messages: rate_in_ms
    return Consumed(_deliveries(queues, flat[:len(flat) - len(flat) % 4]), None if wake < 0 else wake,
                    int(reply[1]), rate)


# -- the scripts --------------------------------------------------------------------------

@dataclass(frozen=True)
class Outgoing:
    """One message of :func:`publish_many`: what :func:`publish` takes besides the queue."""

    payload: Payload
    priority: int | str = 0
    eta_ms: int | None = None
    ttl_ms: int | None = None
    task_id: str | None = None
    route: tuple[str, int] | None = None
    dedup: Dedup | None = None
    fairness_key: str | None = None

    def __post_init__(self) -> None:
        # Checked here, once: a bad key is its publisher's error where it builds the message,
        # before a group commit (protocol/group.py) puts it in a batch with others'.
        if self.fairness_key is not None:
            checked(self.fairness_key)

    def arguments(self, p: Policy, *, full: bool = False) -> list[Any]:
        """publish.lua's ARGV for this message: as few as it needs (5-12), or all 12 (``full``:
        the layout each message of a batch has, '' for what it does not use)."""
        args = [self.payload, self.priority, optional_arg(self.eta_ms), optional_arg(self.ttl_ms),
                p.visibility_ms, self.task_id or ""]
        dedup, key, route = self.dedup, self.fairness_key, self.route
        if not full and route is None and dedup is None and key is None:
            return args
        args += [route[0], route[1]] if route is not None else ["", ""]
        if not full and key is None:
            return [*args, dedup.id, dedup.mode, optional_arg(dedup.ttl_ms)] if dedup is not None else args
        args += [dedup.id, dedup.mode, optional_arg(dedup.ttl_ms)] if dedup is not None else ["", "", ""]
        return [*args, "" if key is None else key]

    def call(self, k: Keyspace, p: Policy, queue: str) -> Call[Published]:
        """The publish of this message alone (:func:`publish`)."""
        return Call("publish", k.queue_keys(queue), self.arguments(p),
                    lambda reply: self.decode(queue, reply))

    def decode(self, queue: str, reply: Any) -> Published:
        """The reply to this message: its id, or the message that kept its place (logged at
        INFO); :class:`StaleRoute` when its cached route was refused."""
        if not isinstance(reply, list):
            return Published(text(reply))
        if text(reply[0]) == "stale-route":  # ['stale-route', changed_ms or -1]
            changed = int(reply[1])
            raise StaleRoute(queue, None if changed < 0 else changed)
        dedup = self.dedup
        assert dedup is not None, reply
        if text(reply[0]) == "replaced":  # ['replaced', new id, replaced id]
            published = Published(text(reply[1]), replaced=text(reply[2]))
            logger.info("celery-redis-lua: queue %r: message %s replaces message %s, which held dedup id %r "
                        "(debounce)", queue, published, published.replaced, dedup.id)
            return published
        kept = Published(text(reply[1]), deduplicated=True)  # ['deduplicated', holder id]
        logger.info("celery-redis-lua: queue %r: a publish of dedup id %r was dropped (%s): message %s "
                    "holds it", queue, dedup.id, dedup.mode, kept)
        return kept


@operation
def publish(k: Keyspace, p: Policy, queue: str, payload: Payload, *, priority: int | str = 0,
            eta_ms: int | None = None, ttl_ms: int | None = None, task_id: str | None = None,
            route: tuple[str, int] | None = None, dedup: Dedup | None = None,
            fairness_key: str | None = None) -> Call[Published]:
    """Store a message; ``eta_ms`` is an absolute unix time in ms (server clock); ``task_id``
    (the Celery task id) is indexed so that :func:`locate` and :func:`cancel` find it.
    ``route`` is (exchange, looked_up_ms) of a cached route: the call raises
    :class:`StaleRoute`, writing nothing, when the queue's bindings changed since.
    ``dedup``: a second message of its id is dropped or replaces the first (protocol/dedup.py);
    the reply says which message kept the place (:class:`Published`), logged at INFO.
    ``fairness_key``: the tenant; the queue becomes fair (protocol/fairness.py)."""
    return Outgoing(payload, priority, eta_ms, ttl_ms, task_id, route, dedup, fairness_key).call(k, p, queue)


# What one publish call takes at most (publish.lua's MAX_BATCH is 1,000): 12 arguments each and
# the 8 keys stay under 3,999 arguments, ElastiCache Serverless's limit per request.
MAX_BATCH = 330


def publish_many(k: Keyspace, p: Policy, queue: str,
                 messages: Sequence[Outgoing]) -> Call[list[Published | StaleRoute]]:
    """Store ``messages`` in ``queue`` in one call of the publish script (a batch: as many
    publishes in a row would, at one server time): for each, in order, what :func:`publish`
    would return, or the :class:`StaleRoute` it would raise. A bad message refuses the whole
    call (the error names it), so a caller batching others' messages checks them first."""
    batch = list(messages)
    if not 0 < len(batch) <= MAX_BATCH:
        raise ValueError(f"publish_many: 1..{MAX_BATCH} messages per call, got {len(batch)}")

    def outcome(message: Outgoing, reply: Any) -> Published | StaleRoute:
        try:
            return message.decode(queue, reply)
        except StaleRoute as refused:
            return refused

    if len(batch) == 1:  # one message: the reply is its own, not a list of one
        single = batch[0].call(k, p, queue)
        return Call("publish", single.keys, single.args, lambda reply: [outcome(batch[0], reply)])
    args = [arg for message in batch for arg in message.arguments(p, full=True)]
    return Call("publish", k.queue_keys(queue), args,
                lambda replies: [outcome(m, r) for m, r in zip(batch, replies, strict=True)])


@operation
def consume(k: Keyspace, p: Policy, queues: Sequence[str], count: int = 1, *,
            no_ack: bool = False) -> Call[Consumed]:
    """Deliver up to ``count`` messages across ``queues`` (which must share a cluster slot;
    :meth:`ScriptLibrary.consume` groups them)."""
    names = list(queues)
    return Call("consume", keys_of(k, names), [count, p.visibility_ms, int(no_ack), p.dead_letter_maxlen],
                lambda reply: _consumed(names, reply))


@operation
def unpop(k: Keyspace, p: Policy, queue: str) -> Call[int]:
    """Give back the wake token a blocked consumer's BLPOP took from ``queue`` when it stops
    before it consumes (1: it went back; 0: nothing is queued, or a token already waits)."""
    return Call("unpop", k.queue_keys(queue), [], int)


@operation
def ack(k: Keyspace, p: Policy, queue: str, ids: Sequence[str], *,
        counts: Sequence[int | None] | None = None) -> Call[Acked]:
    """With ``counts`` (the x-delivery-count each was delivered with), an ack of a message
    delivered again since, to a consumer that holds it now, is left alone (``Acked.stale``)."""
    return Call("ack", k.queue_keys(queue), fenced(ids, counts),
                lambda reply: Acked(int(reply[0]), (text(i) for i in reply[1:])))


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
def extend(k: Keyspace, p: Policy, queue: str, ids: Sequence[str] = (), *,
           visibility_ms: int | None = None) -> Call[int]:
    """New deadlines ``visibility_ms`` (the policy's visibility timeout) from now."""
    return Call("extend", k.queue_keys(queue), [visibility_ms or p.visibility_ms, *ids], int)


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
        promoted, requeued, unclaimed, backlog, limit_reached, expired, orphans, more, revoked = (
            int(n) for n in reply[:9])
        tail = reply[9:]
        dropped = [Dropped(names[int(tail[i]) - 1], text(tail[i + 1]), int(tail[i + 2]),
                           text(tail[i + 3]), as_bytes(tail[i + 4])) for i in range(0, len(tail), 5)]
        return SweepReport(promoted, requeued, unclaimed, backlog, limit_reached, expired, orphans,
                           more=bool(more), dropped_messages=dropped, revoked=revoked)

    return Call("sweep", keys_of(k, names),
                [p.visibility_ms, p.delivery_limit or 0, p.dead_letter_maxlen, batch, report_limit], decode)
