"""``partition_primary`` (issue 40 §1): the Jepsen split brain on a Sentinel broker. The
primary's namespace (switch.py) is cut off from every replica and sentinel, both ways, for
the profile's ``partition_seconds`` (2-30 s); the clients still reach it. The sentinels
fail over to a replica while the old primary goes on taking its clients' writes; at the
heal they demote it and the writes it took since the cut are gone with its dataset.

The entry says what happened, measured, not assumed:

- ``old_primary``, ``new_primary`` (ports), ``node`` (the old primary's address), the cut
  (``t``: in force; ``cut_began``: its commands began), ``healed``;
- ``new_primary_seconds``: when a sentinel first named another primary, from the cut;
- ``fence_closed_seconds`` (fenced groups, min-replicas-to-write): when the old primary
  first counted fewer good replicas than it needs, so refused every write (its replica's
  acks stopped at the cut; it counts it lagging after min-replicas-max-lag);
- ``split_until``: when the old primary answered as a replica (its demotion, after the
  heal): until then two primaries served clients (duplicates, lost events, reordering);
- ``writes_until``: the end of the window in which a write the old primary confirmed may be
  lost: the fence's closing when it closed before the demotion, else the demotion. The
  verdict explains a lost task by this fault only if its publish was confirmed between
  REPLICATION_LAG before the cut and ``writes_until`` (a write confirmed in that window by
  the new primary is not lost: the old one's loss is the only loss the window explains);
- ``failover``: whether the sentinels moved the primary (a short cut may end before they do).

Recovery (:func:`recovery`), reported, not held to partitions.RECOVERY_LIMIT (the failover
alone takes seconds: down-after 1 s, an election, a promotion; the demotion comes on the
sentinels' next look at the old primary after the heal): heal -> the first consume batch of
any worker; and promotion -> every worker that consumed before the cut consuming again
after the demotion (then on the new primary: the old one, a replica, takes no consume)."""

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


def watch(broker: Broker, old: Server, until: float) -> dict[str, Any]:
    """During the cut: when a sentinel first named another primary, when the old primary's
    fence closed, and how often it still answered the harness as a primary."""
    assert broker.group is not None
    seen: dict[str, Any] = {"promoted": None, "new_port": None, "fence_closed": None, "answered": 0}
    while time.time() < until:
        if seen["promoted"] is None:
            with contextlib.suppress(redis.RedisError, OSError):
                port = broker.group.primary_port()
                if port != old.port:
                    seen.update(promoted=time.time(), new_port=port)
        with contextlib.suppress(redis.RedisError, OSError):
            info = old.client(socket_timeout=1).info("replication")
            seen["answered"] += info.get("role") == "master"
            good = good_replicas(info)
            if broker.fenced and seen["fence_closed"] is None and good is not None and good < 1:
                seen["fence_closed"] = time.time()
        time.sleep(max(0.0, min(POLL, until - time.time())))  # the cut lasts until `until`
    return seen


def inject(broker: Broker, rng: random.Random, seconds: tuple[float, float],
           skipped: dict[str, str]) -> dict[str, Any]:
    """Settle, cut the primary the sentinels name off from its peers for the drawn duration,
    heal, wait for its demotion and the group to settle; the entry (module docstring)."""
    if KIND in skipped:
        return {"skipped": skipped[KIND]}
    switch, group = broker.switch, broker.group
    if switch is None or group is None:
        return {"skipped": "needs --partitions on a Sentinel broker (its nodes on a bridge, switch.py)"}
    began = time.monotonic()
    broker.settle(SETTLE_TIMEOUT)  # no cut on an unfinished failover
    settle_wait = time.monotonic() - began
    old = broker.current()
    node = switch.node_of(old.host)
    planned = rng.uniform(*seconds)
    cut_began = time.time()
    switch.isolate(node)
    cut = time.time()  # in force from here on
    try:
        seen = watch(broker, old, cut + planned)  # the fault itself: cut off this long
    finally:
        switch.heal(node)
    healed = time.time()
    moved = seen["promoted"] is not None
    with contextlib.suppress(redis.RedisError, OSError):
        moved = moved or group.primary_port() != old.port
    demoted = demoted_at(old, SETTLE_TIMEOUT) if moved else None
    broker.settle(SETTLE_TIMEOUT)
    new = broker.current()
    split_until = demoted if demoted is not None else healed
    fence = seen["fence_closed"]
    entry = {"t": cut, "cut_began": cut_began, "target": "primary", "old_primary": old.port, "node": old.host,
             "peers_cut": [switch.address(j) for j in range(switch.nodes) if j != node],
             "partitioned_seconds": round(healed - cut, 3), "healed": healed,
             "failover": moved or new.port != old.port, "new_primary": new.port,
             "old_answered_during_cut": seen["answered"], "split_until": split_until,
             "writes_until": fence if fence is not None and fence < split_until else split_until,
             "settled_seconds": round(time.time() - cut, 3)}
    for name, at in (("new_primary_seconds", seen["promoted"]), ("fence_closed_seconds", fence),
                     ("old_demoted_seconds", demoted)):
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
