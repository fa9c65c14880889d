"""Sharded queues: one logical queue spread over N queues in N cluster slots (``x-shards``).

Shard ``i`` of ``N`` of the logical queue ``Q`` is the queue named ``Q~i/N.S``: an ordinary
queue (its keys are built by keys.py like any other's), whose hash tag therefore differs from
``Q``'s and from its siblings'. The salt ``S`` is the smallest number that puts the shard's
slot in the ``i``-th of ``N`` equal ranges of the 16,384 slots, so that on a cluster whose
primaries hold equal contiguous ranges (what ``redis-cli --cluster create`` and Valkey make)
N shards over N primaries land one on each. The names depend only on ``Q`` and ``N``: every
producer, consumer and tool derives the same ones, and a tool finds a logical queue's shards
by their names alone (:func:`shard_of`), without any record of its own.

The logical queue ``Q`` itself is declared too, and consumed with its shards: what a producer
that did not declare the queue sharded publishes to ``Q`` is delivered all the same.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from .keys import Keyspace

SLOTS = 16384
MAX_SHARDS = 64
ARGUMENT = "x-shards"
KEY_HEADER = "x-shard-key"  # a message header (or property) that picks the shard by crc32

_SHARD_NAME = re.compile(r"^(?P<queue>.+)~(?P<index>\d+)/(?P<count>\d+)\.(?P<salt>\d+)$", re.DOTALL)
_SLOTS_OF = Keyspace()  # slots depend on the hash tag only, not on any prefix


@dataclass(frozen=True)
class ShardOf:
    """What a shard's name says: its logical queue, its index and the shard count."""

    queue: str
    index: int
    count: int


def shard_count(queue: str, arguments: dict[str, Any] | None) -> int:
    """The ``x-shards`` argument of ``queue``'s declare: 1 (not sharded) when absent; an
    int in 1..MAX_SHARDS, or a ValueError naming it."""
    value = (arguments or {}).get(ARGUMENT)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SHARDS:
        raise ValueError(f"queue {queue!r}: argument {ARGUMENT!r} must be an integer in "
                         f"1..{MAX_SHARDS}, got {value!r}")
    if shard_of(queue) is not None:
        raise ValueError(f"queue {queue!r}: argument {ARGUMENT!r}: the queue is itself a shard")
    return value


@functools.lru_cache(maxsize=4096)
def salt(queue: str, index: int, count: int) -> int:
    """The smallest salt that puts shard ``index`` of ``count`` in its range of slots."""
    low, high = index * SLOTS // count, (index + 1) * SLOTS // count
    candidate = 0
    while not low <= _SLOTS_OF.slot(f"{queue}~{index}/{count}.{candidate}") < high:
        candidate += 1
    return candidate


def shard_name(queue: str, index: int, count: int) -> str:
    return f"{queue}~{index}/{count}.{salt(queue, index, count)}"


@functools.lru_cache(maxsize=1024)
def shard_names(queue: str, count: int) -> tuple[str, ...]:
    """The ``count`` shards of ``queue`` (none when ``count`` is 1: it is not sharded)."""
    if count <= 1:
        return ()
    return tuple(shard_name(queue, index, count) for index in range(count))


def members(queue: str, count: int) -> list[str]:
    """Every queue that holds the logical ``queue``'s messages: itself, then its shards."""
    return [queue, *shard_names(queue, count)]


def shard_of(name: str) -> ShardOf | None:
    """The logical queue, index and count a shard's name says, or None for a name that is
    no shard's (its salt is checked too)."""
    match = _SHARD_NAME.match(name)
    if match is None:
        return None
    queue, index, count = match["queue"], int(match["index"]), int(match["count"])
    if not 0 <= index < count <= MAX_SHARDS or count < 2 or match["salt"] != str(salt(queue, index, count)):
        return None
    return ShardOf(queue, index, count)


def group_shards(queues: list[str]) -> dict[str, list[str]]:
    """``queues`` (e.g. every declared queue) by logical queue: each logical queue's shards
    (in index order) under its name; a queue that is no shard under its own name, alone."""
    logical: dict[str, list[tuple[int, str]]] = {}
    for name in queues:
        of = shard_of(name)
        if of is None:
            logical.setdefault(name, [])
        else:
            logical.setdefault(of.queue, []).append((of.index, name))
    return {queue: [name for _, name in sorted(shards)] for queue, shards in logical.items()}


def split(total: int, count: int) -> list[int]:
    """An integer limit over ``count`` shards: each gets ``total // count``, the first
    ``total % count`` one more, so the shares add up to ``total`` (a share may be 0)."""
    return [total // count + (1 if index < total % count else 0) for index in range(count)]


__all__ = ["ARGUMENT", "KEY_HEADER", "MAX_SHARDS", "ShardOf", "group_shards", "members", "salt",
           "shard_count", "shard_name", "shard_names", "shard_of", "split"]
