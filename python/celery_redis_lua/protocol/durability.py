"""Durable writes (opt-in): a publish, ack or reject is confirmed only once its write has
reached N replicas (``WAIT``) or the AOF on disk (``WAITAOF``).

Redis replicates asynchronously: without this, a write the primary confirmed can vanish in
a failover (a publish lost; an ack lost, so the task runs again), and with
``appendfsync everysec`` up to a second of writes can vanish in a power loss. The wait is
sent in the same pipeline as the script call, on the same connection (WAIT counts the
writes of the connection it runs on), so it costs no extra round trip; a pipeline of many
calls gets one wait. See docs/decisions.md for what each setting protects against.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ClusterError, ConnectionError, RedisClusterException, ResponseError, TimeoutError

# The scripts whose writes a durable setting confirms. A publish (or a replay) that falls
# short raises NotDurable: its caller must know the message may be lost. An ack, a reject,
# a declare or a bind that falls short is logged and stands on the primary: losing one in a
# failover means a redelivery (counted) or a route declared again by the next consumer or
# producer, and its caller could do nothing better. consume and extend are not
# confirmed: losing one only redelivers a message, counted. Nor is fanout_publish: Celery's
# events, heartbeats and remote control go through it every few seconds, a stream is trimmed
# anyway, and a NotDurable there killed Celery's event receivers (found by the chaos harness)
# while every heartbeat waited out the timeout whenever no replica was online.
RAISE_WHEN_SHORT = frozenset({"publish", "dead_replay"})
CONFIRMED_SCRIPTS = RAISE_WHEN_SHORT | {"ack", "reject", "declare", "bind"}
# How WAIT and WAITAOF refuse to run on a replica (Redis 7.0 to 8, Valkey).
DEMOTED = "cannot be used with replica instances"
_SETTING = re.compile(r"^(?:(aof)|replicas:(\d+)|aof\+replicas:(\d+))$")
# Under appendfsync everysec, WAITAOF confirms writes no fsync has covered yet whenever the
# last fsync was less than a second ago: flushAppendOnlyFile's empty-buffer branch marks all
# that was written as fsynced. Measured on Valkey 9.1.2 by the chaos harness's fsync recorder
# (docs/RELIABILITY.md, power loss); Redis fixed it in 8.0 (redis/redis#13793), the code it
# fixed dating from 2023 (redis/redis#12622).
EARLY_CONFIRMATION = ("durability=%r: under appendfsync everysec this server's WAITAOF confirms "
                      "writes before they are fsynced (%s; redis/redis#13793), so a power loss can "
                      "take publishes it confirmed: set appendfsync always for 'aof' to hold")


class NotDurable(Exception):
    """A write was applied on the primary but not confirmed within ``durability_timeout``.

    Deliberately not a connection error: kombu would retry the publish, and a retried
    publish stores the message twice. Whether this message survives a failover is unknown.
    ``results`` holds what the confirmed calls returned on the primary.
    """

    def __init__(self, message: str, results: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.results = list(results)


class DurabilityUnavailable(ValueError):
    """The server cannot honour the durability setting (a clear error at connect time)."""


@dataclass(frozen=True)
class Durability:
    """``replicas:N`` (WAIT N), ``aof`` (WAITAOF 1 0: the primary's AOF fsynced) or
    ``aof+replicas:N`` (WAITAOF 1 N: the primary's AOF and N replicas' AOFs fsynced)."""

    setting: str
    replicas: int
    aof: bool
    timeout_ms: int

    @classmethod
    def parse(cls, setting: str, timeout_ms: int) -> Durability:
        match = _SETTING.match(setting) if isinstance(setting, str) else None
        if not match:
            raise ValueError(f"expected 'replicas:N', 'aof' or 'aof+replicas:N', got {setting!r}")
        aof = bool(match.group(1)) or match.group(3) is not None
        replicas = int(match.group(2) or match.group(3) or 0)
        if not aof and replicas < 1:
            raise ValueError(f"'replicas:N' needs N >= 1, got {setting!r}")
        return cls(setting, replicas, aof, timeout_ms)

    def command(self) -> tuple[Any, ...]:
        if self.aof:
            return ("WAITAOF", 1, self.replicas, self.timeout_ms)
        return ("WAIT", self.replicas, self.timeout_ms)

    def confirmed(self, reply: Any) -> bool:
        if self.aof:
            local, replicas = (int(x) for x in reply)
            return local >= 1 and replicas >= self.replicas
        return int(reply) >= self.replicas

    def least(self, replies: Sequence[Any]) -> Any:
        """Of several nodes' wait replies (a cluster), the one furthest from confirmed: an
        error if any node's wait failed."""
        for reply in replies:
            if isinstance(reply, Exception):
                return reply
        if self.aof:
            return [min(int(r[0]) for r in replies), min(int(r[1]) for r in replies)]
        return min(int(r) for r in replies)

    def describe(self, reply: Any) -> str:
        if self.aof:
            local, replicas = (int(x) for x in reply)
            return f"local AOF fsynced: {'yes' if local else 'no'}, replicas' AOFs: {replicas}"
        return f"{int(reply)} replica(s) acknowledged"

    def not_durable(self, scripts: Sequence[str], reply: Any, results: Sequence[Any]) -> NotDurable:
        return NotDurable(
            f"{', '.join(sorted(set(scripts)))}: the write was applied on the primary but not "
            f"confirmed as durability={self.setting!r} within {self.timeout_ms} ms "
            f"({self.describe(reply)}); it may or may not survive a failover or power loss", results)

    def check_server(self, client: Any) -> int:
        """At connect time: the server knows the wait command and can honour it; returns how
        many replicas are connected now. Fewer than asked for is not refused here (a replica
        may be restarting; each write then fails after the timeout): the caller warns."""
        # A fresh connection's wait counts the replicas that acknowledged the primary's offset
        # as of now; they report once a second, so give it up to a second (Redis 7.0 answered
        # 0 to an instant probe while its replica was in sync).
        timeout = min(self.timeout_ms, 1000)
        probe = ("WAITAOF", 1, self.replicas, timeout) if self.aof else ("WAIT", self.replicas, timeout)
        try:
            if hasattr(client, "get_primaries"):  # a cluster: every primary must honour it
                reply = self.least([self._probe_primary(client, node, probe)
                                    for node in client.get_primaries()])
            else:
                reply = client.execute_command(*probe)
        except (ConnectionError, TimeoutError, ClusterError, RedisClusterException):
            raise  # a node down (a failover under way): a lost connection, retried, not a refusal
        except Exception as error:
            message = str(error)
            if "unknown command" in message.lower():
                message = f"{probe[0]} is not a command of this server (WAITAOF needs Redis 7.2+ or Valkey)"
            raise DurabilityUnavailable(
                f"transport option 'durability'={self.setting!r} cannot be honoured by this "
                f"server: {message}") from None
        return int(reply[1]) if self.aof else int(reply)

    def early_confirmation(self, client: Any) -> str | None:
        """With ``aof``: why this server's WAITAOF may confirm before the fsync (its version and
        ``appendfsync everysec``), or None. Asked of a single server only (a cluster's or a
        managed server's CONFIG may not answer: then nothing is said)."""
        if not self.aof or hasattr(client, "get_primaries"):
            return None
        try:
            fsync = client.config_get("appendfsync").get("appendfsync")
            info = client.info("server")
        except Exception:  # CONFIG refused (ACL, a managed service): nothing to go by
            return None
        if fsync != "everysec":
            return None
        if info.get("valkey_version"):
            return f"Valkey {info['valkey_version']}"
        version = tuple(int(x) for x in str(info.get("redis_version", "0.0")).split(".")[:2])
        return f"Redis {info['redis_version']}" if (7, 2) <= version < (8, 0) else None

    @staticmethod
    def _probe_primary(client: Any, node: Any, probe: tuple[Any, ...]) -> Any:
        """The probe on one node the cluster client's slot map calls a primary. A node a
        failover demoted since the map was read refuses the wait as a replica: that is a
        failover under way, not a server that cannot honour the setting. The map is read
        again and the refusal becomes a cluster error, which the transport treats as a lost
        connection: kombu's retry probes the new primary."""
        try:
            return client.execute_command(*probe, target_nodes=node)
        except ResponseError as error:
            if DEMOTED not in str(error):
                raise
            client.nodes_manager.initialize()
            raise ClusterError(f"{probe[0]} on {node.name}: the node is a replica now (a failover "
                               f"under way); the slot map is read again") from None
