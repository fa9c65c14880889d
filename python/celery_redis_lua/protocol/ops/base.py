"""What every operation shares: the registry the library binds from, and the marshalling of
arguments and replies (redis-py hands back bytes; the scripts take text and numbers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..call import Call
from ..keys import Keyspace

Payload = str | bytes
Operation = Callable[..., Call[Any]]
OPERATIONS: dict[str, Operation] = {}
F = TypeVar("F", bound=Operation)


def operation(function: F) -> F:
    """Register ``function`` as the definition of the script of the same name."""
    OPERATIONS[function.__name__] = function
    return function


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def optional_arg(value: int | None) -> str | int:
    """``None`` travels as the empty string, which the scripts read as "not set"."""
    return "" if value is None else value


def int_or_none(value: Any) -> int | None:
    """A number the script replies with, -1 (any negative) standing for "none"."""
    number = int(value)
    return None if number < 0 else number


def keys_of(k: Keyspace, queues: Sequence[str]) -> list[str]:
    return [key for queue in queues for key in k.queue_keys(queue)]
