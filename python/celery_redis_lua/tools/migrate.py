"""``celery-redis-lua migrate --from redis://...``: move the messages waiting in kombu's stock
Redis transport into our queues, exactly once, in their order.

Stock kombu keeps a queue as LPUSHed lists, one per priority step (``Q``, ``Q\\x06\\x163``,
``Q\\x06\\x166``, ``Q\\x06\\x169``; BRPOP takes step 0 first and each list oldest first), and the
messages its workers hold unacked in the ``unacked`` hash (tag -> [payload, exchange,
routing key]). Each message moves in three steps, any of which a crash may interrupt:

1. on the source, RPOPLPUSH (for an unacked one: HDEL and LPUSH in one MULTI) moves it into
   a holding list of our own, ``<prefix>_crl.migrating:<priority>:<queue>``, atomically (the
   list's name says where it goes);
2. on the destination, one MULTI publishes it (the publish script, its task id indexed) and
   records its identity (task id, or a SHA1 of the payload) in ``P migrated:{Q}`` (the
   ``migrated`` script): both or neither;
3. on the source, LREM takes it out of the holding list.

A rerun first finishes what the holding list holds: a message whose identity is recorded is
not published again. So a kill at any point loses nothing and publishes nothing twice; when
the holding list is empty at the end the records are deleted.

Order and priority: stock kombu delivers step 0 first (its priorities are inverted against
AMQP's), ours the highest first; a message in step ``s`` is published with priority
``9 - s``, so the migrated backlog is delivered in the order stock kombu would have.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from ..protocol.envelope import BadEnvelope, publish_arguments
from ..protocol.library import ScriptLibrary

STOCK_SEP = "\x06\x16"
STOCK_STEPS = (0, 3, 6, 9)  # kombu's default priority_steps
HOLDING = "_crl.migrating:"  # + '<priority>:<queue>', on the source; stock never touches it


@dataclass
class MigrationReport:
    moved: dict[str, int] = field(default_factory=dict)  # queue -> messages published
    finished: int = 0  # messages a previous, interrupted run had taken and this one completed
    skipped: list[str] = field(default_factory=list)  # why a message stayed where it was
    planned: dict[str, int] = field(default_factory=dict)  # --dry-run: queue -> messages

    @property
    def total(self) -> int:
        return sum(self.moved.values())


class Migration:
    """Moves stock kombu's messages from ``source`` (a redis-py client of the stock
    database, with stock's ``global_keyprefix`` as ``source_prefix``) into ``lib``."""

    def __init__(self, source: redis.Redis, lib: ScriptLibrary, *, source_prefix: str = "",
                 after_take: Callable[[], None] | None = None) -> None:
        self.source = source
        self.lib = lib
        self.prefix = source_prefix
        self.after_take = after_take or (lambda: None)  # tests stop here to prove a crash
        self.report = MigrationReport()

    def holding(self, queue: str, priority: int) -> str:
        return f"{self.prefix}{HOLDING}{priority}:{queue}"

    def held(self) -> Iterator[tuple[str, str, int]]:
        """(holding list, queue, priority) of every holding list an earlier run left."""
        head = self.prefix + HOLDING
        for key in self.source.scan_iter(match=_glob(head) + "*", count=1000):
            priority, _, queue = key.decode()[len(head):].partition(":")
            yield key.decode(), queue, int(priority)

    # -- what stock kombu has ---------------------------------------------------------------

    def stock_queues(self) -> list[str]:
        """Queues named in stock kombu's binding tables (SETs of rk SEP pattern SEP queue)."""
        names: set[str] = set()
        for key in self.source.scan_iter(match=_glob(self.prefix + "_kombu.binding.") + "*", count=1000):
            if self.source.type(key) != b"set":
                continue
            for member in self.source.smembers(key):
                parts = _text(member).split(STOCK_SEP)
                if len(parts) == 3 and parts[2]:
                    names.add(parts[2])
        return sorted(names)

    def lists_of(self, queue: str) -> Iterator[tuple[int, str]]:
        """(priority step, list key) of ``queue``, step 0 (delivered first) first."""
        for step in STOCK_STEPS:
            key = self.prefix + (queue if step == 0 else f"{queue}{STOCK_SEP}{step}")
            if self.source.type(key) == b"list":
                yield step, key

    def plan(self, queues: list[str]) -> dict[str, int]:
        planned = {q: sum(int(self.source.llen(key)) for _, key in self.lists_of(q)) for q in queues}
        unacked = self.source.hlen(self.prefix + "unacked") if self._unacked_is_hash() else 0
        if unacked:
            planned["(unacked, routed by their routing key)"] = int(unacked)
        return planned

    # -- moving -----------------------------------------------------------------------------

    def run(self, queues: list[str] | None = None, *, dry_run: bool = False) -> MigrationReport:
        names = queues if queues else self.stock_queues()
        if dry_run:
            self.report.planned = self.plan(names)
            return self.report
        self._finish_holding(resumed=True)
        for queue in names:
            for step, key in self.lists_of(queue):
                holding = self.holding(queue, 9 - step)
                while self.source.rpoplpush(key, holding) is not None:
                    self.after_take()
                    self._deliver(holding, queue, 9 - step)
        self._move_unacked()
        if not any(True for _ in self.held()):
            for queue in list(self.report.moved):
                self.lib.migrated(queue, "clear")
        return self.report

    def _finish_holding(self, *, resumed: bool = False) -> None:
        for holding, queue, priority in list(self.held()):
            while self.source.llen(holding):
                self._deliver(holding, queue, priority, resumed=resumed)

    def _deliver(self, holding: str, queue: str, priority: int, *, resumed: bool = False) -> None:
        """Publish the oldest message of ``holding`` unless its identity is recorded, then
        take it out of the holding list."""
        raw = self.source.lindex(holding, -1)
        if raw is None:
            return
        message = json.loads(raw)
        payload = _text(raw)
        identity = _identity(message, payload)
        if self.lib.client.hget(self.lib.keys.migrated(queue), identity) is None:
            try:
                args = publish_arguments(message, None)
            except BadEnvelope as error:
                args = None
                self.report.skipped.append(f"{queue}: {error}; published without ETA or TTL")
            publish = self.lib.calls.publish(queue, payload, priority=priority,
                                             eta_ms=args.eta_ms if args else None,
                                             ttl_ms=args.ttl_ms if args else None,
                                             task_id=args.task_id if args else None)
            # The message and its record in one MULTI: another client sees both or neither.
            published, _ = self.lib.runner.run_transaction(
                [publish, self.lib.calls.migrated(queue, "mark", identity)])
            if isinstance(published, Exception):  # refused (e.g. NOSCRIPT after a failover)
                self.lib.migrated(queue, "forget", identity)
                raise published
            self.report.moved[queue] = self.report.moved.get(queue, 0) + 1
        elif resumed:
            self.report.finished += 1
        self.source.rpop(holding)

    def _unacked_is_hash(self) -> bool:
        return self.source.type(self.prefix + "unacked") == b"hash"

    def _move_unacked(self) -> None:
        """Messages stock workers held unacked: back in line (their workers are stopped)."""
        if not self._unacked_is_hash():
            return
        unacked, index = self.prefix + "unacked", self.prefix + "unacked_index"
        held = self.source.hgetall(unacked)
        delivered = [t for t in self.source.zrange(index, 0, -1) if t in held]  # oldest delivery first
        for tag in [*delivered, *(t for t in held if t not in set(delivered))]:
            raw = held[tag]
            try:
                payload, exchange, routing_key = json.loads(raw)
            except (ValueError, TypeError):
                self.report.skipped.append(f"unacked {_text(tag, 'replace')}: not kombu's "
                                           "[payload, exchange, routing_key]")
                continue
            queue = self._route(exchange, routing_key)
            if queue is None:
                self.report.skipped.append(f"unacked {_text(tag, 'replace')}: no stock binding "
                                           f"of exchange {exchange!r} routes {routing_key!r}")
                continue
            holding = self.holding(queue, _stock_priority(payload))
            pipe = self.source.pipeline(transaction=True)
            pipe.lpush(holding, json.dumps(payload))
            pipe.hdel(unacked, tag)
            pipe.zrem(index, tag)
            pipe.execute()
            self.after_take()
            self._deliver(holding, queue, _stock_priority(payload))

    def _route(self, exchange: str, routing_key: str) -> str | None:
        if not exchange:
            return routing_key or None
        for member in self.source.smembers(self.prefix + f"_kombu.binding.{exchange}"):
            rk, _, queue = _text(member).split(STOCK_SEP)
            if rk == routing_key:
                return queue
        return None


def _stock_priority(message: dict[str, Any]) -> int:
    """The priority our queue gets for a message in stock's step of its priority."""
    try:
        priority = max(0, min(9, int((message.get("properties") or {}).get("priority") or 0)))
    except (TypeError, ValueError):
        priority = 0
    step = max(s for s in STOCK_STEPS if s <= priority)
    return 9 - step


def _identity(message: dict[str, Any], payload: str) -> str:
    task_id = (message.get("headers") or {}).get("id")
    if isinstance(task_id, str) and task_id:
        return f"task:{task_id}"
    return "sha1:" + hashlib.sha1(payload.encode()).hexdigest()


def _glob(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def _text(value: bytes | str, errors: str = "strict") -> str:
    """A reply of the source client (bytes: it does not decode responses) as text."""
    return value.decode(errors=errors) if isinstance(value, bytes) else value
