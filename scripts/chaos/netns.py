"""Network partitions with the kernel's tools (issue 40 §1): the broker server in its own
network namespace, one veth pair per client, and the cuts made by policy routing inside
that namespace. No proxy: the clients' packets cross the kernel as they would a network.

Pair ``i`` joins the root namespace (``10.<net>.<i>.1/24``) to the broker's
(``10.<net>.<i>.2/24``); client ``i`` (a worker, the producer, the harness) is given the
broker's address on its own pair, so its packets go through that pair only. The ledger
stays on loopback. Neighbour entries are made permanent on both sides at creation, so a
cut never turns into an ARP failure (which would end a connect with EHOSTUNREACH, an
error the client sees at once) and the drop stays silent.

A cut, in the broker's namespace:

- both ways (``partition``): ``ip rule add iif <broker side> pref 100+i blackhole`` (every
  packet arriving from the client is dropped at input routing: no RST, no ICMP; the local
  table's rule is moved from 0 to LOCAL_RULE at creation, or it would match first and
  deliver the packets of established connections all the same) and
  ``ip route add blackhole 10.<net>.<i>.1/32`` (nothing the broker sends reaches it; the
  broker's own TCP just retransmits);
- one way (``oneway=True``): the route only. Packets from the client still arrive and the
  broker runs the commands they carry; its replies, its ACKs and its SYN-ACKs are dropped.

Healing deletes them. There is no ``tc netem`` on every kernel (this one: "Specified qdisc
kind is unknown"), so added latency is probed (:func:`netem_unavailable`) and reported as
unavailable, never faked."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field

PROBE_TIMEOUT = 10.0
LOCAL_RULE = 1000  # the local table's rule in the broker's namespace, after the cuts' (100 + i)


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, check=check, timeout=PROBE_TIMEOUT)


def _failure(error: subprocess.CalledProcessError | OSError | subprocess.TimeoutExpired) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        return f"`{' '.join(error.cmd)}` failed: {(error.stderr or '').strip()[:200]}"
    return repr(error)[:200]


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None when they can): not root, no
    ``ip`` (iproute2), or a namespace and a veth pair cannot be made."""
    if os.geteuid() != 0:
        return "not root: ip netns and veth pairs need CAP_NET_ADMIN and CAP_SYS_ADMIN"
    if shutil.which("ip") is None:
        return "no `ip` command (Debian's iproute2)"
    name = f"crl-probe-{os.getpid()}"
    try:
        run("ip", "netns", "add", name)
        run("ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        run("ip", "-n", name, "route", "add", "blackhole", "10.0.0.1/32")
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as error:
        return _failure(error)
    finally:
        run("ip", "netns", "del", name, check=False)
    return None


def netem_unavailable() -> str | None:
    """Why ``tc qdisc ... netem`` (the ``latency`` fault) cannot be used (None when it can)."""
    if unavailable() is not None:
        return f"no network namespaces: {unavailable()}"
    if shutil.which("tc") is None:
        return "no `tc` command (Debian's iproute2)"
    name = f"crl-probe-{os.getpid()}"
    try:
        run("ip", "netns", "add", name)
        run("ip", "-n", name, "link", "set", "lo", "up")
        run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as error:
        return f"no netem qdisc on this kernel: {_failure(error)}"
    finally:
        run("ip", "netns", "del", name, check=False)
    return None


def _dead_owner(name: str) -> bool:
    """``crl-part-<pid>-<rest>`` whose process is gone (a name this package makes)."""
    parts = name.split("-")
    return len(parts) == 4 and parts[:2] == ["crl", "part"] and parts[2].isdigit() \
        and not os.path.exists(f"/proc/{parts[2]}")


def remove_stale() -> list[str]:
    """Delete the namespaces a harness killed before its cleanup left (``crl-part-<pid>-<net>``,
    or switch.py's ``crl-part-<pid>-<net>n<k>``, whose process is gone; their veth pairs go
    with them) and switch.py's bridges (their alias is ``crl-part-<pid>-<net>``). Only names
    this package makes."""
    removed = []
    for line in run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _dead_owner(name):
            run("ip", "netns", "del", name, check=False)
            removed.append(name)
    listed = run("ip", "-j", "link", "show", "type", "bridge", check=False).stdout or "[]"
    for link in json.loads(listed):
        if _dead_owner(link.get("ifalias", "")):
            run("ip", "link", "del", link["ifname"], check=False)
            removed.append(link["ifname"])
    return removed


def free_net() -> int:
    """A second octet for 10.<net>.0.0/16 that no route of the root namespace uses."""
    routes = run("ip", "-4", "route", "show", "table", "all").stdout
    for offset in range(150):
        net = 100 + (os.getpid() + offset) % 150
        if f"10.{net}." not in routes:
            return net
    raise RuntimeError("no free 10.x.0.0/16 for the partition topology")


@dataclass
class Topology:
    """The broker's namespace and one veth pair per client label (created by :meth:`create`,
    removed by :meth:`destroy`, which is safe to call twice or after a half-made create)."""

    labels: tuple[str, ...]
    net: int = 0
    name: str = ""
    cut: dict[str, bool] = field(default_factory=dict)  # label -> one-way?
    created: bool = False

    def __post_init__(self) -> None:
        self.net = self.net or free_net()
        self.name = self.name or f"crl-part-{os.getpid()}-{self.net}"

    def index(self, label: str) -> int:
        return self.labels.index(label) + 1

    def root_side(self, label: str) -> str:
        return f"crl{self.net}r{self.index(label)}"

    def broker_side(self, label: str) -> str:
        return f"crl{self.net}b{self.index(label)}"

    def client_address(self, label: str) -> str:
        return f"10.{self.net}.{self.index(label)}.1"

    def broker_address(self, label: str) -> str:
        """The broker's address on ``label``'s pair: the host that client connects to."""
        return f"10.{self.net}.{self.index(label)}.2"

    def addresses(self) -> list[str]:
        return [self.broker_address(label) for label in self.labels]

    def ns(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ip -n <namespace> ...``"""
        return run("ip", "-n", self.name, *command, check=check)

    def create(self) -> Topology:
        remove_stale()
        run("ip", "netns", "add", self.name)
        self.created = True
        try:
            self.ns("link", "set", "lo", "up")
            run("ip", "netns", "exec", self.name, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")
            # The local table is looked up first (rule 0), and the broker's own addresses are
            # in it: a cut's rule must come before it, or a client's packets are delivered
            # all the same (a both-ways cut would be one-way for every established connection).
            self.ns("rule", "add", "pref", str(LOCAL_RULE), "lookup", "local")
            self.ns("rule", "del", "pref", "0")
            for label in self.labels:
                self._pair(label)
        except BaseException:
            self.destroy()
            raise
        return self

    def _pair(self, label: str) -> None:
        root, broker = self.root_side(label), self.broker_side(label)
        run("ip", "link", "add", root, "type", "veth", "peer", "name", broker, "netns", self.name)
        run("ip", "addr", "add", f"{self.client_address(label)}/24", "dev", root)
        run("ip", "link", "set", root, "up")
        self.ns("addr", "add", f"{self.broker_address(label)}/24", "dev", broker)
        self.ns("link", "set", broker, "up")
        root_mac = json.loads(run("ip", "-j", "link", "show", root).stdout)[0]["address"]
        broker_mac = json.loads(self.ns("-j", "link", "show", broker).stdout)[0]["address"]
        run("ip", "neigh", "replace", self.broker_address(label), "lladdr", broker_mac, "dev", root,
            "nud", "permanent")
        self.ns("neigh", "replace", self.client_address(label), "lladdr", root_mac, "dev", broker,
                "nud", "permanent")

    def exec_prefix(self) -> list[str]:
        """What runs a command inside the broker's namespace (``ip netns exec`` execs it: the
        process keeps its pid, so signals and waits work as for any child)."""
        return ["ip", "netns", "exec", self.name]

    def partition(self, label: str, oneway: bool = False) -> None:
        """Cut ``label``'s pair: both ways, or (``oneway``) the broker's packets to it only."""
        if label in self.cut:
            raise RuntimeError(f"{label} is already cut off")
        self.cut[label] = oneway
        self.ns("route", "add", "blackhole", f"{self.client_address(label)}/32")
        if not oneway:
            self.ns("rule", "add", "iif", self.broker_side(label), "pref", str(100 + self.index(label)),
                    "blackhole")

    def heal(self, label: str) -> None:
        oneway = self.cut.pop(label, None)
        self.ns("route", "del", "blackhole", f"{self.client_address(label)}/32", check=False)
        if oneway is False:
            self.ns("rule", "del", "pref", str(100 + self.index(label)), check=False)

    def heal_all(self) -> None:
        for label in list(self.cut):
            self.heal(label)

    def destroy(self) -> None:
        """Delete the namespace (its veth ends, and so the pairs, go with it) and any root
        side left behind. Processes still inside are the caller's to stop first."""
        if not self.created:
            return
        run("ip", "netns", "del", self.name, check=False)
        for label in self.labels:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                run("ip", "link", "del", self.root_side(label), check=False)
        self.created = False
        self.cut.clear()
