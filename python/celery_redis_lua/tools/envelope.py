"""What the operator's tools read and change in a stored Celery protocol 2 envelope (kombu's
JSON around the task message): its task name and id, and its ``expires`` header.

The broker keeps payloads as producers wrote them; only an operator's explicit replay of a
dead letter with its expiry cleared or renewed writes a changed one (``dead replay
--clear-expires | --renew-expires``): the task keeps its Celery ``expires`` through a replay,
and a worker discards a task past it at once, so an ``expired`` dead letter replayed as it
is never runs.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any


def task_of(payload: bytes | str) -> tuple[str, str]:
    """(task name, task id) of a Celery envelope; ('-', '-') for anything else."""
    headers = _headers(payload)
    if headers is None:
        return "-", "-"
    return str(headers.get("task") or "-"), str(headers.get("id") or "-")


def with_expires(payload: bytes | str, expires: datetime | None) -> bytes | None:
    """``payload`` with its task's ``expires`` header set to ``expires`` (ISO 8601, as Celery
    writes it; ``None`` clears it); ``None`` when it is no Celery envelope or has no expiry to
    change. Python's json reads back every number and string exactly, so the rest of the
    envelope is kept (only its spacing may change)."""
    try:
        envelope = json.loads(payload)
    except (ValueError, TypeError):
        return None
    headers = envelope.get("headers") if isinstance(envelope, dict) else None
    if not isinstance(headers, dict) or headers.get("expires") is None:
        return None
    headers["expires"] = expires.isoformat() if expires else None
    return json.dumps(envelope).encode()


def _headers(payload: bytes | str) -> dict[str, Any] | None:
    try:
        headers = json.loads(payload)["headers"]
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return headers if isinstance(headers, dict) else None
