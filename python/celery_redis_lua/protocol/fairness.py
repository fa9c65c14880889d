"""Fair queues: the tenant (fairness key) a message is published for.

Within a priority, the publish script scores a ready message of a fair queue by its key's
start tag, max(V, F[key]), in place of now (start-time fair queueing, docs/operations.md
"Fair queues"): a key that floods the queue runs its tags ahead, one per message, while a
quiet key's message starts at the queue's virtual clock V, which follows what consume takes.
So the keys with something ready take turns, and the consume script is unchanged.

Where a message says so (an envelope, in this order):

- the header ``x-fairness-key``, for any kombu producer;
- the Celery task option ``fairness_key`` (a message property), passed to
  ``apply_async(..., fairness_key="tenant-42")`` or set for a task in ``task_routes``.

A key is a string of 1..256 bytes (publish.lua's limit).
"""

from __future__ import annotations

from typing import Any

MAX_KEY_BYTES = 256  # publish.lua's limit
HEADER = "x-fairness-key"
OPTION = "fairness_key"  # the Celery task option (a message property)


class BadFairnessKey(ValueError):
    """A fairness key that is no string of 1..256 bytes; nothing is published."""


def checked(key: Any, name: str = "fairness key") -> str:
    """``key`` if it is a string of 1..256 bytes, else :class:`BadFairnessKey` naming it."""
    if not isinstance(key, str) or not 0 < len(key.encode()) <= MAX_KEY_BYTES:
        raise BadFairnessKey(f"{name} must be a string of 1..{MAX_KEY_BYTES} bytes, got {key!r}")
    return key


def from_envelope(message: dict[str, Any]) -> str | None:
    """The fairness key of a kombu envelope about to be published (None: it has none)."""
    headers = message.get("headers") or {}
    if headers.get(HEADER) is not None:
        return checked(headers[HEADER], f"header {HEADER!r}")
    option = (message.get("properties") or {}).get(OPTION)
    if option is None:
        return None
    return checked(option, f"the task option {OPTION!r}")
