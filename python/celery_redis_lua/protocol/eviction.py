"""The eviction guard: a server whose ``maxmemory-policy`` may evict keys can drop a queue in
silence under memory pressure. Managed services often default to ``volatile-lru`` (Memorystore,
ElastiCache, Azure), which evicts keys that carry a TTL: here, an ``x-expires`` queue's keys, the
binding tables, an expiring fanout stream, the dead letters of an expiring queue. ``allkeys-*``
may evict any key. Only ``noeviction`` keeps every message; docs/managed.md says how to set it
on each service.

The policy is read with ``INFO memory`` (its ``maxmemory_policy`` field), not CONFIG GET, which
most managed services refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

SAFE = "noeviction"
# What each family of policies can evict of ours.
AT_RISK = {
    "volatile": "keys with a TTL: x-expires queues (their messages too), bindings, expiring fanout "
                "streams and dead letters",
    "allkeys": "any key: every queue, its messages and its dead letters",
}


@dataclass(frozen=True)
class Eviction:
    """A server's eviction policy, as ``INFO memory`` tells it (None: it would not say)."""

    policy: str | None

    @property
    def risky(self) -> bool:
        return self.policy is not None and self.policy != SAFE

    def warning(self, server: str) -> str | None:
        """The line an operator reads, or None when nothing can be evicted."""
        if not self.risky:
            return None
        assert self.policy is not None
        family = self.policy.split("-", 1)[0]
        what = AT_RISK.get(family, "keys the server chooses")
        return (f"{server} has maxmemory-policy {self.policy}: under memory pressure it may evict "
                f"{what}, in silence. Set maxmemory-policy noeviction (docs/managed.md)")


def read_eviction(client: Any) -> Eviction:
    """The policy of the server ``client`` talks to; on a cluster, the first risky one among
    the primaries (each may be configured on its own). INFO refused (an ACL without +info, a
    service that hides it) reads as unknown, never as an error: the guard must not stop a
    worker that could otherwise run."""
    try:
        reply = client.info("memory")
    except redis.ResponseError:
        return Eviction(None)
    # A cluster client answers per node ({"host:port": {...}}), a plain one with the fields.
    sections = reply.values() if reply and all(isinstance(v, dict) for v in reply.values()) else [reply]
    policies = [str(s["maxmemory_policy"]) for s in sections if s.get("maxmemory_policy")]
    risky = [p for p in policies if p != SAFE]
    return Eviction(risky[0] if risky else policies[0] if policies else None)
