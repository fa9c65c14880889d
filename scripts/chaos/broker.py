"""The broker under test: one server, a Sentinel group (a primary, a replica and three
sentinels) whose primary moves, or a cluster (three primaries with a replica each) whose
primaries move. Everything that talks to "the broker" (the fault injector, the drain, the
final inspection) asks this for the current primary, or for a cluster client."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from celery_redis_lua import Keyspace
from celery_redis_lua.protocol.shards import members
from scripts.chaos import aof
from scripts.chaos.netns import Topology
from scripts.chaos.switch import Switch
from scripts.servers import Cluster, SentinelGroup, Server, server_version

MASTER_NAME = "mymaster"
# name -> (server kind, appendfsync, topology: "one", "sentinel" or "cluster")
BROKERS = {"redis-aof": ("redis", "everysec", "one"), "redis-aof-always": ("redis", "always", "one"),
           "valkey": ("valkey", "everysec", "one"), "valkey-aof-always": ("valkey", "always", "one"),
           "redis-sentinel": ("redis", "everysec", "sentinel"),
           "valkey-sentinel": ("valkey", "everysec", "sentinel"),
           "redis-cluster": ("redis", "everysec", "cluster"),
           "valkey-cluster": ("valkey", "everysec", "cluster"),
           "redis-sentinel-fenced": ("redis", "everysec", "sentinel"),
           "valkey-sentinel-fenced": ("valkey", "everysec", "sentinel"),
           "valkey-cluster-fenced": ("valkey", "everysec", "cluster"),
           "redis-sentinel2-fenced": ("redis", "everysec", "sentinel")}
# Sentinel groups with more than the one replica (the fence counts good replicas: with one, a
# promoted replica has none until the old primary rejoins it, and refuses writes meanwhile).
SENTINEL_REPLICAS = {"redis-sentinel2-fenced": 2}
# The "-fenced" kinds (issue 40 §3): every data server started with Redis's fence against a
# replaced primary that keeps writing (docs/deployment.md, "A fenced primary"). The lag: above
# the replicas' 1 s REPLCONF ACK period with room for a loaded 2-core host, and below the
# profiles' 6 s visibility timeout, as the recipe asks (an ack refused longer than a lease is
# given up); a primary cut off from its replica with the link still open stops within 5 s,
# the sentinels' failover-timeout, where the failover itself takes 1-3 s (down-after 1 s and
# an election). On loopback a promoted or a killed replica closes its link, and the old
# primary stops at once, whatever the lag; a stopped one still takes, at its resume, what
# waited for it (docs/RELIABILITY.md, the seed 501 runs).
FENCE_MIN_REPLICAS, FENCE_MAX_LAG = 1, 5
# A cluster primary that stops answering this long is failed over by its replica (what the
# sentinels' down-after is for a Sentinel group).
CLUSTER_NODE_TIMEOUT_MS = 1000
# The queue whose primary most cluster faults hit (the others hit a random primary).
MAIN_QUEUE = "celery"
# The pair of the fault injector, the drain and the final inspection (never cut), and of the
# event receiver; the producer's and each worker's are named by the harness.
HARNESS, EVENTS, PRODUCER = "harness", "events", "producer"


@dataclass
class NetnsServer(Server):
    """A server run inside a partition topology's namespace (``ip netns exec``), listening on
    the broker's address of every pair; the harness reaches it through its own pair."""

    topology: Topology | None = None

    def command_line(self) -> list[str]:
        assert self.topology is not None
        line = super().command_line()
        at = line.index("--bind")
        line[at + 1:at + 2] = [*self.topology.addresses(), "127.0.0.1"]
        return self.topology.exec_prefix() + line

    @property
    def host(self) -> str:
        assert self.topology is not None
        return self.topology.broker_address(HARNESS)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self.password,  # type: ignore[arg-type]
                           **kwargs)


@dataclass
class Broker:
    name: str
    server: Server | None = None
    group: SentinelGroup | None = None
    cluster: Cluster | None = None
    started: float = field(default_factory=time.time)
    # One server with the fsync recorder (power loss, scripts/chaos/aof.py): its log, or why not.
    fsync_log: Path | None = None
    recorder_error: str | None = None
    shards: int | None = None  # the main queue's x-shards (--shards)
    # INFO errorstats of data servers killed so far (a restart resets a server's counts).
    banked_errors: dict[str, int] = field(default_factory=dict)
    # With --partitions (one server): the server's namespace and the clients' veth pairs.
    network: Topology | None = None
    # With --partitions (a Sentinel group or a cluster): each data server and sentinel (each
    # cluster node) in its own namespace on one bridge (switch.py), for partition_primary.
    switch: Switch | None = None

    @classmethod
    def create(cls, name: str, fsync_recorder: bool = False, network: Topology | None = None,
               switch: Switch | None = None) -> Broker:
        """``fsync_recorder``: record the server's fsyncs, for power-loss faults (one server).
        ``network``: run the server inside that (created) partition topology (one server).
        ``switch``: run a Sentinel group's nodes on that (created) switch, node k as the group
        numbers them (the primary, the replicas, the sentinels); or a cluster's, node k its
        k-th (the primaries, then the replicas)."""
        kind, fsync, topology = BROKERS[name]
        args = ["--appendonly", "yes", "--appendfsync", fsync]
        if cls.is_fenced(name):
            args += ["--min-replicas-to-write", str(FENCE_MIN_REPLICAS),
                     "--min-replicas-max-lag", str(FENCE_MAX_LAG)]
        if topology == "sentinel":
            return cls(name, group=SentinelGroup(kind, replicas=SENTINEL_REPLICAS.get(name, 1), sentinels=3,
                                                 master_name=MASTER_NAME, args=args,
                                                 placement=switch.place if switch else None),
                       switch=switch)
        if topology == "cluster":
            return cls(name, cluster=Cluster(kind, replicas=1, node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS,
                                             args=args, placement=switch.place if switch else None),
                       switch=switch)
        if network is not None:
            broker = cls(name, server=NetnsServer(kind, args=args, topology=network), network=network)
        else:
            broker = cls(name, server=Server(kind, args=args))
        if fsync_recorder:
            try:
                assert broker.server is not None
                broker.fsync_log = aof.attach_recorder(broker.server)
            except aof.RecorderUnavailable as error:
                broker.recorder_error = str(error)
        return broker

    @staticmethod
    def is_fenced(name: str) -> bool:
        return name.endswith("-fenced")

    @property
    def fenced(self) -> bool:
        return self.is_fenced(self.name)

    @property
    def data_servers(self) -> list[Server]:
        if self.cluster is not None:
            return list(self.cluster.nodes)
        if self.group is not None:
            return list(self.group.servers)
        return [self.server] if self.server is not None else []

    @staticmethod
    def errorstats(server: Server) -> dict[str, int]:
        """``INFO errorstats`` of a running server: error prefix -> count ({} if it does not
        answer)."""
        try:
            info = server.client(socket_timeout=5).info("errorstats")
        except (redis.RedisError, OSError):
            return {}
        return {key.removeprefix("errorstat_"): int(value.get("count", 0)) for key, value in info.items()
                if key.startswith("errorstat_") and isinstance(value, dict)}

    def bank_errors(self, server: Server) -> None:
        """Before ``server`` is killed: keep its error counts (its restart starts them at 0)."""
        for error, count in self.errorstats(server).items():
            self.banked_errors[error] = self.banked_errors.get(error, 0) + count

    def refusals(self) -> dict[str, int]:
        """Errors the data servers answered over the run (banked ones included), e.g.
        NOREPLICAS (the fence refused a write), READONLY (a demoted primary did)."""
        total = dict(self.banked_errors)
        for server in self.data_servers:
            if server.process is not None and server.process.poll() is None:
                for error, count in self.errorstats(server).items():
                    total[error] = total.get(error, 0) + count
        return dict(sorted(total.items()))

    @property
    def sentinel(self) -> bool:
        return self.group is not None

    @property
    def replicated(self) -> bool:
        """Primaries that move (a Sentinel group or a cluster): faults wait for it to settle."""
        return self.group is not None or self.cluster is not None

    def start(self) -> Broker:
        if self.group is not None:
            self.group.start()
            self.settle()
        elif self.cluster is not None:
            self.cluster.start()
        else:
            assert self.server is not None
            self.server.start()
        return self

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.group is not None:
            self.group.stop()
        elif self.server is not None:
            self.server.stop()
        if self.network is not None:
            self.network.destroy()
        if self.switch is not None:
            self.switch.destroy()

    def current(self, timeout: float = 30.0) -> Server:
        """The primary now (asked of the sentinels; retried while they fail over); on a
        cluster, the primary that owns the main queue."""
        if self.cluster is not None:
            return self.owner(MAIN_QUEUE, timeout)
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

    def owner(self, queue: str, timeout: float = 30.0) -> Server:
        """The cluster primary that owns ``queue``'s slot (retried while a failover runs)."""
        assert self.cluster is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                owner = self.cluster.owner(Keyspace().queue(queue))
                if owner.client(socket_timeout=2).info("replication")["role"] == "master":
                    return owner
            except (redis.RedisError, OSError, StopIteration, RuntimeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no primary owning {queue!r} within {timeout}s")
            time.sleep(0.1)  # polling interval of a bounded wait

    def owned_queues(self, primary: Server, queues: tuple[str, ...]) -> list[str]:
        """Which of ``queues`` live on ``primary`` (a cluster); the main queue, when sharded,
        wherever one of its shards does."""
        assert self.cluster is not None
        return [q for q in queues if any(self.cluster.owner(Keyspace().queue(member)).port == primary.port
                                         for member in self.members(q))]

    def members(self, queue: str) -> list[str]:
        """The queues that hold ``queue``'s messages: itself, and its shards if it is the main
        queue and sharded (--shards)."""
        return members(queue, (self.shards or 1) if queue == MAIN_QUEUE else 1)

    def client(self, **kwargs: Any) -> Any:
        if self.cluster is not None:
            return self.cluster.client(**kwargs)
        return self.current().client(**kwargs)

    def settle(self, timeout: float = 60.0) -> Server:
        """Every data server running again and the group (or cluster) agreed (no-op for one
        server)."""
        if self.cluster is not None:
            for node in self.cluster.nodes:
                if node.process is None or node.process.poll() is not None:
                    node.start()  # its nodes.conf makes it rejoin, as a replica if it was replaced
            self.cluster.wait_healthy(timeout)
            return self.current(timeout)
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
        if self.cluster is not None:
            return server.start()  # the cluster decides its role (nodes.conf)
        return self._start_again_in_group(server, replica_of)

    def _start_again_in_group(self, server: Server, replica_of: int | None) -> Server:
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
            assert self.group is not None
            args += ["--replicaof", self.group.host_of(replica_of), str(replica_of)]
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

    def url(self, transport: str, client: str = HARNESS) -> str:
        """The broker URL ``client`` (a pair's label, with a partition topology) is given."""
        if self.cluster is not None:
            if transport != "ours":
                raise ValueError("kombu's stock Redis transport does not run on a cluster")
            first = self.cluster.nodes[0]  # its bridge address with --partitions (switch.py)
            return f"redislua+cluster://{first.host}:{first.port}/0"
        if self.group is not None:
            return self.group.broker_url("redislua+sentinel" if transport == "ours" else "sentinel")
        assert self.server is not None
        scheme = "redislua" if transport == "ours" else "redis"
        host = self.network.broker_address(client) if self.network is not None else "127.0.0.1"
        return f"{scheme}://{host}:{self.server.port}/0"

    def transport_options(self) -> dict[str, Any]:
        return {"master_name": MASTER_NAME} if self.group is not None else {}

    def describe(self) -> str:
        version = server_version(self.current().client())
        fence = (f", fenced: min-replicas-to-write {FENCE_MIN_REPLICAS}, max-lag {FENCE_MAX_LAG}"
                 if self.fenced else "")
        if self.cluster is not None:
            return f"{version}, 3 primaries with 1 replica each{fence}"
        if self.group is not None:
            replicas = self.group.replicas
            return f"{version}, {replicas} replica{'s' if replicas > 1 else ''}, 3 sentinels{fence}"
        return version

    def topology(self) -> dict[str, Any]:
        fence = ({"min_replicas_to_write": FENCE_MIN_REPLICAS, "min_replicas_max_lag": FENCE_MAX_LAG}
                 if self.fenced else {})
        return {**self._topology(), **fence}

    def _topology(self) -> dict[str, Any]:
        if self.cluster is not None:
            switch = ({"switch": {"bridge": f"{self.switch.bridge} {self.switch.gateway}/24",
                                  "nodes": {n.port: n.host for n in self.cluster.nodes}}}
                      if self.switch is not None else {})
            return {**switch, "primaries": [p.port for p in self.cluster.primaries()],
                    "nodes": [n.port for n in self.cluster.nodes],
                    "main_queue_on": self.current().port, "node_timeout_ms": CLUSTER_NODE_TIMEOUT_MS}
        if self.group is None:
            assert self.server is not None
            net = self.network
            if net is not None:
                return {"server": self.server.port, "namespace": net.name,
                        "pairs": {label: f"{net.client_address(label)} -> {net.broker_address(label)}"
                                  for label in net.labels}}
            return {"server": self.server.port}
        primary = self.current()
        delay = primary.client(socket_timeout=5).config_get("repl-diskless-sync-delay")
        switch = ({"switch": {"bridge": f"{self.switch.bridge} {self.switch.gateway}/24",
                              "nodes": {s.port: s.host for s in [*self.group.servers,
                                                                 *self.group.sentinel_servers]}}}
                  if self.switch is not None else {})
        return {**switch, "primary": primary.port,
                "repl_diskless_sync_delay": int(delay.get("repl-diskless-sync-delay", -1)),
                "data_servers": [s.port for s in self.group.servers],
                "sentinels": [s.port for s in self.group.sentinel_servers],
                "down_after_ms": self.group.sentinel_servers[0].down_after_ms,
                "failover_timeout_ms": self.group.sentinel_servers[0].failover_timeout_ms}
