"""A connection's sharded queues (protocol/shards.py names them): which of its declared queues
are sharded, which shard a publish goes to, and the order a consume asks the shards in.
Names and messages only: the kombu channel (kombu/sharding.py) holds one of each.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from . import shards


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


class ShardTurns:
    """The order one channel's consumes ask the shards in: the shard asked first turns at each
    consume, and the queues a consume found empty are asked last for a cycle, so a full take
    rarely spends a call on them and each is still asked in every cycle."""

    def __init__(self) -> None:
        self.turn = 0
        self._empty_at: dict[str, int] = {}  # queue -> the turn a consume found it empty

    def order(self, shard_map: ShardMap, queues: list[str]) -> list[str]:
        self.turn += 1
        turned = shard_map.rotated(queues, self.turn)
        return sorted(turned, key=lambda q: self.turn - self._empty_at.get(q, -len(turned)) <= len(turned))

    def drained(self, groups: list[list[str]], deliveries: list[Any]) -> list[list[str]]:
        """Of a consume across slot ``groups`` (asked in turn until it had enough), those before
        the last that gave anything (all, if none did) came back short: empty now."""
        gave = {delivery.queue for delivery in deliveries}
        last = max((i for i, group in enumerate(groups) if gave.intersection(group)), default=len(groups))
        self._empty_at.update((queue, self.turn) for group in groups[:last] for queue in group)
        return groups[:last]
