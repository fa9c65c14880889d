"""Flow control of a queue for all its consumers together: pause and resume it, limit what
is in flight and the rate of deliveries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..call import Call
from ..keys import Keyspace
from ..policy import Policy
from .base import operation, text


@dataclass(frozen=True)
class Limits:
    """A queue's limits for all its consumers together (lua/limit.lua): most messages in
    flight, and a rate as the script stores it ('20/s', '100/m', '5/h'); None: unset."""

    in_flight: int | None = None
    rate: str | None = None

    @property
    def rate_per_second(self) -> float | None:
        if self.rate is None:
            return None
        count, _, unit = self.rate.partition("/")
        return int(count) / RATE_PERIOD_SECONDS[unit]

    def __str__(self) -> str:
        """'8 in flight, 20/s', '20/s', or '-' when there is none."""
        parts = ([] if self.in_flight is None else [f"{self.in_flight} in flight"]) + \
            ([] if self.rate is None else [self.rate])
        return ", ".join(parts) or "-"


RATE_PERIOD_SECONDS = {"s": 1, "m": 60, "h": 3600}


def limits_of(in_flight: Any, rate: Any) -> Limits:
    """The script's pair (in_flight, rate), '' for unset."""
    return Limits(int(in_flight) if text(in_flight) else None, text(rate) or None)


@operation
def pause(k: Keyspace, p: Policy, queue: str, reason: str = "") -> Call[bool]:
    """Pause ``queue`` (it takes publishes and delivers nothing); True unless it was paused."""
    return Call("pause", k.queue_keys(queue), [reason], bool)


@operation
def resume(k: Keyspace, p: Policy, queue: str) -> Call[bool]:
    """Resume ``queue`` and wake a blocked consumer; True if it was paused."""
    return Call("resume", k.queue_keys(queue), [], bool)


@operation
def limit(k: Keyspace, p: Policy, queue: str, *, in_flight: int | str | None = None,
          rate: str | None = None, clear_in_flight: bool = False, clear_rate: bool = False) -> Call[Limits]:
    """Set (``in_flight``, ``rate`` as 'N/s', 'N/m' or 'N/h') or clear a limit of ``queue``
    for all its consumers together; None leaves it as it is. Returns the limits in force.
    The script judges the values (and refuses a queue that does not exist, naming it), so
    ``in_flight`` may be the text an operator typed."""
    if (in_flight is not None and clear_in_flight) or (rate is not None and clear_rate):
        raise ValueError("celery-redis-lua: limit: set a limit or clear it, not both")
    args = ["clear" if clear_in_flight else "" if in_flight is None else str(in_flight),
            "clear" if clear_rate else "" if rate is None else str(rate)]
    return Call("limit", k.queue_keys(queue), args, lambda reply: limits_of(*reply))
