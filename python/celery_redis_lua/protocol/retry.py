"""Delayed retry: RabbitMQ 4.3's quorum-queue arguments, stored in the broker by declare.

A requeue of the kind the type names waits ``min(min_ms * delivery_count, max_ms)`` in the
delayed set before it is ready again, so a poison message does not burn its deliveries in
seconds. ``failed``: rejected with requeue, or not acked within the visibility timeout (the
worker died or hung); ``returned``: handed back unstarted (channel close, cancel, warm
shutdown); ``all``: both. The scripts apply it (reject.lua, sweep.lua); this is the checked
value a producer or the transport passes to declare.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .bounds import MAX_DURATION_MS

TYPES = ("disabled", "all", "failed", "returned")
# The queue arguments, as RabbitMQ names them.
TYPE_ARGUMENT = "x-delayed-retry-type"
MIN_ARGUMENT = "x-delayed-retry-min"
MAX_ARGUMENT = "x-delayed-retry-max"
WHAT = f"a positive integer (ms) of at most {MAX_DURATION_MS} (10 years)"


@dataclass(frozen=True)
class DelayedRetry:
    type: str = "disabled"
    min_ms: int | None = None  # the first retry's delay; required unless disabled
    max_ms: int | None = None  # the longest delay; None: no cap

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"{TYPE_ARGUMENT} must be one of {', '.join(TYPES)}, got {self.type!r}")
        for name, value in ((MIN_ARGUMENT, self.min_ms), (MAX_ARGUMENT, self.max_ms)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 < value <= MAX_DURATION_MS):
                raise ValueError(f"{name} must be {WHAT}, got {value!r}")
        if self.enabled and self.min_ms is None:
            raise ValueError(f"{TYPE_ARGUMENT} {self.type!r} needs {MIN_ARGUMENT} (ms)")
        if self.min_ms is not None and self.max_ms is not None and self.max_ms < self.min_ms:
            raise ValueError(f"{MAX_ARGUMENT} {self.max_ms} is below {MIN_ARGUMENT} {self.min_ms}")

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"

    def delay_ms(self, delivery_count: int) -> int:
        """How long a requeue that makes ``delivery_count`` waits (the scripts' formula: never
        longer than the longest duration, so that a high count cannot push the due time out of
        range)."""
        assert self.min_ms is not None, "a disabled delayed retry has no delay"
        return min(self.min_ms * delivery_count, MAX_DURATION_MS if self.max_ms is None else self.max_ms)

    def arguments(self) -> list[str | int]:
        """declare's ARGV 5-7."""
        if not self.enabled:
            return ["disabled", "", ""]
        return [self.type, self.min_ms or "", self.max_ms or ""]

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> DelayedRetry | None:
        """The x-delayed-retry-* of a queue's arguments; None when none is given."""
        given = [arguments.get(name) for name in (TYPE_ARGUMENT, MIN_ARGUMENT, MAX_ARGUMENT)]
        if all(value is None for value in given):
            return None
        kind, low, high = given
        return cls(type="disabled" if kind is None else kind, min_ms=_ms(MIN_ARGUMENT, low),
                   max_ms=_ms(MAX_ARGUMENT, high))


DISABLED = DelayedRetry()


def _ms(name: str, value: Any) -> int | None:
    """A whole number of ms; a float like 1000.0 (kombu converts seconds) is taken as its int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be {WHAT}, got {value!r}")
    return value
