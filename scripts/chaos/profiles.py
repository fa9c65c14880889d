"""Run profiles: how long, how fast, how many workers, which faults how often."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FAULT_KINDS = (
    "worker_kill", "worker_term", "worker_quit",
    "broker_restart", "client_kill", "script_flush", "broker_pause",
)
# With a Sentinel broker (redis-sentinel, valkey-sentinel) these join the schedule: SIGKILL of
# the primary (restarted a few seconds later, it rejoins as a replica) and SENTINEL FAILOVER.
SENTINEL_FAULT_KINDS = ("primary_kill", "sentinel_failover")
# With a cluster (redis-cluster, valkey-cluster): SIGKILL of a primary (its replica takes over;
# restarted a few seconds later, it rejoins as a replica) and CLUSTER FAILOVER on a replica.
CLUSTER_FAULT_KINDS = ("primary_kill", "cluster_failover")
# Power loss (issue 40 §2, scripts/chaos/aof.py): the broker SIGKILLed and its AOF cut back
# to the last fsync (power_loss), also torn inside an unfsynced command (power_loss_torn), or
# with a bad command in the fsynced part that only an operator's redis-check-aof --fix gets
# past (aof_corrupt). One server only (redis-aof, redis-aof-always, valkey, valkey-aof-always);
# picked with --faults, not in the default schedule.
POWER_LOSS_KINDS = ("power_loss", "power_loss_torn", "aof_corrupt")
# Flow control (issue 40 §4, scripts/chaos/flow.py): a flow queue paused 2-4 s, then resumed.
# With --flow only, and then in the default schedule.
FLOW_FAULT_KINDS = ("queue_pause",)
# Partitions (issue 40 §1, scripts/chaos/netns.py, partitions.py): one worker cut off from
# the broker both ways, the producer cut off, the broker's packets to one worker dropped (its
# own still arriving), and +200 ms of latency (netem; reported unavailable where the kernel
# has no netem). With --partitions only (one server), and then in the default schedule.
PARTITION_FAULT_KINDS = ("partition_worker", "partition_producer", "partition_oneway", "latency")
# The Jepsen split brain (scripts/chaos/switch.py, split_brain.py): a Sentinel group's primary cut
# off from its replicas and sentinels, not from its clients. With --partitions on a Sentinel
# broker only (each node in its own namespace on a bridge), and then in the default schedule.
SPLIT_BRAIN_KINDS = ("partition_primary",)
ALL_FAULT_KINDS = (FAULT_KINDS + tuple(dict.fromkeys(SENTINEL_FAULT_KINDS + CLUSTER_FAULT_KINDS))
                   + POWER_LOSS_KINDS + FLOW_FAULT_KINDS + PARTITION_FAULT_KINDS + SPLIT_BRAIN_KINDS)
WORKER_FAULTS = frozenset({"worker_kill", "worker_term", "worker_quit"})
# Faults that hit one worker (its ``target``): a duplicate or a lost event is theirs only when
# that worker held the task; the producer's partition explains no worker's duplicate.
TARGETED_FAULTS = WORKER_FAULTS | {"partition_worker", "partition_oneway"}
PRODUCER_FAULTS = frozenset({"partition_producer"})
# Faults that make no sense against kombu's stock Redis transport (it runs no scripts).
STOCK_SKIPS = {"script_flush": "kombu's stock Redis transport runs no Lua scripts"}


@dataclass(frozen=True)
class Profile:
    name: str
    load_seconds: float
    drain_seconds: float
    rate: float  # submissions per second
    first_fault: float  # seconds into the load phase
    fault_gap: tuple[float, float]  # seconds between faults (uniform)
    pause_seconds: tuple[float, float] = (2.0, 4.0)
    visibility_timeout: float = 6.0
    partition_seconds: tuple[float, float] = (2.0, 30.0)  # how long a partition lasts (uniform)
    slow_seconds: tuple[float, float] = (8.0, 10.0)  # longer than the visibility timeout
    countdown_seconds: tuple[float, float] = (1.0, 8.0)
    # kind -> share of submissions: fast, slow (> visibility), countdown, high priority
    mix: dict[str, float] = field(default_factory=lambda: {
        "fast": 0.57, "slow": 0.03, "countdown": 0.15, "priority": 0.15, "routed": 0.10})
    # (pool, concurrency) per worker
    workers: tuple[tuple[str, int], ...] = (("prefork", 2), ("prefork", 2), ("threads", 4))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PROFILES = {
    "smoke": Profile("smoke", load_seconds=120, drain_seconds=75, rate=10,
                     first_fault=8, fault_gap=(12, 16)),
    "long": Profile("long", load_seconds=1800, drain_seconds=120, rate=20,
                    first_fault=10, fault_gap=(15, 30)),
}
