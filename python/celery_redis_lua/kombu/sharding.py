"""kombu glue for sharded queues (``x-shards``, protocol/shards.py): which declared queues are
sharded, which shard a publish goes to, and the order a consume asks the shards in.

A connection knows a queue is sharded from its declare (kombu declares a consumer's queues,
Celery a producer's); the logical queue is declared as well and consumed with its shards,
so a producer that published to it unsharded is still served.
"""

from __future__ import annotations

from typing import Any

import redis

from ..protocol.shardmap import ShardMap, ShardPicker, ShardTurns


class ShardingMixin:
    """Mixed into :class:`~celery_redis_lua.kombu.channel.Channel`: a logical queue's
    publish, size, purge and delete over its shards."""

    connection: Any
    lib: Any
    settle_unconfirmed: Any
    _forget_queue: Any

    def init_sharding(self) -> None:
        self.shard_picker, self.shard_turns = ShardPicker(), ShardTurns()
        self.drained: list[list[str]] = []

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
        """A consume's queues in the order to ask them (protocol/shardmap.py's ShardTurns)."""
        shard_map: ShardMap = self.connection.shards
        return self.shard_turns.order(shard_map, queues)

    def note_drained(self, queues: list[str], deliveries: list[Any]) -> None:
        """The slot groups of a consume that came back short wait on their wake lists though
        the take was full (when the window has room), and are asked last for a while."""
        self.drained += self.shard_turns.drained(self.lib.slot_groups(queues), deliveries)

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
