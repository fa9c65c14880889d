"""Faults on a seeded schedule. Each is logged to the ledger with its time, target and
outcome. Runs in the main thread: servers die with the thread that started them
(PR_SET_PDEATHSIG), so a broker restarted from another thread would die with it.

With a Sentinel broker every broker fault acts on the primary the sentinels name at that
moment, after waiting for the group to be settled (one primary, the replica linked), so
faults do not stack on an unfinished failover. With a cluster, half the broker faults act on
the primary that owns the main queue and half on a random primary (the remote-control and
event streams live on the others), after waiting for the cluster to be healthy; the entry
names the chaos queues that primary held (``queues``). An entry whose fault moved the primary has
``failover: true``, the old and new primary ports, and ``writes_until``: the last moment
the old primary could still accept a write that the new one never got (its death for a
SIGKILL; its demotion to a replica when it was still running)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import redis

from scripts.chaos import aof, flow, ledger, partitions, split_brain
from scripts.chaos.broker import Broker
from scripts.chaos.profiles import (
    CLUSTER_FAULT_KINDS,
    FAULT_KINDS,
    FLOW_FAULT_KINDS,
    PARTITION_FAULT_KINDS,
    POWER_LOSS_KINDS,
    SENTINEL_FAULT_KINDS,
    SPLIT_BRAIN_KINDS,
    STOCK_SKIPS,
    Profile,
)
from scripts.chaos.verdict import chaos_queues
from scripts.chaos.workers import ChaosWorker
from scripts.servers import Server

WORKER_SIGNALS = {"worker_kill": signal.SIGKILL, "worker_term": signal.SIGTERM,
                  "worker_quit": signal.SIGQUIT}


# A killed primary is started again this long after the SIGKILL (same port, same AOF); the
# sentinels then make it a replica of the primary they chose.
PRIMARY_RESTART_AFTER = 5.0
# After a pause or a restart of the primary, how long to watch for a failover the fault set
# off (the sentinels' down-after is 1 s; an election and a promotion take a few more).
FAILOVER_WATCH_SECONDS = 12.0
SETTLE_TIMEOUT = 60.0


def fault_kinds(broker: Broker) -> tuple[str, ...]:
    if broker.cluster is not None:
        return FAULT_KINDS + CLUSTER_FAULT_KINDS
    return FAULT_KINDS + SENTINEL_FAULT_KINDS if broker.sentinel else FAULT_KINDS


def schedule(profile: Profile, seed: int,
             kinds: tuple[str, ...] = FAULT_KINDS) -> list[tuple[float, str]]:
    """(seconds into the load phase, fault kind); every kind once per shuffled round."""
    rng = random.Random(seed)
    plan: list[tuple[float, str]] = []
    at, bag = profile.first_fault, []
    while at < profile.load_seconds - 5:
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        plan.append((round(at, 2), bag.pop()))
        at += rng.uniform(*profile.fault_gap)
    return plan


@dataclass
class FaultInjector:
    broker: Broker
    workers: list[ChaosWorker]
    transport: str
    profile: Profile
    ledger_url: str
    seed: int
    flow_app: Any = None  # with --flow: the Celery app queue_pause pauses through
    # with --partitions: partition kinds this host cannot make -> why (netns.py's probes)
    partition_skips: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed * 31 + 5)
        self.power_losses = 0

    def admin(self, server: Server) -> Any:
        return server.client(socket_timeout=10)

    def inject(self, kind: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"kind": kind, "t": time.time()}
        if self.transport == "stock" and kind in STOCK_SKIPS:
            entry.update(skipped=STOCK_SKIPS[kind])
        elif kind in WORKER_SIGNALS:
            entry.update(self.worker_fault(kind))
        elif kind in POWER_LOSS_KINDS:
            entry.update(self.power_loss(kind))
        elif kind in FLOW_FAULT_KINDS:
            if self.flow_app is None:
                entry.update(skipped="a flow fault needs --flow")
            else:
                entry.update(flow.pause_fault(self.flow_app, self.rng, self.profile.pause_seconds))
        elif kind in PARTITION_FAULT_KINDS:
            network = self.broker.network or self.broker.switch  # one server's pairs, or the switch
            entry.update(partitions.inject(kind, network, self.workers, self.rng,
                                           self.profile.partition_seconds, self.partition_skips or {}))
        elif kind in SPLIT_BRAIN_KINDS:  # its own settle, cut, heal and watch of the failover
            entry.update(split_brain.inject(self.broker, self.rng, self.profile.partition_seconds,
                                            self.partition_skips or {}))
        elif kind in SENTINEL_FAULT_KINDS + CLUSTER_FAULT_KINDS and not self.broker.replicated:
            entry.update(skipped="needs a Sentinel broker or a cluster")
        else:
            entry.update(self.broker_fault(kind))
        ledger.record("fault", self.ledger_url, **entry)
        return entry

    def broker_fault(self, kind: str) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        if self.broker.replicated:
            began = time.monotonic()
            try:
                self.broker.settle(SETTLE_TIMEOUT)
            except (TimeoutError, redis.RedisError, OSError) as error:
                entry["settle_error"] = repr(error)[:300]
            waited = time.monotonic() - began
            if waited > 0.2:
                entry["settle_wait_seconds"] = round(waited, 3)
        try:
            server = self.target()
            entry.update(t=time.time(), server_port=server.port)
            if self.broker.cluster is not None:
                # the flow queues too (--flow): a failover explains their losses alike
                entry["queues"] = self.broker.owned_queues(server, chaos_queues(self.flow_app is not None))
            if kind in ("broker_restart", "primary_kill"):
                self.broker.bank_errors(server)  # its error counts, before the kill resets them
            if kind == "broker_restart":
                server.kill()
                self.broker.start_again(server, None)  # the primary comes back a primary
                entry["down_seconds"] = round(time.time() - entry["t"], 3)
                entry.update(self.watch_failover(server, entry["t"]))
            elif kind == "client_kill":
                admin = self.admin(server)
                entry["killed"] = admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                admin.close()
            elif kind == "script_flush":
                admin = self.admin(server)
                admin.script_flush()
                admin.close()
            elif kind == "broker_pause":
                entry.update(self.pause(server))
                entry.update(self.watch_failover(server, entry["t"]))
            elif kind == "primary_kill":
                entry.update(self.primary_kill(server, entry["t"]))
            elif kind == "cluster_failover":
                entry.update(self.cluster_failover(server, entry["t"]))
            elif kind == "sentinel_failover":
                entry.update(self.sentinel_failover(server, entry["t"]))
        except (TimeoutError, redis.RedisError, OSError, RuntimeError) as error:
            entry["error"] = repr(error)[:300]
        return entry

    def target(self) -> Server:
        """The primary a broker fault hits (see the module's docstring)."""
        cluster = self.broker.cluster
        if cluster is None or self.rng.random() < 0.5:
            return self.broker.current()
        return self.rng.choice(cluster.primaries())

    def cluster_failover(self, old: Server, t: float) -> dict[str, Any]:
        """CLUSTER FAILOVER on the primary's replica: the primary stops taking writes, the
        replica catches up and takes over, the old primary becomes its replica."""
        cluster = self.broker.cluster
        assert cluster is not None
        new = cluster.failover(old, timeout=SETTLE_TIMEOUT)
        demoted = time.time()
        self.broker.settle(SETTLE_TIMEOUT)
        return {"failover": True, "old_primary": old.port, "new_primary": new.port,
                "writes_until": demoted, "old_demoted_seconds": round(demoted - t, 3),
                "settled_seconds": round(time.time() - t, 3)}

    def primary_kill(self, server: Server, t: float) -> dict[str, Any]:
        """SIGKILL the primary (``server``, on a cluster); the sentinels (or the cluster)
        promote its replica; the killed server is started again PRIMARY_RESTART_AFTER seconds
        after the kill and rejoins as a replica."""
        if self.broker.cluster is not None:
            killed, new = server, self.broker.cluster.kill_primary(server, timeout=SETTLE_TIMEOUT)
        else:
            assert self.broker.group is not None
            killed, new = self.broker.group.kill_primary(timeout=SETTLE_TIMEOUT)
        named = time.time()
        time.sleep(max(0.0, t + PRIMARY_RESTART_AFTER - time.time()))  # the fault: down this long
        self.broker.start_again(killed, None)  # a primary as its config says, demoted later
        restarted = time.time()
        self.broker.settle(SETTLE_TIMEOUT)
        return {"failover": True, "old_primary": killed.port, "new_primary": new.port,
                "new_primary_seconds": round(named - t, 3), "writes_until": t,
                "restarted_after_seconds": round(restarted - t, 3),
                "rejoined_seconds": round(time.time() - t, 3)}

    def sentinel_failover(self, old: Server, t: float) -> dict[str, Any]:
        """SENTINEL FAILOVER: the replica is promoted at once; the old primary keeps its
        clients (and accepts their writes) until the sentinels demote it."""
        group = self.broker.group
        assert group is not None
        new = group.failover(timeout=SETTLE_TIMEOUT)
        named = time.time()
        demoted = self.wait_demoted(old, SETTLE_TIMEOUT)
        self.broker.settle(SETTLE_TIMEOUT)
        return {"failover": True, "old_primary": old.port, "new_primary": new.port,
                "new_primary_seconds": round(named - t, 3),
                "writes_until": demoted if demoted is not None else time.time(),
                "old_demoted_seconds": round(demoted - t, 3) if demoted is not None else None,
                "settled_seconds": round(time.time() - t, 3)}

    def watch_failover(self, old: Server, t: float) -> dict[str, Any]:
        """After a pause or restart of the primary: did the sentinels move it? Watched for
        FAILOVER_WATCH_SECONDS from the fault; once they name another primary, until the
        old server answers as a replica (the sentinels demote a live old primary on their
        next INFO round, up to 10 s later), then until the group settles. On a cluster: did
        the old primary's replica take over (the old one answers as a replica)?"""
        if self.broker.cluster is not None:
            return self.watch_cluster_failover(old, t)
        if not self.broker.sentinel:
            return {}
        group = self.broker.group
        assert group is not None
        deadline = t + FAILOVER_WATCH_SECONDS
        demoted = None
        while time.time() < deadline and demoted is None:
            demoted = self.wait_demoted(old, 0.5)
            with contextlib.suppress(redis.RedisError, OSError):
                if group.primary_port() != old.port:
                    demoted = demoted or self.wait_demoted(old, SETTLE_TIMEOUT)
                    break
        self.broker.settle(SETTLE_TIMEOUT)
        new = self.broker.current()
        if demoted is None and new.port == old.port:
            return {"failover": False, "settled_seconds": round(time.time() - t, 3)}
        return {"failover": True, "old_primary": old.port, "new_primary": new.port,
                "writes_until": demoted if demoted is not None else time.time(),
                "old_demoted_seconds": round(demoted - t, 3) if demoted is not None else None,
                "settled_seconds": round(time.time() - t, 3)}

    def watch_cluster_failover(self, old: Server, t: float) -> dict[str, Any]:
        demoted = None
        while time.time() < t + FAILOVER_WATCH_SECONDS and demoted is None:
            demoted = self.wait_demoted(old, 0.5)
        self.broker.settle(SETTLE_TIMEOUT)
        if demoted is None:
            return {"failover": False, "settled_seconds": round(time.time() - t, 3)}
        return {"failover": True, "old_primary": old.port, "writes_until": demoted,
                "old_demoted_seconds": round(demoted - t, 3), "settled_seconds": round(time.time() - t, 3)}

    @staticmethod
    def wait_demoted(server: Server, timeout: float) -> float | None:
        """When ``server`` first answered as a replica (None if not within ``timeout``)."""
        return split_brain.demoted_at(server, timeout)

    def worker_fault(self, kind: str) -> dict[str, Any]:
        worker = self.rng.choice(self.workers)
        sent = time.time()
        worker.signal(WORKER_SIGNALS[kind])
        grace = 10 if kind == "worker_kill" else self.profile.slow_seconds[1] + 20
        waited = worker.reap(grace)
        exit_code = worker.process.returncode if worker.process else None
        worker.start()
        return {"t": sent, "target": worker.hostname, "pool": worker.pool,
                "exit_seconds": round(waited, 3), "down_seconds": round(time.time() - sent, 3),
                "exit_code": exit_code}

    def power_loss(self, kind: str) -> dict[str, Any]:
        """SIGKILL and the AOF cut back to the last fsync (aof.py); the entry's ``t`` is the
        kill. If the fault fails half-way, the server is started again (on whatever AOF it
        has) so that the run goes on, and the entry says so."""
        if self.broker.replicated:
            return {"skipped": "power loss is injected on one server (redis-aof, valkey, ...); "
                               "not yet on a Sentinel group or a cluster"}
        if self.broker.fsync_log is None:
            return {"skipped": self.broker.recorder_error or "the broker runs without the fsync recorder"}
        server = self.broker.current()
        self.power_losses += 1
        entry: dict[str, Any]
        try:
            entry = aof.power_loss(server, self.broker.fsync_log, kind, self.rng, self.power_losses)
            return {**entry, "t": entry["killed_at"], "server_port": server.port}
        except (RuntimeError, TimeoutError, OSError, redis.RedisError, subprocess.SubprocessError) as error:
            entry = {"error": repr(error)[:300]}
            if server.process is None or server.process.poll() is not None:
                try:
                    server.start(timeout=60)
                    entry["restarted_after_error"] = True
                except (RuntimeError, TimeoutError) as again:
                    entry["restart_error"] = repr(again)[:300]
            return entry

    def pause(self, server: Server) -> dict[str, Any]:
        assert server.process is not None
        seconds = self.rng.uniform(*self.profile.pause_seconds)
        pid = server.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault itself: the broker is stopped this long
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"paused_seconds": round(seconds, 3)}
