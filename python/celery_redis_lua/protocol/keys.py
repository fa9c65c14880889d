"""The keyspace: the only place where Redis key names are built and read back.

Every key of one queue carries the hash tag ``{Q}``, so a queue lives in one cluster slot,
and every queue script takes the same eight keys (:class:`QueueKeys`): the ready, delayed
and index ZSETs, the meta hash, the dead-letter stream, the two hashes that hold the
queue's messages (payloads, and their states), which therefore expire and are deleted with
the queue, and the wake list blocked consumers wait on. Binding tables and fanout streams
are per exchange. The inverses live here too: the queue named by a key, and the fields of a
binding member.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from redis.crc import key_slot

DEFAULT_SEPARATOR = "\x06\x16"  # kombu's separator inside binding members
DEFAULT_MESSAGE_KEY_PREFIX = "message:"


def fanout_prefix_for(option: bool | str, db: int) -> str:
    """What the ``fanout_prefix`` option puts between the key prefix and an exchange name:
    ``/<db>.`` for True (kombu's convention), the string itself, or nothing for False."""
    if option is True:
        return f"/{db}."
    return option or ""


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


class KeyspaceError(ValueError):
    """A prefix or a name cannot be turned into a valid key."""


class QueueKeys(NamedTuple):
    """The eight keys of one queue, in the order every queue script takes them."""

    queue: str
    delayed: str
    index: str  # type: ignore[assignment]  # shadows tuple.index; the field name is public API
    meta: str
    dead: str
    message: str
    state: str
    wake: str


class Binding(NamedTuple):
    """One member of a binding table, as kombu encodes it."""

    routing_key: str
    pattern: str
    queue: str


def check_no_braces(name: str, value: str) -> None:
    """A prefix with '{' or '}' would change the cluster hash tag of every key."""
    if "{" in value or "}" in value:
        raise KeyspaceError(
            f"{name} must not contain '{{' or '}}' (they would change the cluster hash tag): {value!r}"
        )


@dataclass(frozen=True)
class Keyspace:
    """Key names for a ``global_keyprefix``, a ``message_key_prefix`` and a fanout prefix
    (``/<db>.`` by default in the transport: what comes between the prefix and an exchange
    name in a fanout stream's key)."""

    prefix: str = ""
    message_key_prefix: str = DEFAULT_MESSAGE_KEY_PREFIX
    fanout_prefix: str = ""
    separator: str = DEFAULT_SEPARATOR

    def __post_init__(self) -> None:
        for name, value in (("global_keyprefix", self.prefix),
                            ("message_key_prefix", self.message_key_prefix),
                            ("fanout_prefix", self.fanout_prefix), ("sep", self.separator)):
            if not isinstance(value, str):
                raise KeyspaceError(f"{name} must be a string, got {value!r}")
        if not self.message_key_prefix:
            raise KeyspaceError("message_key_prefix must be a non-empty string, got ''")
        if not self.separator:
            raise KeyspaceError("sep must be a non-empty string, got ''")
        check_no_braces("global_keyprefix", self.prefix)
        check_no_braces("message_key_prefix", self.message_key_prefix)

    # -- queues ---------------------------------------------------------------------------

    @staticmethod
    def _tag(queue: str) -> str:
        if not isinstance(queue, str) or not queue:
            raise KeyspaceError(f"queue name must be a non-empty string, got {queue!r}")
        if queue.startswith("}"):
            # '{}...' is an empty hash tag: each key would hash on its whole name, and a
            # queue's keys would land in different cluster slots.
            raise KeyspaceError(f"queue name must not start with '}}', got {queue!r}")
        return "{" + queue + "}"

    def queue(self, queue: str) -> str:
        return f"{self.prefix}queue:{self._tag(queue)}"

    def delayed(self, queue: str) -> str:
        return f"{self.prefix}delayed:{self._tag(queue)}"

    def index(self, queue: str) -> str:
        return f"{self.prefix}messages_index:{self._tag(queue)}"

    def meta(self, queue: str) -> str:
        return f"{self.prefix}meta:{self._tag(queue)}"

    def dead(self, queue: str) -> str:
        return f"{self.prefix}dead:{self._tag(queue)}"

    def message(self, queue: str) -> str:
        """The hash of the queue's payloads (message id -> kombu envelope)."""
        return f"{self.prefix}{self.message_key_prefix}{self._tag(queue)}"

    def state(self, queue: str) -> str:
        """The hash of the queue's message states (id -> 'STATE COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]',
        the Celery task id last) and its task-id index (``task:<task id>`` -> id)."""
        return f"{self.prefix}state:{self._tag(queue)}"

    def wake(self, queue: str) -> str:
        """The list a consumer with nothing to do blocks on (BLPOP): it holds at most one
        token, pushed when something becomes consumable, and then the consumer runs consume.
        No message is ever popped by a blocking command, so none is in limbo while ready."""
        return f"{self.prefix}wake:{self._tag(queue)}"

    def migrated(self, queue: str) -> str:
        """What ``celery-redis-lua migrate`` moved into ``queue`` (message identities), so a
        rerun after a crash publishes nothing twice; deleted when a migration completes."""
        return f"{self.prefix}migrated:{self._tag(queue)}"

    @functools.lru_cache(maxsize=4096)  # noqa: B019  (a frozen keyspace lives as long as its queues)
    def queue_keys(self, queue: str) -> QueueKeys:
        """Built once per queue name: every script call on a queue passes all eight."""
        return QueueKeys(
            self.queue(queue), self.delayed(queue), self.index(queue), self.meta(queue),
            self.dead(queue), self.message(queue), self.state(queue), self.wake(queue),
        )

    def queue_of(self, key: str | bytes) -> str:
        """The queue name inside one of its keys (e.g. what BLPOP names)."""
        text = key.decode() if isinstance(key, bytes) else key
        open_ = text.find("{", len(self.prefix))
        if not text.startswith(self.prefix) or open_ < 0 or not text.endswith("}"):
            raise KeyspaceError(f"{text!r} is not a queue key of this keyspace")
        return text[open_ + 1:-1]

    def meta_pattern(self) -> str:
        """A SCAN MATCH pattern for every queue's meta key (queue discovery)."""
        return _glob_escape(self.meta("x")[:-len("x}")]) + "*}"

    def shards_meta_pattern(self, queue: str) -> str:
        """A SCAN MATCH pattern for the meta keys of ``queue``'s shards (protocol/shards.py)."""
        return _glob_escape(self.meta(queue + "~")[:-1]) + "*}"

    def slot(self, queue: str) -> int:
        """The cluster slot that holds every key of ``queue``."""
        return key_slot(self.queue(queue).encode())

    # -- exchanges ------------------------------------------------------------------------

    def binding(self, exchange: str) -> str:
        # Not kombu's '_kombu.binding.<exchange>': stock kombu keeps SETs there, and a rolling
        # switch runs both transports on one database (no key of ours is one of stock's).
        return f"{self.prefix}binding:{exchange}"

    def binding_pattern(self) -> str:
        """A SCAN MATCH pattern for every binding table."""
        return _glob_escape(self.binding("")) + "*"

    def binding_member(self, routing_key: str, pattern: str, queue: str) -> str:
        return self.separator.join([routing_key or "", pattern or "", queue or ""])

    def parse_binding(self, member: str | bytes) -> Binding:
        text = member.decode() if isinstance(member, bytes) else member
        parts = text.split(self.separator)
        if len(parts) != 3:
            raise KeyspaceError(f"binding member {text!r} is not routing_key, pattern and queue "
                                f"joined by {self.separator!r}")
        return Binding(*parts)

    def fanout(self, exchange: str) -> str:
        """The stream of a fanout exchange."""
        return f"{self.prefix}{self.fanout_prefix}{exchange}"

    def fanout_groups(self, stream_key: str) -> str:
        """The hash beside a fanout stream that records its bound queues' groups, in the
        stream's cluster slot: with the stream's own hash tag, or with the whole stream name
        as its tag (``P{P/0.exchange}:groups``), so that it starts with the prefix too."""
        open_ = stream_key.find("{")
        close = stream_key.find("}", open_ + 1) if open_ >= 0 else -1
        if open_ >= 0 and close > open_ + 1:
            return f"{stream_key}:groups"
        if "}" in stream_key:
            raise KeyspaceError(f"fanout stream {stream_key!r} has a '}}' outside a hash tag; "
                                "rename the exchange")
        return f"{self.prefix}{{{stream_key}}}:groups"
