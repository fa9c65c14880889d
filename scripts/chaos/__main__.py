"""``python -m scripts.chaos``: one chaos run, its verdict, its scorecard."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from scripts.chaos import faults, flow, ledger, netns, partitions, report, switch, verdict
from scripts.chaos.broker import BROKERS, EVENTS, HARNESS, PRODUCER, SENTINEL_REPLICAS, Broker
from scripts.chaos.cli import parse
from scripts.chaos.events import EventListener
from scripts.chaos.producer import Producer
from scripts.chaos.profiles import (
    FLOW_FAULT_KINDS,
    PARTITION_FAULT_KINDS,
    POWER_LOSS_KINDS,
    PROFILES,
    SPLIT_BRAIN_KINDS,
    Profile,
)
from scripts.chaos.workers import ChaosWorker
from scripts.servers import Server


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


def drain(profile: Profile, ledger_url: str, broker: Broker, transport: str,
          queues: tuple[str, ...] = verdict.QUEUES) -> float:
    """Wait (bounded) until every submission finished and the broker holds nothing (the
    broker being the primary the sentinels name now, for a Sentinel group). Once the broker
    holds nothing, tasks still unfinished are lost (a failover's unreplicated writes): no
    message is left to run them. The wait ends when that has stayed so, with the same count
    unfinished, longer than a slow task runs (a task a worker took without a late ack, off
    the broker, still finishes meanwhile), instead of running out the drain's bound."""
    began = time.monotonic()
    still, seen = began, None
    while time.monotonic() - began < profile.drain_seconds:
        records = ledger.read(ledger_url)
        finished = {entry["id"] for entry in records["finish"]}
        missing = sum(1 for entry in records["submit"] if entry["id"] not in finished)
        try:
            pending = verdict.broker_state(broker.client(socket_timeout=10), transport, queues)["pending"]
        except (redis.RedisError, OSError, TimeoutError):
            pending = None  # a failover still under way: ask again
        if not missing and pending == 0:
            break
        if (missing, pending) != seen:
            still, seen = time.monotonic(), (missing, pending)
        elif pending == 0 and time.monotonic() - still > profile.slow_seconds[1] + 2:
            break
        time.sleep(1)  # polling interval of a bounded wait
    return round(time.monotonic() - began, 1)


def settle(broker: Broker, card: dict[str, Any]) -> None:
    """A Sentinel group settled (its servers up, one primary, the replica online); a group
    that does not settle is recorded, and the run goes on to its verdict."""
    if not broker.replicated:
        return
    try:
        broker.settle(faults.SETTLE_TIMEOUT)
    except (TimeoutError, redis.RedisError, OSError, RuntimeError) as error:
        card["run"].setdefault("settle_errors", []).append(repr(error)[:300])
        log(f"sentinel group did not settle: {error!r}")


def partition_network(profile: Profile, card: dict[str, Any],
                      broker: str) -> netns.Topology | switch.Switch | None:
    """With --partitions: the broker's namespace and the clients' pairs (one server), or the
    Sentinel group's or the cluster's switch, made now, with the producer and each worker in
    a namespace of their own on it (to be cut off on their own; the harness, the event
    receiver and the ledger stay in the root namespace); or None, said loudly and recorded,
    with every partition kind skipped and why. Latency needs netem, probed separately (this
    kernel has none), and is not made on a switch yet."""
    topology = BROKERS[broker][2]
    bridged = topology in ("sentinel", "cluster")
    why = switch.switch_unavailable() if bridged else netns.unavailable()
    kinds = PARTITION_FAULT_KINDS + SPLIT_BRAIN_KINDS
    skips = dict.fromkeys(kinds, f"no network namespaces: {why}") if why else {}
    if not why:  # partition_primary, on one server, skips itself (split_brain.inject)
        netem = netns.netem_unavailable()
        if netem or bridged:
            skips["latency"] = netem or "not yet on a switch (netem on each client's veth: not made)"
    card["run"]["partitions"] = {"namespaces": why or "available", "skipped": skips}
    for kind, reason in skips.items():
        log(f"PARTITIONS: {kind} will be SKIPPED: {reason}")
    if why:
        return None
    workers = tuple(f"w{i}-{pool}" for i, (pool, _) in enumerate(profile.workers, 1))
    if topology == "cluster":  # three primaries and a replica each (broker.py), a namespace each
        return switch.Switch(3 * 2, clients=(PRODUCER, *workers)).create()
    if topology == "sentinel":
        # the primary, the replicas and the three sentinels (broker.py), a namespace each
        return switch.Switch(1 + SENTINEL_REPLICAS.get(broker, 1) + 3, clients=(PRODUCER, *workers)).create()
    return netns.Topology((HARNESS, EVENTS, PRODUCER, *workers)).create()


def run_profile(args: argparse.Namespace) -> Profile:
    """The profile named, with the command line's overrides."""
    profile = PROFILES[args.profile]
    if args.load_seconds:
        profile = replace(profile, load_seconds=args.load_seconds)
    if args.visibility_timeout:
        profile = replace(profile, visibility_timeout=args.visibility_timeout)
    if args.partition_seconds:
        profile = replace(profile, partition_seconds=args.partition_seconds)
    return profile


def transport_options(args: argparse.Namespace, profile: Profile, broker: Broker) -> dict[str, Any]:
    """Every client's broker_transport_options (the workers', the producer's, the listener's)."""
    options: dict[str, Any] = {"visibility_timeout": profile.visibility_timeout,
                               **broker.transport_options()}
    if args.socket_timeout:
        options.update(socket_timeout=args.socket_timeout, socket_connect_timeout=args.socket_timeout)
    if args.transport == "ours":
        # Bindings of the expiring queue then live 60 s (its x-expires) and must be refreshed
        # throughout; the floor is lowered so a run sees them stale at once if they are not.
        options.update(sweep_interval=1, binding_lifetime_floor=10)
        if args.durability:
            options["durability"] = args.durability
        if args.durability_timeout:
            options["durability_timeout"] = args.durability_timeout
        if args.fence_timeout is not None:
            options["fence_timeout"] = args.fence_timeout
    return options


def start_workers(args: argparse.Namespace, profile: Profile, broker: Broker, env: dict[str, str],
                  log_dir: Path) -> list[ChaosWorker]:
    """The profile's workers, started; with --partitions each reaches the broker by its own
    pair (one server) or from its own namespace (a switch)."""
    workers = []
    for i, (pool, concurrency) in enumerate(profile.workers, 1):
        name = f"w{i}-{pool}"
        worker_env = {**env, "CHAOS_BROKER_URL": broker.url(args.transport, name)}
        prefix = tuple(broker.switch.exec_prefix(name)) if broker.switch and broker.switch.clients else ()
        workers.append(ChaosWorker(name, pool, concurrency, worker_env, log_dir, prefix=prefix))
        workers[-1].start()
    return workers


def apply_schedule(plan: list[tuple[float, str]], injector: faults.FaultInjector, began: float,
                   ledger_url: str) -> tuple[float, float]:
    """Inject the planned faults at their times; returns (lag, calm_until). After a partition
    the next fault waits (partitions.CALM_SECONDS) and the rest of the schedule, with the end
    of the load, moves back by as much (the lag): the gaps are kept."""
    lag = calm_until = 0.0
    for at, fault in plan:
        due = max(began + at + lag, calm_until)
        lag = due - began - at
        time.sleep(max(0.0, due - time.monotonic()))  # the schedule, not a sync
        try:
            entry = injector.inject(fault)
        except Exception as error:  # recorded; the run goes on to its verdict
            entry = {"kind": fault, "t": time.time(), "error": repr(error)[:300]}
            ledger.record("fault", ledger_url, **entry)
        quiet = ("kind", "t", "server_said", "lost_task_ids", "refusal",  # in the scorecard
                 "acked", "resumed", "resume_acked")
        log(f"t+{time.monotonic() - began:6.1f}s {fault}: "
            f"{ {k: v for k, v in entry.items() if k not in quiet} }")
        if "healed" in entry:  # the calm counts from the heal (a split brain's fault returns later)
            calm = entry["healed"] + partitions.CALM_SECONDS - time.time()
            calm_until = time.monotonic() + max(0.0, calm)
    return lag, calm_until


def make_broker(args: argparse.Namespace, profile: Profile, card: dict[str, Any],
                kinds: tuple[str, ...] | None) -> Broker:
    """The broker, not started; with --partitions in its network (what it could not make is
    recorded in the card), which goes if the broker cannot be made."""
    network = partition_network(profile, card, args.broker) if args.partitions else None
    try:
        return Broker.create(args.broker, fsync_recorder=bool(kinds and set(kinds) & set(POWER_LOSS_KINDS)),
                             network=network if isinstance(network, netns.Topology) else None,
                             switch=network if isinstance(network, switch.Switch) else None)
    except BaseException:
        if network is not None:
            network.destroy()
        raise


def worker_env(args: argparse.Namespace, ledger_url: str, options: dict[str, Any]) -> dict[str, str]:
    """What the workers read (scripts/chaos/app.py), but for their broker URL."""
    env = {"CHAOS_LEDGER_URL": ledger_url, "CHAOS_TRANSPORT_OPTIONS": json.dumps(options),
           "CHAOS_ACKS_LATE": "0" if args.no_acks_late else "1"}
    if args.flow:
        env.update(CHAOS_FLOW="1", CHAOS_QUEUES=",".join(verdict.chaos_queues(True)))
    if args.shards:
        env["CHAOS_SHARDS"] = str(args.shards)
    return env


def fault_plan(args: argparse.Namespace, profile: Profile, broker: Broker,
               kinds: tuple[str, ...] | None) -> list[tuple[float, str]]:
    """The seeded schedule: the kinds asked for, else every kind the broker and flags allow."""
    return faults.schedule(profile, args.seed, kinds or faults.fault_kinds(broker)
                           + (FLOW_FAULT_KINDS if args.flow else ())
                           + (PARTITION_FAULT_KINDS if args.partitions else ())
                           + (SPLIT_BRAIN_KINDS if args.partitions and broker.replicated else ()))


def conclude(args: argparse.Namespace, profile: Profile, broker: Broker, card: dict[str, Any],
             workers: list[ChaosWorker], listener: EventListener, ledger_url: str,
             queues: tuple[str, ...], log_dir: Path) -> None:
    """After the load: dead workers back, the drain, the broker's state and the verdict, into
    the card (the ledger kept in ``log_dir`` for a post-mortem)."""
    for worker in workers:
        if not worker.alive:
            worker.reap(5)
            worker.start()
    settle(broker, card)  # a failover the last fault set off ends before the drain
    card["run"]["drain_seconds_used"] = drain(profile, ledger_url, broker, args.transport, queues)
    listener.stop()
    settle(broker, card)
    if broker.replicated:
        card["run"]["primary_at_end"] = broker.current().port
    state = verdict.broker_state(broker.client(socket_timeout=10), args.transport, queues)
    records = ledger.read(ledger_url)
    (log_dir / "ledger.json").write_text(json.dumps(records))
    card["verdict"] = verdict.compute(records, state, profile, args.transport, args.durability,
                                      card["run"].get("flow_settings"))
    card["faults"] = records["fault"]
    if broker.replicated:  # what the servers refused over the run (NOREPLICAS: the fence)
        card["run"]["server_errors"] = broker.refusals()


def run_settings(args: argparse.Namespace, profile: Profile, options: dict[str, Any],
                 log_dir: Path) -> dict[str, Any]:
    """The scorecard's record of how the run was made."""
    return {"transport": args.transport, "broker": args.broker, "profile": args.profile,
            "seed": args.seed, "acks_late": not args.no_acks_late, "log_dir": str(log_dir),
            "durability": args.durability, "fault_kinds": list(args.faults) if args.faults else None,
            "shards": args.shards, "together": args.together, "fence_timeout": args.fence_timeout,
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "make chaos ARGS=" + shlex.quote(" ".join(sys.argv[1:])),
            "transport_options": options, "profile_settings": profile.as_dict()}


def start_flow(args: argparse.Namespace, broker_url: str, options: dict[str, Any],
               card: dict[str, Any]) -> Celery | None:
    """With --flow, the app that sets the cap (before any load: the workers declared the
    flow queues) and pauses and resumes a queue in the schedule."""
    if not args.flow:
        return None
    flow_app = Celery("chaos-flow", broker=broker_url, set_as_current=False)
    flow_app.conf.broker_transport_options = options
    card["run"]["flow_settings"] = {**flow.settings(), "limits": flow.apply_limit(flow_app)}
    log(f"flow: {card['run']['flow_settings']}")
    return flow_app


def start_servers(broker: Broker) -> Server:
    """The ledger's server and the broker, started; returns the ledger's. On a switch the
    ledger listens on the bridge's address too: the workers' and the producer's namespaces
    reach it there (never cut: a cut drops only the nodes' addresses)."""
    try:
        ledger_server = Server("valkey", address=broker.switch.gateway if broker.switch else None).start()
        broker.start()
    except BaseException:
        broker.stop()  # with --partitions, its namespace and pairs too
        raise
    return ledger_server


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = run_profile(args)
    log_dir = Path(tempfile.mkdtemp(prefix="crl-chaos-"))
    kinds = args.faults or None
    card: dict[str, Any] = {"run": {}}
    broker = make_broker(args, profile, card, kinds)
    options = transport_options(args, profile, broker)
    card["run"].update(run_settings(args, profile, options, log_dir))
    broker.shards = args.shards
    # every queue that holds the chaos queues' messages: the shards too (--shards)
    queues = tuple(member for queue in verdict.chaos_queues(args.flow) for member in broker.members(queue))
    ledger_server = start_servers(broker)
    flow_app: Celery | None = None
    workers: list[ChaosWorker] = []
    producer: Producer | None = None
    listener: EventListener | None = None
    try:
        broker_url = broker.url(args.transport)
        card["run"]["server"] = broker.describe()
        card["run"]["topology"] = broker.topology()
        workers += start_workers(args, profile, broker, worker_env(args, ledger_server.url, options), log_dir)
        log(f"{len(workers)} workers up; {args.transport} on {card['run']['server']}; logs {log_dir}")
        flow_app = start_flow(args, broker_url, options, card)
        listener = EventListener(broker.url(args.transport, EVENTS), options, ledger_server.url)
        listener.start()
        injector = faults.FaultInjector(broker, workers, args.transport, profile,
                                        ledger_server.url, args.seed, flow_app,
                                        card["run"].get("partitions", {}).get("skipped"))
        if broker.recorder_error:
            log(f"power loss will be skipped: {broker.recorder_error}")
            card["run"]["recorder_error"] = broker.recorder_error
        card["run"]["fault_plan"] = plan = fault_plan(args, profile, broker, kinds)
        producer = Producer(broker.url(args.transport, PRODUCER), options, ledger_server.url, profile,
                            args.seed, args.flow, args.shards, args.together or 0,
                            broker.switch.client_namespace(PRODUCER) if broker.switch else None)
        began = time.monotonic()
        producer.start()
        lag, calm_until = apply_schedule(plan, injector, began, ledger_server.url)
        load_until = max(began + profile.load_seconds + lag, calm_until)
        time.sleep(max(0.0, load_until - time.monotonic()))
        if lag:
            card["run"]["schedule_lag_seconds"] = round(lag, 1)
        producer.stop()
        log(f"load over: sent {producer.sent}, submit errors {producer.errors}; draining")
        conclude(args, profile, broker, card, workers, listener, ledger_server.url, queues, log_dir)
    finally:
        if producer is not None and producer.is_alive():
            producer.stop()
        if listener is not None and listener.is_alive():
            listener.stop()
        if flow_app is not None:
            flow_app.close()
        for worker in workers:
            worker.stop()
        broker.stop()
        ledger_server.stop()
    return card


def recompute(path: Path) -> dict[str, Any]:
    """A run's scorecard with its verdict computed again from its ledger (same faults, same
    executions, the broker state it recorded) under the rules of this version."""
    card = json.loads(path.read_text())
    records = json.loads((Path(card["run"]["log_dir"]) / "ledger.json").read_text())
    profile = Profile(**{**card["run"]["profile_settings"],
                         "fault_gap": tuple(card["run"]["profile_settings"]["fault_gap"])})
    previous = card["verdict"]["verdict"]
    card["verdict"] = verdict.compute(records, card["verdict"]["broker"], profile, card["run"]["transport"],
                                      card["run"].get("durability"), card["run"].get("flow_settings"))
    card["run"]["recomputed"] = {"from": path.name, "verdict_then": previous,
                                 "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return card


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.jepsen_table:
        print(report.jepsen_table([json.loads(Path(path).read_text()) for path in args.jepsen_table]))
        return 0
    card = recompute(Path(args.verdict_of)) if args.verdict_of else run(args)
    path = report.write(card)
    if not args.no_doc:
        path = report.keep(path)
        report.append_doc(card, path)
    print(report.summary(card, path))
    return 0 if card["verdict"]["verdict"] in ("PASS", "REPORT") else 1


if __name__ == "__main__":
    sys.exit(main())
