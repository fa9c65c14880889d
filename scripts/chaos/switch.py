"""A switched network for a Sentinel group or a cluster (issue 40 §1): every data server and
every sentinel (every cluster node) in its own network namespace, each joined by one veth
pair to a bridge in the root namespace, as hosts are to a switch; and, with ``clients``, the
producer and each worker in a namespace of their own on it too, so that each can be cut off
on its own (partitions.py's one-client kinds). The kernel's tools only (ip netns,
veth, a bridge), no proxy; the same ways as netns.py's one-server topology (its ``run``,
its rule priorities, permanent neighbours, its cleanup of what a killed harness left).

Node ``k`` (0 the first primary, then the replicas, then the sentinels) is ``10.<net>.0.(10+k)``
in namespace ``crl-part-<pid>-<net>n<k>``; the bridge carries ``10.<net>.0.1/24``, the
address every client of the root namespace (workers, producer, harness) reaches the nodes
from. Replicas replicate from the primary's address and the sentinels monitor it there, so
the addresses the sentinels hand out are the ones the clients reach through the bridge;
cluster nodes announce theirs (cluster-announce-ip), for the clients' slot maps and the bus.
Client ``i`` (after the nodes) is ``10.<net>.0.(10+nodes+i)``: a worker is started in its
namespace (``ip netns exec``), the producer's thread enters it (:func:`enter`); the ledger
listens on the bridge's address, which no cut touches.

Isolating node ``k`` (:meth:`Switch.isolate`), in its namespace, for each other node ``j``:
``ip rule add from <j> pref 100+j blackhole`` (what ``j`` sends is dropped at input
routing; the local table's rule is moved from 0 to LOCAL_RULE, after these, or packets of
established connections would be delivered all the same) and ``ip route add blackhole
<j>/32`` (nothing ``k`` sends reaches ``j``). The bridge's address, the clients', is not cut:
the isolated primary goes on serving them, the Jepsen split brain. A client is cut off the
same way in its own namespace from every node (both ways), or by the rules only (one way:
the nodes' packets to it dropped, its own still arriving). ARP is not IP: without
permanent neighbour entries an ARP request across the cut would go unanswered (the kernel
routes its sender before replying) and a connect would end in EHOSTUNREACH, not a silent
drop, so every entry is made permanent at creation."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
from dataclasses import dataclass, field

from scripts.chaos.netns import LOCAL_RULE, _failure, free_net, remove_stale, run, unavailable

FIRST_HOST = 10  # node k is 10.<net>.0.(FIRST_HOST + k)


def switch_unavailable() -> str | None:
    """Why a switched topology cannot be made here (None when it can): netns.py's probe,
    and a bridge (the kernel's ``bridge`` module) in a probe namespace."""
    why = unavailable()
    if why:
        return why
    name = f"crl-probe-{os.getpid()}"
    try:
        run("ip", "netns", "add", name)
        run("ip", "-n", name, "link", "add", "probe0", "type", "bridge")
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as error:
        return f"no bridge: {_failure(error)}"
    finally:
        run("ip", "netns", "del", name, check=False)
    return None


def mac(*ip_link_show: str) -> str:
    return str(json.loads(run(*ip_link_show).stdout)[0]["address"])


@dataclass
class Switch:
    """``nodes`` namespaces on one bridge (created by :meth:`create`; :meth:`destroy` is safe
    to call twice or after a half-made create)."""

    nodes: int
    net: int = 0
    cut: dict[int, tuple[int, ...]] = field(default_factory=dict)  # isolated node -> peers cut off
    created: bool = False
    # Clients each in a namespace of their own on the bridge, after the nodes (node
    # ``nodes + i`` is ``clients[i]``): a worker or the producer cut off on its own.
    clients: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.net = self.net or free_net()

    @property
    def bridge(self) -> str:
        return f"crlsw{self.net}"

    @property
    def gateway(self) -> str:
        """The bridge's address: where every client's packets come from."""
        return f"10.{self.net}.0.1"

    def namespace(self, node: int) -> str:
        # netns.remove_stale's pattern (crl-part-<pid>-<anything>): a killed harness's are removed
        return f"crl-part-{os.getpid()}-{self.net}n{node}"

    def address(self, node: int) -> str:
        return f"10.{self.net}.0.{FIRST_HOST + node}"

    @property
    def namespaces(self) -> int:
        return self.nodes + len(self.clients)

    def index(self, node: int | str) -> int:
        """A node's index, or a client's (by its label)."""
        return node if isinstance(node, int) else self.nodes + self.clients.index(node)

    def client_address(self, label: str) -> str:
        return self.address(self.index(label))

    def client_namespace(self, label: str) -> str:
        return self.namespace(self.index(label))

    def node_of(self, address: str) -> int:
        return int(address.rsplit(".", 1)[1]) - FIRST_HOST

    def root_side(self, node: int) -> str:
        return f"crl{self.net}s{node}"

    def node_side(self, node: int) -> str:
        return f"crl{self.net}n{node}"

    def place(self, node: int) -> dict[str, str]:
        """What scripts/servers.py's Server needs to run as node ``node``."""
        return {"netns": self.namespace(node), "address": self.address(node)}

    def ns(self, node: int, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ip -n <node's namespace> ...``"""
        return run("ip", "-n", self.namespace(node), *command, check=check)

    def create(self) -> Switch:
        remove_stale()
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self.created = True
        try:
            # the alias names the owner, so that remove_stale can delete a dead harness's bridge
            run("ip", "link", "set", self.bridge, "alias", f"crl-part-{os.getpid()}-{self.net}")
            # a bridge takes the lowest MAC of its ports unless its own was set: fixed now, so
            # the nodes' permanent neighbour entry for it stays right as ports join
            run("ip", "link", "set", self.bridge, "address", mac("ip", "-j", "link", "show", self.bridge))
            run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            run("ip", "link", "set", self.bridge, "up")
            for node in range(self.namespaces):
                self._node(node)
            self._neighbours()
        except BaseException:
            self.destroy()
            raise
        return self

    def _node(self, node: int) -> None:
        name, root, inside = self.namespace(node), self.root_side(node), self.node_side(node)
        run("ip", "netns", "add", name)
        self.ns(node, "link", "set", "lo", "up")
        run("ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")
        self.ns(node, "rule", "add", "pref", str(LOCAL_RULE), "lookup", "local")
        self.ns(node, "rule", "del", "pref", "0")
        run("ip", "link", "add", root, "type", "veth", "peer", "name", inside, "netns", name)
        run("ip", "link", "set", root, "master", self.bridge)
        run("ip", "link", "set", root, "up")
        self.ns(node, "addr", "add", f"{self.address(node)}/24", "dev", inside)
        self.ns(node, "link", "set", inside, "up")

    def _neighbours(self) -> None:
        macs = {node: mac("ip", "-n", self.namespace(node), "-j", "link", "show", self.node_side(node))
                for node in range(self.namespaces)}
        bridge_mac = mac("ip", "-j", "link", "show", self.bridge)
        for node, address in macs.items():
            run("ip", "neigh", "replace", self.address(node), "lladdr", address, "dev", self.bridge,
                "nud", "permanent")
            self.ns(node, "neigh", "replace", self.gateway, "lladdr", bridge_mac, "dev", self.node_side(node),
                    "nud", "permanent")
            for other, other_mac in macs.items():
                if other != node:
                    self.ns(node, "neigh", "replace", self.address(other), "lladdr", other_mac,
                            "dev", self.node_side(node), "nud", "permanent")

    def isolate(self, node: int | str, peers: tuple[int, ...] | None = None, oneway: bool = False) -> None:
        """Cut ``node`` (or a client, by its label) off from ``peers`` (default: every other
        node, never a client), both ways; the root namespace (the bridge's address) still
        reaches it. ``oneway``: only what ``peers`` send to it is dropped (the rules, not
        the routes): a client cut so still reaches the broker, which runs its commands, and
        never hears the replies (partitions.py's partition_oneway)."""
        node = self.index(node)
        if node in self.cut:
            raise RuntimeError(f"node {node} is already cut off")
        cut = tuple(j for j in range(self.nodes) if j != node) if peers is None else peers
        self.cut[node] = cut
        for j in cut:
            if not oneway:
                self.ns(node, "route", "add", "blackhole", f"{self.address(j)}/32")
            self.ns(node, "rule", "add", "from", f"{self.address(j)}/32", "pref", str(100 + j), "blackhole")

    def partition(self, label: str, oneway: bool = False) -> None:
        """netns.Topology's call: cut client ``label`` off from every node (the broker)."""
        self.isolate(label, oneway=oneway)

    def heal(self, node: int | str) -> None:
        node = self.index(node)
        for j in self.cut.pop(node, ()):
            self.ns(node, "route", "del", "blackhole", f"{self.address(j)}/32", check=False)
            self.ns(node, "rule", "del", "pref", str(100 + j), check=False)

    def heal_all(self) -> None:
        for node in list(self.cut):
            self.heal(node)

    def exec_prefix(self, node: int | str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(self.index(node))]

    def destroy(self) -> None:
        """Delete the namespaces (their veth ends, and so the pairs, go with them), the bridge
        and any root side left. Processes still inside are the caller's to stop first."""
        if not self.created:
            return
        for node in range(self.namespaces):
            run("ip", "netns", "del", self.namespace(node), check=False)
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                run("ip", "link", "del", self.root_side(node), check=False)
        run("ip", "link", "del", self.bridge, check=False)
        self.created = False
        self.cut.clear()


CLONE_NEWNET = 0x40000000


def enter(namespace: str) -> None:
    """Move the calling thread (and the threads it starts from now on) into ``namespace``,
    as ``ip netns exec`` moves a process: setns(2) on /run/netns/<name>. Sockets opened
    before keep theirs. For the producer, a thread of the harness (os.setns is Python 3.12's)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)
