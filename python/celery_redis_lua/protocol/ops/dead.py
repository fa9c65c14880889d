"""A queue's dead letters (the stream of what the delivery limit or a TTL took out): list
them, replay them into the queue, purge them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..call import Call
from ..keys import Keyspace
from ..policy import Policy
from .base import as_bytes, operation, text


@dataclass(frozen=True)
class DeadLetter:
    entry_id: str
    id: str
    reason: str
    delivery_count: int
    priority: int
    payload: bytes


def _dead_letter(entry: Sequence[Any]) -> DeadLetter:
    raw = entry[1]
    fields = {text(raw[i]): raw[i + 1] for i in range(0, len(raw), 2)}
    return DeadLetter(
        text(entry[0]), text(fields.get("id", "")), text(fields.get("reason", "")),
        int(fields.get("delivery_count", 0)), int(fields.get("priority", 0)),
        as_bytes(fields.get("payload", b"")),
    )


@operation
def dead_list(k: Keyspace, p: Policy, queue: str, *, count: int = 100,
              after: str | None = None) -> Call[list[DeadLetter]]:
    return Call("dead_list", [k.dead(queue)], [count, after or ""],
                lambda reply: [_dead_letter(e) for e in reply])


@operation
def dead_replay(k: Keyspace, p: Policy, queue: str, *, count: int = 100,
                entry_ids: Sequence[str] = (),
                payloads: Mapping[str, bytes | str] | None = None) -> Call[list[str]]:
    """The oldest ``count`` dead letters, or the ``entry_ids`` named, back as fresh messages;
    with ``payloads`` (entry id -> payload), those entries, each with the payload given."""
    if payloads is not None:
        pairs = [value for entry in payloads.items() for value in entry]
        return Call("dead_replay", k.queue_keys(queue), ["given", count, *pairs],
                    lambda reply: [text(i) for i in reply])
    return Call("dead_replay", k.queue_keys(queue), ["stored", count, *entry_ids],
                lambda reply: [text(i) for i in reply])


@operation
def dead_purge(k: Keyspace, p: Policy, queue: str) -> Call[int]:
    return Call("dead_purge", [k.dead(queue)], [], int)
