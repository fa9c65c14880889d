"""kombu glue for sharded queues (``x-shards``, protocol/shards.py): which declared queues are
sharded, which shard a publish goes to, and the order a consume asks the shards in.

A connection knows a queue is sharded from its declare (kombu declares a consumer's queues,
Celery a producer's); the logical queue is declared as well and consumed with its shards,
so a producer that published to it unsharded is still served.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import redis

from ..protocol import shards


class ShardMap:
    """The sharded queues one connection declared: logical queue -> its shards, and back."""

    def __init__(self) -> None:
        self.by_queue: dict[str, tuple[str, ...]] = {}
        self.logical: dict[str, str] = {}  # shard -> its logical queue

    def declare(self, queue: str, count: int) -> tuple[str, ...]:
        """Record ``queue`` with ``count`` shards (1: not sharded); returns its shards."""
        self.forget(queue)
        names = shards.shard_names(queue, count)
        if names:
            self.by_queue[queue] = names
            self.logical.update(dict.fromkeys(names, queue))
        return names

    def forget(self, queue: str) -> None:
        for name in self.by_queue.pop(queue, ()):
            self.logical.pop(name, None)

    def members(self, queue: str) -> list[str]:
        """The queues holding ``queue``'s messages: itself, then its shards if sharded."""
        return [queue, *self.by_queue.get(queue, ())]

    def logical_of(self, queue: str) -> str:
        return self.logical.get(queue, queue)

    def rotated(self, queues: Sequence[str], turn: int) -> list[str]:
        """``queues`` with each sharded queue's shards (where it first appears) rotated by
        ``turn``, then the logical queue itself: the shard asked first changes every consume,
        so none starves when a batch fills from the first ones, and a message waits at most
        one batch of each other shard (the order given up is bounded)."""
        out: list[str] = []
        seen: set[str] = set()
        for queue in queues:
            logical = self.logical_of(queue)
            if logical not in self.by_queue:
                out.append(queue)
            elif logical not in seen:
                seen.add(logical)
                present = [q for q in self.by_queue[logical] if q in queues]
                start = turn % len(present) if present else 0
                out += present[start:] + present[:start]
                if logical in queues:  # last: it holds only what unaware producers sent
                    out.append(logical)
        return out


class ShardPicker:
    """Which shard a channel publishes the next message of a sharded queue to: by the crc32
    of its ``x-shard-key`` header (or property) when it has one, else round-robin."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, names: tuple[str, ...], queue: str, message: dict[str, Any]) -> str:
        key = message.get("headers", {}).get(shards.KEY_HEADER)
        if key is None:
            key = message.get("properties", {}).get(shards.KEY_HEADER)
        if key is not None:
            data = key if isinstance(key, bytes) else str(key).encode()
            return names[zlib.crc32(data) % len(names)]
        turn = self._next.get(queue, 0)
        self._next[queue] = turn + 1
        return names[turn % len(names)]


class ShardingMixin:
    """Mixed into :class:`~celery_redis_lua.kombu.channel.Channel`: a logical queue's
    publish, size, purge and delete over its shards."""

    connection: Any
    lib: Any
    settle_unconfirmed: Any
    _forget_queue: Any

    def init_sharding(self) -> None:
        self.shard_picker = ShardPicker()
        self._shard_turn = 0  # rotates the shards a consume asks first
        self.drained: list[list[str]] = []
        self._empty_at: dict[str, int] = {}  # queue -> the turn a consume found it empty

    def shard_to_publish_to(self, queue: str, message: dict[str, Any]) -> str:
        """The shard that takes a message to ``queue`` (``queue`` itself if not sharded)."""
        connection = self.connection
        if connection is None:  # closed (kombu's close drops it): not an AttributeError
            raise redis.ConnectionError("celery-redis-lua: cannot publish on a closed channel")
        names = connection.shards.by_queue.get(queue)
        return self.shard_picker.pick(names, queue, message) if names else queue

    def stored_in(self, queue: str, stored: set[str]) -> bool:
        """Whether ``queue`` (a shard of it, if sharded: an unconfirmed publish records
        the shard) is among the queues that stored a message."""
        return any(member in stored for member in self.connection.shards.members(queue))

    def turn_shards(self, queues: list[str]) -> list[str]:
        """A consume's queues, each sharded queue's shards turned: the first asked changes
        each time, so on a cluster a batch that fills from the first slots asked never
        starves the others."""
        self._shard_turn += 1
        shard_map: ShardMap = self.connection.shards
        turned = shard_map.rotated(queues, self._shard_turn)
        # Found empty within the last len(queues) consumes: asked last (stable sort), so a
        # full take rarely spends a call on them, and each is still asked in every cycle.
        return sorted(turned, key=lambda q: self._shard_turn - self._empty_at.get(q, -len(turned))
                      <= len(turned))

    def note_drained(self, queues: list[str], deliveries: list[Any]) -> None:
        """Of a consume across slot groups (asked in turn until it had enough), those before
        the last that gave anything (all, if none did) came back short: empty now. They wait
        on their wake lists though the take was full (when the window has room), and are
        asked last for a while, instead of costing a call each next round."""
        groups = self.lib.slot_groups(queues)
        gave = {delivery.queue for delivery in deliveries}
        last = max((i for i, group in enumerate(groups) if gave.intersection(group)), default=len(groups))
        self.drained += groups[:last]
        self._empty_at.update((queue, self._shard_turn) for group in groups[:last] for queue in group)

    def members_turned(self, queue: str) -> list[str]:
        """``queue``'s members, the first shard asked turning at each call."""
        return self.turn_shards(self.connection.shards.members(queue))

    def refuse_sharded_fanout(self, queue: str, exchange: str) -> None:
        if queue in self.connection.shards.by_queue:
            raise ValueError(f"queue {queue!r}: argument 'x-shards' is for queues bound to a "
                             f"direct or topic exchange, not to fanout exchange {exchange!r}")

    def forget_logical(self, queue: str) -> None:
        """Delete ``queue``'s keys and its shards'."""
        for member in self.connection.shards.members(queue):
            self._forget_queue(member)
        self.connection.shards.forget(queue)

    def _size(self, queue: str) -> int:
        self.settle_unconfirmed()  # what this channel published counts (protocol/unconfirmed.py)
        return sum(self.lib.size(member) for member in self.connection.shards.members(queue))

    def _purge(self, queue: str) -> int:
        self.settle_unconfirmed()  # what this channel published counts (protocol/unconfirmed.py)
        return sum(self.lib.purge(member) for member in self.connection.shards.members(queue))
