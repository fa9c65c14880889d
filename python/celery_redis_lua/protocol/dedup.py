"""Deduplication at publish: which dedup id a message carries, in which mode, for how long.

The publish script holds the id for its queue (``dedup:<sha1 of the id>`` in the state hash)
and drops, or replaces, a second message of it:

- ``simple``: dropped while the first (the holder) waits or runs, until it is acked,
  dead-lettered, cancelled or purged (or ``ttl_ms`` after it, when given);
- ``throttle``: dropped for ``ttl_ms`` after the first, whatever became of it;
- ``debounce``: the newest replaces the holder while it waits (ready, delayed, or waiting
  for a retry), so only the last of a burst runs; once the holder runs, the next one is
  stored and holds.

Where a message says so (an envelope, in this order):

- the headers ``x-dedup-id`` (the id), ``x-dedup-key`` (``task_id`` or ``args``: the id
  built from the message), ``x-dedup-mode`` and ``x-dedup-ttl`` (ms), for any kombu
  producer;
- the Celery task option ``dedup`` (a message property): a mode (``"simple"``...) or a dict
  ``{"mode", "id" or "key", "ttl"}`` with ``ttl`` in seconds, as Celery's own options are,
  passed to ``apply_async(..., dedup=...)`` or set for a task in ``task_routes``.

Without an id or a key, the key is ``args``: the task name and its arguments, as celery-once
builds its lock (``task_id`` dedups a task id the caller chose, ``apply_async(task_id=...)``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .bounds import MAX_DURATION_MS

MODES = ("simple", "throttle", "debounce")
KEYS = ("task_id", "args")
MAX_ID_BYTES = 512  # publish.lua's limit
HEADERS = ("x-dedup-id", "x-dedup-key", "x-dedup-mode", "x-dedup-ttl")
OPTION = "dedup"  # the Celery task option (a message property)


class BadDedup(ValueError):
    """A dedup setting out of range; the message names it and nothing is published."""


@dataclass(frozen=True)
class Dedup:
    """A publish's dedup id, its mode and how long a hold lasts at most (``None``: until the
    holder goes; required for ``throttle``)."""

    id: str
    mode: str = "simple"
    ttl_ms: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not 0 < len(self.id.encode()) <= MAX_ID_BYTES:
            raise BadDedup(f"dedup id must be a string of 1..{MAX_ID_BYTES} bytes, got {self.id!r}")
        if self.mode not in MODES:
            raise BadDedup(f"dedup mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.ttl_ms is not None and (isinstance(self.ttl_ms, bool) or not isinstance(self.ttl_ms, int)
                                        or not 0 < self.ttl_ms <= MAX_DURATION_MS):
            raise BadDedup(f"dedup ttl must be 1..{MAX_DURATION_MS} ms (10 years), got {self.ttl_ms!r}")
        if self.mode == "throttle" and self.ttl_ms is None:
            raise BadDedup("dedup mode 'throttle' needs a ttl (how long after the first the others "
                           "are dropped)")


def from_envelope(message: dict[str, Any]) -> Dedup | None:
    """The dedup of a kombu envelope about to be published (None: it has none)."""
    headers = message.get("headers") or {}
    if any(headers.get(name) is not None for name in HEADERS):
        return _settings(message, headers.get("x-dedup-id"), headers.get("x-dedup-key"),
                         headers.get("x-dedup-mode"), _ms(headers.get("x-dedup-ttl"), "x-dedup-ttl"))
    option = (message.get("properties") or {}).get(OPTION)
    if option is None or option is False:
        return None
    if option is True or isinstance(option, str):
        option = {"mode": "simple" if option is True else option}
    if not isinstance(option, dict) or set(option) - {"id", "key", "mode", "ttl"}:
        raise BadDedup(f"the task option 'dedup' must be a mode ({', '.join(MODES)}) or a dict of id "
                       f"or key, mode and ttl (seconds), got {option!r}")
    return _settings(message, option.get("id"), option.get("key"), option.get("mode"),
                     _seconds_as_ms(option.get("ttl")))


def _settings(message: dict[str, Any], given_id: Any, key: Any, mode: Any, ttl_ms: int | None) -> Dedup:
    if given_id is not None and key is not None:
        raise BadDedup(f"a dedup id ({given_id!r}) and a dedup key ({key!r}) are given: give one")
    dedup_id = given_id if given_id is not None else key_of(message, key or "args")
    return Dedup(dedup_id, mode or "simple", ttl_ms)


def key_of(message: dict[str, Any], key: Any) -> str:
    """The dedup id a key names: ``task_id`` (the Celery task id) or ``args`` (the task name
    and a digest of its positional and keyword arguments, in a canonical JSON)."""
    headers = message.get("headers") or {}
    if key == "task_id":
        found = headers.get("id")
        if not isinstance(found, str) or not found:
            raise BadDedup("dedup key 'task_id': the message has no Celery task id (headers.id)")
        return found
    if key != "args":
        raise BadDedup(f"dedup key must be one of {', '.join(KEYS)}, got {key!r}")
    name = headers.get("task")
    if not isinstance(name, str) or not name:
        raise BadDedup("dedup key 'args': the message names no Celery task (headers.task)")
    return f"{name}:{_arguments_digest(message)}"


def _arguments_digest(message: dict[str, Any]) -> str:
    """sha1 of the task's [args, kwargs] in canonical JSON (sorted keys), so that the same call
    gives the same id whatever order its kwargs came in; a body that is no JSON (pickle,
    msgpack: base64 here) is taken as its bytes, the embedded callbacks included."""
    body = message.get("body")
    properties = message.get("properties") or {}
    canonical = body if isinstance(body, str) else repr(body)
    if isinstance(body, str) and "json" in str(message.get("content-type") or "") \
            and properties.get("body_encoding") is None:
        try:
            decoded = json.loads(body)
            if isinstance(decoded, list) and len(decoded) >= 2:
                canonical = json.dumps(decoded[:2], sort_keys=True, separators=(",", ":"))
        except ValueError:
            pass
    return hashlib.sha1(canonical.encode()).hexdigest()


def _ms(value: Any, name: str) -> int | None:
    if value is None:
        return None
    try:
        ms = int(value)
    except (TypeError, ValueError):
        raise BadDedup(f"header {name!r} must be an integer of ms, got {value!r}") from None
    if isinstance(value, bool) or (isinstance(value, float) and value != ms):
        raise BadDedup(f"header {name!r} must be an integer of ms, got {value!r}")
    return ms


def _seconds_as_ms(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise BadDedup(f"the task option dedup's 'ttl' must be a positive number of seconds, got {value!r}")
    return max(1, round(value * 1000))
