"""The kombu envelope on its way in and out: what publish needs from it, and what a
consumer sees added to it (delivery tag, x-delivery-count, redelivered).

The payload stored in Redis is the envelope exactly as kombu built it; the
additions happen on the decoded copy handed to kombu.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .calls import Delivery

TAG_SEPARATOR = "@"
# The latest ETA the publish script takes (unix ms, year 2286): one later would overflow
# into the next priority band of the ready score.
MAX_ETA_MS = 10**13 - 1


class BadEnvelope(ValueError):
    """A message cannot be published or delivered as it is; the text names it."""


def delivery_tag(queue: str, message_id: str) -> str:
    """``<id>@<queue>``: ids are hex, so the first '@' separates them."""
    return f"{message_id}{TAG_SEPARATOR}{queue}"


def split_tag(tag: str) -> tuple[str, str]:
    """The (queue, message id) of a delivery tag made by :func:`delivery_tag`."""
    message_id, _, queue = str(tag).partition(TAG_SEPARATOR)
    if not queue:
        raise BadEnvelope(f"delivery tag {tag!r} was not issued by celery-redis-lua")
    return queue, message_id


@dataclass(frozen=True)
class PublishArguments:
    priority: int | str
    eta_ms: int | None
    ttl_ms: int | None


def _describe(message: dict[str, Any]) -> str:
    headers = message.get("headers") or {}
    return f"message {headers.get('id') or message.get('properties', {}).get('correlation_id') or '?'}"


def eta_ms(message: dict[str, Any]) -> int | None:
    """Celery's ``eta`` header (ISO 8601) as unix ms; a naive time is taken as UTC."""
    eta = (message.get("headers") or {}).get("eta")
    if not eta:
        return None
    try:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        at = max(0, int(when.timestamp() * 1000))
    except (TypeError, ValueError, AttributeError, OverflowError) as error:
        raise BadEnvelope(f"{_describe(message)}: header 'eta' is not an ISO 8601 time: {eta!r}") from error
    if at > MAX_ETA_MS:
        raise BadEnvelope(f"{_describe(message)}: header 'eta' {eta!r} is later than the year 2286, "
                          "the latest ETA the broker holds")
    return at


def publish_arguments(message: dict[str, Any], default_ttl_ms: int | None) -> PublishArguments:
    """Priority, ETA and TTL of an envelope, as the publish script takes them."""
    properties = message.get("properties") or {}
    priority = properties.get("priority")
    if priority is None:
        priority = 0
    ttl_ms = default_ttl_ms
    expiration = properties.get("expiration")
    if expiration is not None:
        try:
            own = int(expiration)
        except (TypeError, ValueError) as error:
            raise BadEnvelope(f"{_describe(message)}: property 'expiration' must be ms, "
                              f"got {expiration!r}") from error
        ttl_ms = own if ttl_ms is None else min(own, ttl_ms)
    return PublishArguments(priority, eta_ms(message), ttl_ms)


def dumps(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))


def delivered_envelope(delivery: Delivery) -> dict[str, Any]:
    """Decode a delivered payload and add what the consumer needs to see."""
    try:
        message = json.loads(delivery.payload)
        properties = message["properties"]
    except (ValueError, TypeError, KeyError) as error:
        raise BadEnvelope(f"message {delivery.id} in queue {delivery.queue!r} has a payload that is "
                          f"not a kombu envelope ({error.__class__.__name__}: {error})") from error
    if not isinstance(message, dict) or not isinstance(properties, dict):
        raise BadEnvelope(f"message {delivery.id} in queue {delivery.queue!r} has a payload that is "
                          "not a kombu envelope")
    properties["delivery_tag"] = delivery_tag(delivery.queue, delivery.id)
    info = properties.setdefault("delivery_info", {})
    info["redelivered"] = delivery.delivery_count > 0
    if message.get("headers") is None:
        message["headers"] = {}
    message["headers"]["x-delivery-count"] = delivery.delivery_count
    # The broker held the message until its ETA by the server's clock; a worker that saw
    # the ETA again would park the task in its own memory (and `inspect scheduled`).
    if message["headers"].get("eta"):
        message["headers"]["x-eta"] = message["headers"]["eta"]
        message["headers"]["eta"] = None
    if delivery.delivery_count > 0:
        message["redelivered"] = True
    return message
