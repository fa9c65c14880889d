"""RabbitMQ's numeric queue arguments (x-expires, x-message-ttl, x-max-priority), checked
before a declare so a bad one names itself."""

from __future__ import annotations

from typing import Any

from ..protocol.bounds import MAX_DURATION_MS

MAX_PRIORITY = 255  # the channel's max_priority

# The largest value of each numeric RabbitMQ queue argument (x-delayed-retry-* are
# DelayedRetry's): a duration at most the longest the scripts take (protocol/bounds.py).
ARGUMENT_BOUNDS = {"x-expires": (MAX_DURATION_MS, "ms"), "x-message-ttl": (MAX_DURATION_MS, "ms"),
                   "x-max-priority": (MAX_PRIORITY, ""), "x-consumer-timeout": (MAX_DURATION_MS, "ms")}


def ms_argument(queue: str, arguments: dict[str, Any], name: str) -> int | None:
    """A RabbitMQ queue argument (ms, or a priority), checked so a bad one names itself (its
    own name and unit, before the script would name its ARGV)."""
    value = arguments.get(name)
    if value is None:
        return None
    high, unit = ARGUMENT_BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
        what = f"a number of {unit}" if unit else "a number"
        raise ValueError(f"queue {queue!r}: argument {name!r} must be {what} in 0..{high}, got {value!r}")
    return int(value)
