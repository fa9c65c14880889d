"""The broker under test: one server, or a Sentinel group (a primary, a replica and three
sentinels) whose primary moves. Everything that talks to "the broker" (the fault injector,
the drain, the final inspection) asks this for the current primary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis

from tools.servers import SentinelGroup, Server, server_version

MASTER_NAME = "mymaster"
# name -> (server kind, appendfsync, sentinel group?)
BROKERS = {"redis-aof": ("redis", "everysec", False), "redis-aof-always": ("redis", "always", False),
           "valkey": ("valkey", "everysec", False),
           "redis-sentinel": ("redis", "everysec", True), "valkey-sentinel": ("valkey", "everysec", True)}


@dataclass
class Broker:
    name: str
    server: Server | None = None
    group: SentinelGroup | None = None
    started: float = field(default_factory=time.time)

    @classmethod
    def create(cls, name: str) -> Broker:
        kind, fsync, sentinel = BROKERS[name]
        args = ["--appendonly", "yes", "--appendfsync", fsync]
        if sentinel:
            return cls(name, group=SentinelGroup(kind, replicas=1, sentinels=3,
                                                 master_name=MASTER_NAME, args=args))
        return cls(name, server=Server(kind, args=args))

    @property
    def sentinel(self) -> bool:
        return self.group is not None

    def start(self) -> Broker:
        if self.group is not None:
            self.group.start()
            self.settle()
        else:
            assert self.server is not None
            self.server.start()
        return self

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()
        elif self.server is not None:
            self.server.stop()

    def current(self, timeout: float = 30.0) -> Server:
        """The primary now (asked of the sentinels; retried while they fail over)."""
        if self.group is None:
            assert self.server is not None
            return self.server
        deadline = time.monotonic() + timeout
        while True:
            try:
                primary = self.group.primary
                if primary.client(socket_timeout=2).info("replication")["role"] == "master":
                    return primary
            except (redis.RedisError, OSError, StopIteration):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no primary answering as one within {timeout}s")
            time.sleep(0.1)  # polling interval of a bounded wait

    def client(self, **kwargs: Any) -> redis.Redis:
        return self.current().client(**kwargs)

    def settle(self, timeout: float = 60.0) -> Server:
        """Every data server running again and the group agreed (no-op for one server)."""
        if self.group is None:
            return self.current()
        deadline = time.monotonic() + timeout
        for server in self.group.servers:
            if server.process is None or server.process.poll() is not None:
                self.start_again(server, self.current(timeout).port)
        primary = self.group.wait_until_settled(timeout)
        # The replica says its link is up before the primary counts it (a diskless sync
        # puts it online at its first REPLCONF ACK); WAIT counts only online replicas.
        while not self.replicas_online(primary):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica online at the primary within {timeout}s")
            time.sleep(0.05)  # polling interval of a bounded wait
            primary = self.group.wait_until_settled(max(1.0, deadline - time.monotonic()))
        return primary

    def start_again(self, server: Server, replica_of: int | None) -> Server:
        """Start a stopped data server on its port and AOF in the role it has to come back
        in: a server killed as the primary comes back a primary (what its config says once
        the sentinels have promoted it; they demote it in their next round), one killed as a
        replica comes back replicating from ``replica_of``. Its first arguments would make
        an originally-replica server replicate from its first primary, possibly its own
        replica now: a loop in which no server is a primary and the group never settles."""
        args = list(server.args)
        while "--replicaof" in args:
            at = args.index("--replicaof")
            del args[at:at + 3]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        server.args = args
        return server.start()

    def replicas_online(self, primary: Server) -> bool:
        assert self.group is not None
        try:
            info = primary.client(socket_timeout=2).info("replication")
        except (redis.RedisError, OSError):
            return False
        online = sum(1 for key, value in info.items() if key.startswith("slave")
                     and isinstance(value, dict) and value.get("state") == "online")
        return online >= self.group.replicas

    def url(self, transport: str) -> str:
        if self.group is not None:
            return self.group.broker_url("redislua+sentinel" if transport == "ours" else "sentinel")
        assert self.server is not None
        scheme = "redislua" if transport == "ours" else "redis"
        return f"{scheme}://127.0.0.1:{self.server.port}/0"

    def transport_options(self) -> dict[str, Any]:
        return {"master_name": MASTER_NAME} if self.group is not None else {}

    def describe(self) -> str:
        version = server_version(self.client())
        if self.group is not None:
            return f"{version}, 1 replica, 3 sentinels"
        return version

    def topology(self) -> dict[str, Any]:
        if self.group is None:
            assert self.server is not None
            return {"server": self.server.port}
        primary = self.current()
        delay = primary.client(socket_timeout=5).config_get("repl-diskless-sync-delay")
        return {"primary": primary.port,
                "repl_diskless_sync_delay": int(delay.get("repl-diskless-sync-delay", -1)),
                "data_servers": [s.port for s in self.group.servers],
                "sentinels": [s.port for s in self.group.sentinel_servers],
                "down_after_ms": self.group.sentinel_servers[0].down_after_ms,
                "failover_timeout_ms": self.group.sentinel_servers[0].failover_timeout_ms}
