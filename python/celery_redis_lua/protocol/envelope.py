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

from . import dedup, fairness
from .bounds import MAX_DURATION_MS, MAX_ETA_MS
from .dedup import Dedup
from .ops import Delivery, Outgoing

TAG_SEPARATOR = "@"
FANOUT_MARK = "fanout:"  # a fanout entry's tag: read at most once, nothing to ack


class BadEnvelope(ValueError):
    """A message cannot be published or delivered as it is; the text names it."""


@dataclass(frozen=True)
class DeliveryTag:
    """What a delivery tag names: ``<id>@<queue>`` (ids are hex or stream ids, so the first
    '@' separates them), with ``fanout:`` before a fanout entry's, which has nothing to ack."""

    queue: str
    id: str
    fanout: bool = False

    def __str__(self) -> str:
        return f"{FANOUT_MARK if self.fanout else ''}{self.id}{TAG_SEPARATOR}{self.queue}"

    @classmethod
    def parse(cls, tag: object) -> DeliveryTag:
        text = str(tag)
        fanout = text.startswith(FANOUT_MARK)
        message_id, _, queue = text.removeprefix(FANOUT_MARK).partition(TAG_SEPARATOR)
        if not queue or not message_id:
            raise BadEnvelope(f"delivery tag {text!r} was not issued by celery-redis-lua")
        return cls(queue, message_id, fanout)


@dataclass(frozen=True)
class PublishArguments:
    priority: int | str
    eta_ms: int | None
    ttl_ms: int | None
    task_id: str | None = None  # the Celery task id (headers.id), indexed for where/cancel
    dedup: Dedup | None = None  # a dedup id and its mode (headers x-dedup-*, the task option dedup)
    fairness_key: str | None = None  # the tenant (header x-fairness-key, the task option fairness_key)

    def outgoing(self, payload: str | bytes, route: tuple[str, int] | None = None) -> Outgoing:
        """The publish of ``payload`` with these arguments (and a cached ``route``)."""
        return Outgoing(payload, self.priority, self.eta_ms, self.ttl_ms, self.task_id, route, self.dedup,
                        self.fairness_key)


def _describe(message: dict[str, Any]) -> str:
    headers = message.get("headers") or {}
    return f"message {headers.get('id') or message.get('properties', {}).get('correlation_id') or '?'}"


MAX_TASK_ID_BYTES = 256  # publish.lua's limit


def eta_ms(message: dict[str, Any]) -> int | None:
    """Celery's ``eta`` header (ISO 8601) as unix ms; a naive time is taken as UTC."""
    return _header_time_ms(message, "eta")


def _header_time_ms(message: dict[str, Any], name: str) -> int | None:
    """A Celery header holding an ISO 8601 time (``eta``, ``expires``) as unix ms; a naive
    time is taken as UTC."""
    value = (message.get("headers") or {}).get(name)
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) else value
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        at = max(0, int(when.timestamp() * 1000))
    except (TypeError, ValueError, AttributeError, OverflowError) as error:
        raise BadEnvelope(f"{_describe(message)}: header {name!r} is not an ISO 8601 time: "
                          f"{value!r}") from error
    if at > MAX_ETA_MS:
        raise BadEnvelope(f"{_describe(message)}: header {name!r} {value!r} is later than the year "
                          "2286, the latest time the broker holds")
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
        if own > MAX_DURATION_MS:
            raise BadEnvelope(f"{_describe(message)}: property 'expiration' must be at most "
                              f"{MAX_DURATION_MS} ms (10 years), got {expiration!r}")
        ttl_ms = own if ttl_ms is None else min(own, ttl_ms)
    eta = eta_ms(message)
    expires = _header_time_ms(message, "expires")
    if eta is not None and expires is not None:
        # Celery's expires is a time, sent as 'expiration' ms from now; a message's TTL counts
        # from its ETA, so a countdown's is what is left after it: dead-lettered at expires.
        own = max(1, expires - eta)
        if own > MAX_DURATION_MS:
            raise BadEnvelope(f"{_describe(message)}: header 'expires' is more than {MAX_DURATION_MS} "
                              "ms (10 years) after its 'eta', the longest a message may wait")
        ttl_ms = own if ttl_ms is None else min(own, ttl_ms)
    try:
        deduplication = dedup.from_envelope(message)
    except dedup.BadDedup as error:
        raise BadEnvelope(f"{_describe(message)}: {error}") from None
    try:
        fairness_key = fairness.from_envelope(message)
    except fairness.BadFairnessKey as error:
        raise BadEnvelope(f"{_describe(message)}: {error}") from None
    return PublishArguments(priority, eta, ttl_ms, task_id(message), deduplication, fairness_key)


def task_id(message: dict[str, Any]) -> str | None:
    """The Celery task id (protocol 2: ``headers.id``) when it is one the index can take;
    anything else (kombu messages, another protocol) is published unindexed."""
    found = (message.get("headers") or {}).get("id")
    if isinstance(found, str) and 0 < len(found.encode()) <= MAX_TASK_ID_BYTES:
        return found
    return None


def dumps(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))


def delivered_envelope(delivery: Delivery, *, fanout: bool = False) -> dict[str, Any]:
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
    properties["delivery_tag"] = str(DeliveryTag(delivery.queue, delivery.id, fanout))
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
