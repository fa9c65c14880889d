"""What explains a loss the verdict (verdict.py) finds: a lost task by a failover's
unreplicated writes, a power loss's fsync window or an AOF repair; a lost task event by a
fault while its worker held the task, or by the event receiver's own restart."""

from __future__ import annotations

from typing import Any

from scripts.chaos import jepsen
from scripts.chaos.profiles import PRODUCER_FAULTS, TARGETED_FAULTS

# A task's events are lost when a connection fault hits while its worker holds the task:
# Celery disables the event dispatcher of a connection that dropped, and a request that
# runs across the reconnect still sends through the old one (its events go nowhere); a
# broker restart also loses the last second of writes (AOF everysec). So a lost event is
# explained by a fault between the task's eligibility and EVENT_AFTER seconds after its
# finish (the events are flushed about then).
EVENT_AFTER = 2.0
# Replication is asynchronous: a write the primary confirmed can be missing on the replica
# the sentinels promote. A lost task is explained by such a failover when durability is off
# and its publish ran between REPLICATION_LAG seconds before the fault and the moment the
# old primary stopped taking writes (``writes_until``: its SIGKILL, or its demotion when it
# was still up and its clients kept writing to it; for a split brain, partition_primary, the
# demotion after the heal or, on a fenced group, the fence's closing if earlier: after it the
# isolated primary refused every write, and a write confirmed then was the new primary's),
# plus ms-rounding slack.
REPLICATION_LAG = 1.0
# When the event receiver itself failed (an exception ended it; it is started again after
# 1 s and reconnects), the events of tasks finished meanwhile had no listener: a loss
# explained by the receiver's restart, from EVENT_AFTER before it to this long after.
LISTENER_DOWN = 5.0
WRITES_UNTIL_SLACK = 0.5


def events_lost(records: dict[str, list[dict[str, Any]]], finishes: dict[str, list[dict[str, Any]]],
                faults: list[dict[str, Any]], submits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Tasks that finished but whose ``task-succeeded`` event never reached the receiver;
    explained when a fault (broker-wide, or on the worker that ran it) hit while the worker
    held the task: from its eligibility to EVENT_AFTER seconds after its finish."""
    received = {entry["id"] for entry in records.get("event", [])}
    lost = [tid for tid in finishes if tid not in received]
    restarts = [entry["t"] for entry in records.get("listener_error", [])]
    unexplained, while_restarting = [], 0
    for tid in lost:
        finish = finishes[tid][-1]
        if any(t - EVENT_AFTER <= finish["t"] <= t + LISTENER_DOWN for t in restarts):
            while_restarting += 1  # the receiver itself was down: nothing listened
            continue
        held_from = submits[tid]["eligible"] - 1.0 if tid in submits else finish["t"] - 1.0
        # a failover lasts until the old primary stops serving (served_until): an event
        # published to it meanwhile is gone with its demotion
        if not any(held_from <= jepsen.served_until(f) and f["t"] <= finish["t"] + EVENT_AFTER and (
                f["kind"] not in TARGETED_FAULTS | PRODUCER_FAULTS or f.get("target") == finish["worker"])
                for f in faults if not f.get("skipped")):
            unexplained.append(tid)
    return {"events_received": len(received), "events_lost": len(lost),
            "listener_restarts": len(restarts), "events_lost_listener_down": while_restarting,
            "listener_errors": [e["error"] for e in records.get("listener_error", [])][:10],
            "events_lost_unexplained": len(unexplained), "events_lost_examples": unexplained[:20]}


def lost_to_failover(submit: dict[str, Any], failovers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failover whose unreplicated writes explain a lost task (see REPLICATION_LAG). On a
    cluster only a failover of the primary holding the task's queue does."""
    queue = jepsen.queue_of(submit)  # the queue its publish went to (a flow queue with --flow)
    for fault in failovers:
        if "queues" in fault and queue not in fault["queues"]:
            continue
        if fault["t"] - REPLICATION_LAG <= submit.get("sent", submit["t"]) \
                and submit["t"] <= fault.get("writes_until", fault["t"]) + WRITES_UNTIL_SLACK:
            return fault
    return None


def lost_to_power_loss(submit: dict[str, Any], power_losses: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The power loss whose fsync window holds a lost task's publish (scripts/chaos/aof.py):
    confirmed (its publish returned) at or after ``durable_until``, the start of the last
    fsync whose bytes the server kept, and begun before the kill. A publish confirmed
    before that fsync began had been written before it, so it was on disk: its loss is no
    power loss's doing."""
    for fault in power_losses:
        until = fault.get("durable_until")
        if until is not None and until <= submit.get("sent", submit["t"]) \
                and submit["t"] <= fault.get("killed_at", fault["t"]):
            return fault
    return None


def lost_to_repair(tid: str, power_losses: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The corrupt AOF whose repair (redis-check-aof --fix, an operator's action) cut the
    bytes holding the task's publish (its id among the ids in the bytes cut)."""
    return next((f for f in power_losses if f.get("repair") and tid in f.get("lost_task_ids", ())), None)
