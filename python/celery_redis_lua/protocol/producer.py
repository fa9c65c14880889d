"""Build the Celery task message (protocol v2, kombu's JSON envelope) that a producer stores
as the payload of the publish script. Pure: no I/O, no clock; the caller supplies the ETA.

What a worker needs from it (Celery 5, ``celery.worker.request.Request`` and kombu's
virtual ``Message``): ``headers.task`` and ``headers.id``; ``body``, the JSON text of
``[args, kwargs, embed]`` as it is (as the transport stores what ``send_task`` publishes; a
body in base64 needs ``properties.body_encoding = "base64"``, as stock kombu writes it);
``content-type`` and ``content-encoding`` to decode it; ``properties.delivery_info``
(``exchange``, ``routing_key``) and ``properties.priority`` for the request's delivery info.
Every other header is what ``celery.app.amqp.AMQP.as_task_v2`` sends, with its default, so a
worker cannot tell this message from one sent by ``send_task``. ``properties.delivery_tag``
is left out: the transport sets it on delivery.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from .envelope import dumps

__all__ = ["DEFAULT_QUEUE", "build_envelope", "decode_body", "dumps", "encode_body", "eta_iso"]

DEFAULT_QUEUE = "celery"
REPR_MAXSIZE = 1024  # Celery's argsrepr_maxsize / kwargsrepr_maxsize default


def encode_body(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The JSON ``[args, kwargs, embed]``, as Celery's JSON serializer writes it."""
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    return json.dumps([list(args), dict(kwargs), embed])


def decode_body(envelope: Mapping[str, Any]) -> list[Any]:
    """``[args, kwargs, embed]`` of an envelope built by :func:`build_envelope` or stored by
    the transport (text), or by stock kombu and other producers (``body_encoding`` base64)."""
    body = envelope["body"]
    if (envelope.get("properties") or {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    decoded: list[Any] = json.loads(body)
    return decoded


def eta_iso(eta_ms: int) -> str:
    """Celery's ``eta`` header: ISO 8601 in UTC, for absolute unix ms."""
    return datetime.fromtimestamp(eta_ms / 1000, UTC).isoformat()


def _repr(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= REPR_MAXSIZE else text[:REPR_MAXSIZE - 3] + "..."


def build_envelope(
    task: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
    task_id: str | None = None, queue: str = DEFAULT_QUEUE, priority: int = 0,
    eta_ms: int | None = None, origin: str = "celery-redis-lua",
) -> dict[str, Any]:
    """The envelope dict for running ``task(*args, **kwargs)`` from ``queue``.

    ``task_id`` defaults to a new UUID4. ``eta_ms`` (absolute unix ms, server clock) only
    fills the informational ``eta`` header: the broker holds the message because the publish
    script gets the same value as its ``eta_ms`` argument. ``priority`` is 0..255, higher
    first; it goes in ``properties.priority`` and must also be passed to the publish script.
    ``argsrepr``/``kwargsrepr`` (what worker logs show) are JSON here, not Python reprs.
    """
    kwargs = dict(kwargs or {})
    task_id = task_id or str(uuid.uuid4())
    headers: dict[str, Any] = {
        "lang": "py", "task": task, "id": task_id, "shadow": None,
        "eta": None if eta_ms is None else eta_iso(eta_ms), "expires": None,
        "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
        "root_id": task_id, "parent_id": None,
        "argsrepr": _repr(list(args)), "kwargsrepr": _repr(kwargs), "origin": origin,
        "ignore_result": False, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
    }
    return {
        "body": encode_body(args, kwargs),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "correlation_id": task_id,
            "reply_to": None,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
        },
    }


