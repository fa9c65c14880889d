"""The topic exchange, the same on every kombu release the package supports.

kombu's virtual TopicExchange turns a binding key into a regex; before kombu 5.7 its ``*``
was ``.*?[^\\.]``, which matches several words (``a.*`` routed ``a.b.c``), where AMQP (and
kombu since) says exactly one. This transport's channels use :class:`TopicExchange` instead
of kombu's on every kombu version, so a message routes the same whichever kombu the producer
runs:

- ``*`` matches exactly one word and ``#`` any run of characters (kombu 5.7's regexes:
  ``a.#`` routes ``a.b`` and ``a.b.c``, not ``a``);
- the pattern stored in a binding is the one those regexes give, so the binding member of
  a queue (routing key, pattern, queue) is the same whichever kombu bound or unbinds it;
- a lookup matches the binding's routing key, not the stored pattern: a binding an older
  kombu stored (with its pattern) routes as AMQP says too.
"""

from __future__ import annotations

import re
from typing import Any

from kombu.transport.virtual import exchange
from kombu.utils.text import escape_regex

WILDCARDS = {"*": r"[^\.]+", "#": r".*?"}


class TopicExchange(exchange.TopicExchange):
    """kombu's topic exchange with one-word ``*`` on every kombu version."""

    wildcards = WILDCARDS
    _compiled: dict[str, re.Pattern[str]] = {}  # noqa: RUF012 (a cache shared by every channel)

    def key_to_pattern(self, rkey: str) -> str:
        return "^{}$".format(r"\.".join(WILDCARDS.get(word, word)
                                        for word in escape_regex(rkey, ".#*").split(".")))

    def lookup(self, table: Any, exchange: str, routing_key: str, default: Any) -> set[str]:
        return {queue for rkey, _, queue in table if self.matches(rkey, routing_key)}

    def matches(self, binding_key: str, routing_key: str) -> bool:
        """Whether a binding with ``binding_key`` routes a message sent with ``routing_key``."""
        compiled = self._compiled.get(binding_key)
        if compiled is None:
            if len(self._compiled) >= 4096:
                self._compiled.clear()
            compiled = self._compiled[binding_key] = re.compile(self.key_to_pattern(binding_key))
        return compiled.match(routing_key) is not None


EXCHANGE_TYPES = {**exchange.STANDARD_EXCHANGE_TYPES, "topic": TopicExchange}
