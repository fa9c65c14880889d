"""Redis Cluster and Valkey Cluster: which nodes a broker URL names (redis-py's RedisCluster
discovers the rest and routes every command to the node that owns its keys).

``redislua+cluster://[user:password@]host:port[/0]`` (``redisluas+cluster://`` for TLS)
names one seed node; the ``cluster_nodes`` option adds more (``"host:port"`` strings), and
the class route (``broker_transport = "celery_redis_lua:Transport"``) selects a cluster with
the ``cluster`` option and a plain ``redis://`` URL. A cluster has only database 0.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

CLUSTER_SCHEMES = ("cluster",)  # what kombu leaves in the host of redislua(s)+cluster://
DEFAULT_PORT = 6379


class ClusterConfigError(ValueError):
    """A cluster URL or option that can never work."""


@dataclass(frozen=True)
class ClusterUrl:
    nodes: tuple[tuple[str, int], ...]  # seed nodes
    username: str | None
    password: str | None


def is_cluster_host(host: str) -> bool:
    """kombu parses ``redislua+cluster://h:p/0`` as our transport with the host
    ``cluster://h:p/0``."""
    return host.split("://", 1)[0].lower() in CLUSTER_SCHEMES and "://" in host


def parse_node(text: str, what: str = "cluster node") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(f"{what} must be 'host:port', got {text!r}")
    return host.strip("[]"), int(port)


def parse_cluster_host(host: str, extra_nodes: Sequence[str] = ()) -> ClusterUrl:
    """The ``cluster://[user:password@]host:port[/db]`` kombu left in the host, plus the
    ``cluster_nodes`` option's seeds."""
    parts = urlsplit(host)
    try:
        port = parts.port
    except ValueError:
        raise ClusterConfigError(f"bad port in cluster URL {host!r}") from None
    if not parts.hostname:
        raise ClusterConfigError(f"cluster URL {host!r} names no host")
    db = parts.path.strip("/")
    if db not in ("", "0"):
        raise ClusterConfigError(f"a cluster has only database 0; the URL asks for {db!r}")
    nodes = [(parts.hostname, port or DEFAULT_PORT), *(parse_node(n) for n in extra_nodes)]
    return ClusterUrl(tuple(dict.fromkeys(nodes)),
                      unquote(parts.username) if parts.username else None,
                      unquote(parts.password) if parts.password else None)


# The nodes the clients of this process found, by the seeds they started from. kombu and
# Celery make a new connection (so a new client) after a lost one; it starts from these as
# well as the seeds, so a worker whose URL names one node still finds the cluster when that
# node is the one that died.
_discovered: dict[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]] = {}
_discovered_lock = threading.Lock()


def startup_nodes(url: ClusterUrl) -> list[tuple[str, int]]:
    """The seeds first, then every node a client from the same seeds has seen."""
    with _discovered_lock:
        seen = _discovered.get(url.nodes, ())
    return list(dict.fromkeys([*url.nodes, *seen]))


def remember_nodes(url: ClusterUrl, client: Any) -> None:
    """Record the nodes ``client`` (a RedisCluster started from ``url``'s seeds) knows now."""
    nodes = tuple((node.host, int(node.port)) for node in client.get_nodes())
    if nodes:
        with _discovered_lock:
            _discovered[url.nodes] = tuple(dict.fromkeys([*_discovered.get(url.nodes, ()), *nodes]))
