"""A script call and what its reply becomes: :class:`Call` (ready to run alone or in a
pipeline), and the mapping of our scripts' error replies to :class:`ScriptError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from redis.exceptions import ResponseError

from .fence import refusal

ERROR_PREFIX = "celery-redis-lua:"
T = TypeVar("T")


class ScriptError(ResponseError):
    """A script refused its input (``ERR celery-redis-lua: <script>: <problem>``)."""

    def __init__(self, script: str, message: str) -> None:
        super().__init__(message)
        self.script = script


def _as_is(reply: Any) -> Any:
    return reply


@dataclass(frozen=True)
class Call(Generic[T]):
    """One script invocation, ready to run alone or in a pipeline; ``decode`` turns the
    server's reply into ``T``."""

    script: str
    keys: Sequence[str]
    args: Sequence[str | int | bytes]
    decode: Callable[[Any], T] = field(default=_as_is)


def to_script_error(script: str, error: ResponseError) -> ResponseError:
    """Turn our scripts' error replies into :class:`ScriptError`, a fenced primary's into
    :class:`~.fence.NoReplicasError`; leave others alone."""
    error = refusal(error)
    message = str(error)
    if message.startswith("ERR "):
        message = message[4:]
    if message.startswith(ERROR_PREFIX):
        return ScriptError(script, message.split(" script: ")[0])
    return error


def decode_replies(calls: Sequence[Call[Any]], replies: list[Any], raise_on_error: bool) -> list[Any]:
    """The results of ``calls`` from their ``replies``: each decoded, an error reply as
    :class:`ScriptError` when it is one of our scripts'. ``raise_on_error``: raise the first
    error; else it stands in place of that call's result."""
    results: list[Any] = []
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, ResponseError):
            error = to_script_error(call.script, reply)
            if raise_on_error:
                raise error
            results.append(error)
        elif isinstance(reply, Exception):
            if raise_on_error:
                raise reply
            results.append(reply)
        elif raise_on_error:
            results.append(call.decode(reply))
        else:  # a reply its decode refuses (publish's stale route) is that call's error
            try:
                results.append(call.decode(reply))
            except Exception as error:
                results.append(error)
    return results
