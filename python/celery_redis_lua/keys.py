"""The keyspace: the only place where Redis key names are built.

Every key of one queue carries the hash tag ``{Q}``, so a queue lives in one
cluster slot. Message hashes are ``P message:{Q}:<id>``; the scripts derive
them from the queue key and the message key prefix, never from anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from redis.crc import key_slot


class KeyspaceError(ValueError):
    """A prefix or a name cannot be turned into a valid key."""


class QueueKeys(NamedTuple):
    """The keys of one queue, in the order most scripts take them."""

    queue: str
    delayed: str
    index: str
    meta: str
    dead: str


def _check_no_braces(name: str, value: str) -> None:
    if "{" in value or "}" in value:
        raise KeyspaceError(
            f"{name} must not contain '{{' or '}}' (they would change the cluster hash tag): {value!r}"
        )


@dataclass(frozen=True)
class Keyspace:
    """Key names for a ``global_keyprefix`` and a ``message_key_prefix``."""

    prefix: str = ""
    message_key_prefix: str = "message:"

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str):
            raise KeyspaceError(f"global_keyprefix must be a string, got {self.prefix!r}")
        if not isinstance(self.message_key_prefix, str) or not self.message_key_prefix:
            raise KeyspaceError(
                f"message_key_prefix must be a non-empty string, got {self.message_key_prefix!r}"
            )
        _check_no_braces("global_keyprefix", self.prefix)
        _check_no_braces("message_key_prefix", self.message_key_prefix)

    @staticmethod
    def _tag(queue: str) -> str:
        if not isinstance(queue, str) or not queue:
            raise KeyspaceError(f"queue name must be a non-empty string, got {queue!r}")
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

    def queue_keys(self, queue: str) -> QueueKeys:
        return QueueKeys(
            self.queue(queue), self.delayed(queue), self.index(queue),
            self.meta(queue), self.dead(queue),
        )

    @property
    def message_prefix(self) -> str:
        """What the scripts take as ``message_key_prefix`` (ARGV)."""
        return self.prefix + self.message_key_prefix

    def message(self, queue: str, message_id: str) -> str:
        """The hash of one message (built by the scripts; here for tools and tests)."""
        return f"{self.message_prefix}{self._tag(queue)}:{message_id}"

    def binding(self, exchange: str) -> str:
        return f"{self.prefix}_kombu.binding.{exchange}"

    def fanout(self, exchange: str, fanout_prefix: str = "") -> str:
        """The stream of a fanout exchange; ``fanout_prefix`` is e.g. ``/0.``."""
        return f"{self.prefix}{fanout_prefix}{exchange}"

    def slot(self, queue: str) -> int:
        """The cluster slot that holds every key of ``queue``."""
        return key_slot(self.queue(queue).encode())
