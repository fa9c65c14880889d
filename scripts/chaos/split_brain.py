"""``partition_primary`` (issue 40 §1): the Jepsen split brain, on a Sentinel group or a
cluster. The primary's namespace (switch.py) is cut off from its peers, both ways, for the
profile's ``partition_seconds`` (2-30 s): every replica and sentinel of a Sentinel group;
every other node of a cluster (its bus, port + 10000, and its data port: replication). The
clients (the bridge's address) still reach it. The sentinels, or the cut primary's replica
(after cluster-node-timeout), fail over while the old primary goes on taking its clients'
writes for as long as it will; at the heal it is demoted and the writes it took since the
cut are gone with its dataset. On a cluster the primary cut is the one holding the main
queue (broker.current()), where most of the load is.

The entry says what happened, measured, not assumed:

- ``old_primary``, ``new_primary`` (ports), ``node`` (the old primary's address), the cut
  (``t``: in force; ``cut_began``: its commands began), ``healed``; on a cluster ``replica``;
- ``new_primary_seconds``: when a sentinel first named another primary (on a cluster: when
  the cut primary's replica first answered as a primary), from the cut;
- ``fence_closed_seconds`` (fenced groups, min-replicas-to-write): when the old primary
  first counted fewer good replicas than it needs, so refused every write (its replica's
  acks stopped at the cut; it counts it lagging after min-replicas-max-lag);
- ``cluster_down_seconds`` (a cluster): when the old primary first said ``cluster_state:fail``
  (probed as a client, CLUSTER INFO): cut off from the majority of primaries, it marks them
  failing after cluster-node-timeout and refuses every command with CLUSTERDOWN;
- ``split_until``: when the old primary answered as a replica (its demotion, after the
  heal): until then two primaries served clients (duplicates, lost events, reordering);
- ``writes_until``: the end of the window in which a write the old primary confirmed may be
  lost: the first of the fence's closing and the cluster going down, when before the
  demotion, else the demotion (:func:`writes_until`). The verdict explains a lost task by
  this fault only if its publish was confirmed between REPLICATION_LAG before the cut and
  ``writes_until`` (a write confirmed in that window by the new primary is not lost: the old
  one's loss is the only loss the window explains);
- ``failover``: whether the primary moved (a short cut may end before it does).

Recovery (:func:`recovery`), reported, not held to partitions.RECOVERY_LIMIT (the failover
alone takes seconds: down-after 1 s, an election, a promotion; the demotion comes on the
sentinels' next look at the old primary after the heal, on a cluster at the first gossip):
heal -> the first consume batch of any worker; and promotion -> every worker that consumed
before the cut consuming again after the demotion (then on the new primary: the old one, a
replica, takes no consume)."""

from __future__ import annotations

import contextlib
import random
import time
from typing import TYPE_CHECKING, Any

import redis

from scripts.chaos.jepsen import percentile

if TYPE_CHECKING:
    from scripts.chaos.broker import Broker
    from scripts.servers import Server

KIND = "partition_primary"
SETTLE_TIMEOUT = 60.0
POLL = 0.1  # seconds between looks at the sentinels and the old primary during the cut


def demoted_at(server: Server, timeout: float) -> float | None:
    """When ``server`` first answered as a replica (None if not within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if server.client(socket_timeout=1).info("replication")["role"] == "slave":
                return time.time()
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)  # polling interval of a bounded wait
    return None


def good_replicas(info: dict[str, Any]) -> int | None:
    """INFO replication's count of replicas within min-replicas-max-lag (Redis's
    ``min_slaves_good_slaves``; shown only with the fence set)."""
    found = [v for k, v in info.items() if "good_slaves" in k or "good_replicas" in k]
    return int(found[0]) if found else None


def cluster_down(server: Server) -> bool:
    """Whether a cluster node says its cluster is down (``CLUSTER INFO``): a primary that lost
    the majority of primaries refuses every command on its slots with CLUSTERDOWN."""
    info = server.client(socket_timeout=1).execute_command("CLUSTER", "INFO")
    info = info.decode() if isinstance(info, bytes) else info
    return "cluster_state:ok" not in info


def promoted_port(broker: Broker, old: Server, replica: Server | None) -> int | None:
    """The port of the primary that replaced ``old`` (None: not yet): the one the sentinels
    name, or, on a cluster, ``old``'s replica once it answers as a primary."""
    with contextlib.suppress(redis.RedisError, OSError):
        if broker.group is not None:
            port = broker.group.primary_port()
            return port if port != old.port else None
        if replica is not None and replica.client(socket_timeout=1).info("replication")["role"] == "master":
            return replica.port
    return None


def watch(broker: Broker, old: Server, replica: Server | None, until: float) -> dict[str, Any]:
    """During the cut: when another primary was first named (promoted), when the old
    primary's fence closed, when (a cluster) it said its cluster was down, and how often it
    still answered the harness as a primary."""
    seen: dict[str, Any] = {"promoted": None, "new_port": None, "fence_closed": None, "cluster_down": None,
                            "answered": 0}
    while time.time() < until:
        if seen["promoted"] is None:
            port = promoted_port(broker, old, replica)
            if port is not None:
                seen.update(promoted=time.time(), new_port=port)
        with contextlib.suppress(redis.RedisError, OSError):
            info = old.client(socket_timeout=1).info("replication")
            seen["answered"] += info.get("role") == "master"
            good = good_replicas(info)
            if broker.fenced and seen["fence_closed"] is None and good is not None and good < 1:
                seen["fence_closed"] = time.time()
        if broker.cluster is not None and seen["cluster_down"] is None:
            with contextlib.suppress(redis.RedisError, OSError):
                if cluster_down(old):
                    seen["cluster_down"] = time.time()
        time.sleep(max(0.0, min(POLL, until - time.time())))  # the cut lasts until `until`
    return seen


def writes_until(seen: dict[str, Any], split_until: float) -> float:
    """The end of the window in which a write the old primary confirmed may be lost: the
    first of its fence's closing and (a cluster) its cluster going down, if before its
    demotion (``split_until``); else the demotion."""
    closed = [at for at in (seen.get("fence_closed"), seen.get("cluster_down")) if at is not None]
    return float(min([*closed, split_until]))


def isolate(broker: Broker) -> tuple[Server, Server | None, int]:
    """The primary to cut (the sentinels' or, on a cluster, the main queue's: most of the
    load's), its replica on a cluster (the one to be promoted), and its node on the switch."""
    assert broker.switch is not None
    old = broker.current()
    replica = broker.cluster.replica_of(old) if broker.cluster is not None else None
    return old, replica, broker.switch.node_of(old.host)


def inject(broker: Broker, rng: random.Random, seconds: tuple[float, float],
           skipped: dict[str, str]) -> dict[str, Any]:
    """Settle, cut the primary off from its peers (every other data server and sentinel, or
    every other cluster node: bus and data ports) for the drawn duration, heal, wait for its
    demotion and the group or cluster to settle; the entry (module docstring)."""
    if KIND in skipped:
        return {"skipped": skipped[KIND]}
    switch = broker.switch
    if switch is None or not broker.replicated:
        return {"skipped": "needs --partitions on a Sentinel broker or a cluster (its nodes on a bridge, "
                           "switch.py)"}
    began = time.monotonic()
    broker.settle(SETTLE_TIMEOUT)  # no cut on an unfinished failover
    settle_wait = time.monotonic() - began
    old, replica, node = isolate(broker)
    planned = rng.uniform(*seconds)
    cut_began = time.time()
    switch.isolate(node)
    cut = time.time()  # in force from here on
    try:
        seen = watch(broker, old, replica, cut + planned)  # the fault itself: cut off this long
    finally:
        switch.heal(node)
    healed = time.time()
    moved = seen["promoted"] is not None or promoted_port(broker, old, replica) is not None
    demoted = demoted_at(old, SETTLE_TIMEOUT) if moved else None
    broker.settle(SETTLE_TIMEOUT)
    new = broker.current()
    split_until = demoted if demoted is not None else healed
    entry = {"t": cut, "cut_began": cut_began, "target": "primary", "old_primary": old.port, "node": old.host,
             "peers_cut": [switch.address(j) for j in range(switch.nodes) if j != node],
             "partitioned_seconds": round(healed - cut, 3), "healed": healed,
             "failover": moved or new.port != old.port, "new_primary": new.port,
             "old_answered_during_cut": seen["answered"], "split_until": split_until,
             "writes_until": writes_until(seen, split_until), "settled_seconds": round(time.time() - cut, 3)}
    if replica is not None:
        entry["replica"] = replica.port
    for name, at in (("new_primary_seconds", seen["promoted"]),
                     ("fence_closed_seconds", seen["fence_closed"]),
                     ("cluster_down_seconds", seen["cluster_down"]), ("old_demoted_seconds", demoted)):
        if at is not None:
            entry[name] = round(at - cut, 3)
    if settle_wait > 0.2:
        entry["settle_wait_seconds"] = round(settle_wait, 3)
    return entry


def first_after(times: list[float], after: float) -> float | None:
    later = [t for t in times if t >= after]
    return min(later) if later else None


def followed_at(records: dict[str, list[dict[str, Any]]], fault: dict[str, Any]) -> float | None:
    """When the last worker that consumed before the cut consumed again after the old
    primary's demotion (None: none of them did, or no batches were recorded)."""
    by_pid: dict[Any, list[float]] = {}
    for b in records.get("batch", []):
        by_pid.setdefault(b.get("pid"), []).append(b["t"])
    firsts = [first_after(times, fault["split_until"]) for times in by_pid.values()
              if min(times) < fault["t"]]
    found = [t for t in firsts if t is not None]
    return max(found) if found else None


def recovery(records: dict[str, list[dict[str, Any]]], faults: list[dict[str, Any]]) -> dict[str, Any] | None:
    """partition_primary's figures (module docstring), in partitions.recovery's shape; None
    when none was applied. ``ok`` fails only on a heal after which no worker ever consumed."""
    applied = [f for f in faults if f["kind"] == KIND and not f.get("skipped") and "healed" in f]
    if not applied:
        return None
    consumed = [b["t"] for b in records.get("batch", [])] \
        or [s.get("received") or s["t"] for s in records.get("start", [])]
    seconds, followed, never = [], [], []
    for fault in applied:
        at = first_after(consumed, fault["healed"])
        if at is None:
            never.append({k: fault.get(k) for k in ("t", "old_primary", "healed")})
            continue
        seconds.append(at - fault["healed"])
        follow = followed_at(records, fault) if fault.get("failover") else None
        if follow is not None:
            followed.append(follow - fault["t"] - fault.get("new_primary_seconds", 0.0))
    return {"partitions": len(applied), "p50": percentile(seconds, 0.5, 3),
            "p99": percentile(seconds, 0.99, 3),
            "max": percentile(seconds, 1.0, 3), "never_recovered": len(never), "never_examples": never[:5],
            "failovers": sum(1 for f in applied if f.get("failover")),
            "followed_p50": percentile(followed, 0.5, 3), "followed_max": percentile(followed, 1.0, 3),
            "limit": "reported, not judged", "ok": not never}
