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

from celery_redis_lua.protocol.shards import MAX_SHARDS
from scripts.chaos import faults, flow, ledger, netns, partitions, report, switch, verdict
from scripts.chaos.broker import BROKERS, EVENTS, HARNESS, PRODUCER, SENTINEL_REPLICAS, Broker
from scripts.chaos.events import EventListener
from scripts.chaos.producer import Producer
from scripts.chaos.profiles import (
    ALL_FAULT_KINDS,
    FLOW_FAULT_KINDS,
    PARTITION_FAULT_KINDS,
    POWER_LOSS_KINDS,
    PROFILES,
    SPLIT_BRAIN_KINDS,
    Profile,
)
from scripts.chaos.workers import ChaosWorker
from scripts.servers import Server


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.chaos", description=__doc__)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="smoke")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--broker", choices=sorted(BROKERS), default="valkey")
    parser.add_argument("--transport", choices=("ours", "stock"), default="ours")
    parser.add_argument("--load-seconds", type=float, help="override the profile's load phase")
    parser.add_argument("--visibility-timeout", type=float, metavar="SECONDS",
                        help="override the profile's visibility timeout (6 s): e.g. above the time a "
                             "fenced group refuses writes after a failover")
    parser.add_argument("--no-acks-late", action="store_true")
    parser.add_argument("--durability", metavar="SETTING",
                        help="ours only: the 'durability' transport option ('replicas:1', 'aof', "
                             "'aof+replicas:1'): a publish waits until the write is confirmed")
    parser.add_argument("--durability-timeout", type=float, metavar="SECONDS",
                        help="ours only: the 'durability_timeout' transport option (default 1.0)")
    parser.add_argument("--faults", metavar="KIND,...",
                        help="the fault kinds of the schedule, comma-separated (default: every kind "
                             "the broker allows, power loss excepted); e.g. power_loss,worker_kill. "
                             f"Kinds: {', '.join(ALL_FAULT_KINDS)}")
    parser.add_argument("--flow", action="store_true",
                        help="ours only: flow control under faults (scripts/chaos/flow.py): a queue "
                             f"under 'limit --in-flight {flow.CAP}', a queue with x-delayed-retry-*, "
                             "queue_pause in the schedule, and the verdict's flow checks")
    parser.add_argument("--shards", type=int, metavar="N",
                        help="ours only: the default queue declared with x-shards N "
                             f"(2..{MAX_SHARDS}; docs/sharding.md); the order check is per shard")
    parser.add_argument("--together", type=int, metavar="N",
                        help="ours only: the producer sends its tasks in confirm_together() blocks of N "
                             "(2..1000), each task confirmed when its block ends (a Celery group's way)")
    parser.add_argument("--partitions", action="store_true",
                        help="one server: the broker in its own network namespace, a veth pair per "
                             "client (scripts/chaos/netns.py), and partition_worker, partition_producer, "
                             "partition_oneway and latency in the schedule; a Sentinel group or a "
                             "cluster: each node, the producer and each worker in its own namespace on "
                             "a bridge (switch.py; cluster nodes announce their bridge address), and "
                             "partition_worker, partition_producer, partition_oneway and "
                             "partition_primary, the split brain, in the schedule (latency not yet); "
                             "kinds this host cannot make are skipped, and said so")
    parser.add_argument("--partition-seconds", metavar="MIN,MAX",
                        help="how long a partition lasts, drawn uniformly (default: the profile's, 2,30)")
    parser.add_argument("--socket-timeout", type=float, metavar="SECONDS",
                        help="the socket_timeout and socket_connect_timeout transport options of every "
                             "client (default: none, redis-py's: a read waits for TCP itself)")
    parser.add_argument("--fence-timeout", type=float, metavar="SECONDS",
                        help="ours only: the fence_timeout transport option of every client (default: "
                             "the transport's, 10 s)")
    parser.add_argument("--no-doc", action="store_true", help="do not append to docs/RELIABILITY.md")
    parser.add_argument("--verdict-of", metavar="SCORECARD",
                        help="no run: recompute the verdict of a run from its ledger (kept in the "
                             "scorecard's log_dir) under the current rules, as a new scorecard")
    parser.add_argument("--jepsen-table", nargs="+", metavar="SCORECARD",
                        help="no run: print the Jepsen-format table of docs/faults.md, a column "
                             "per scorecard")
    args = parser.parse_args(argv)
    if args.transport == "stock" and (args.durability or args.durability_timeout):
        parser.error("--durability is an option of our transport only")
    if args.transport == "stock" and args.broker.endswith("-cluster"):
        parser.error("kombu's stock Redis transport does not run on a cluster")
    if args.shards is not None and (args.transport == "stock" or not 2 <= args.shards <= MAX_SHARDS):
        parser.error(f"--shards: ours only, 2..{MAX_SHARDS}, got {args.shards}")
    if args.together is not None and (args.transport == "stock" or not 2 <= args.together <= 1000):
        parser.error(f"--together: ours only, 2..1000, got {args.together}")
    if args.flow and args.transport == "stock":
        parser.error("--flow: pause, limit and delayed retry are our transport's")
    if args.durability_timeout and not args.durability:
        parser.error("--durability-timeout needs --durability")
    if args.faults:
        kinds = tuple(dict.fromkeys(k.strip() for k in args.faults.split(",") if k.strip()))
        unknown = [k for k in kinds if k not in ALL_FAULT_KINDS]
        if unknown or not kinds:
            parser.error(f"--faults: unknown kind(s) {unknown}; kinds: {', '.join(ALL_FAULT_KINDS)}")
        if set(kinds) & set(FLOW_FAULT_KINDS) and not args.flow:
            parser.error(f"--faults: {', '.join(FLOW_FAULT_KINDS)} needs --flow")
        if set(kinds) & set(PARTITION_FAULT_KINDS + SPLIT_BRAIN_KINDS) and not args.partitions:
            parser.error(f"--faults: {', '.join(PARTITION_FAULT_KINDS + SPLIT_BRAIN_KINDS)} "
                         "need --partitions")
        args.faults = kinds
    if args.partition_seconds:
        low, _, high = args.partition_seconds.partition(",")
        args.partition_seconds = (float(low), float(high or low))
    return args


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = PROFILES[args.profile]
    if args.load_seconds:
        profile = replace(profile, load_seconds=args.load_seconds)
    if args.visibility_timeout:
        profile = replace(profile, visibility_timeout=args.visibility_timeout)
    if args.partition_seconds:
        profile = replace(profile, partition_seconds=args.partition_seconds)
    log_dir = Path(tempfile.mkdtemp(prefix="crl-chaos-"))
    kinds = args.faults or None
    card: dict[str, Any] = {"run": {}}
    network = partition_network(profile, card, args.broker) if args.partitions else None
    try:
        broker = Broker.create(args.broker, fsync_recorder=bool(kinds and set(kinds) & set(POWER_LOSS_KINDS)),
                               network=network if isinstance(network, netns.Topology) else None,
                               switch=network if isinstance(network, switch.Switch) else None)
    except BaseException:
        if network is not None:
            network.destroy()
        raise
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
    card["run"].update({
        "transport": args.transport, "broker": args.broker, "profile": args.profile,
        "seed": args.seed, "acks_late": not args.no_acks_late, "log_dir": str(log_dir),
        "durability": args.durability, "fault_kinds": list(kinds) if kinds else None,
        "shards": args.shards,
        "together": args.together, "fence_timeout": args.fence_timeout,
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "make chaos ARGS=" + shlex.quote(" ".join(sys.argv[1:])),
        "transport_options": options, "profile_settings": profile.as_dict()})
    broker.shards = args.shards
    # every queue that holds the chaos queues' messages: the shards too (--shards)
    queues = tuple(member for queue in verdict.chaos_queues(args.flow) for member in broker.members(queue))
    flow_app: Celery | None = None
    try:
        # on a switch, also on the bridge's address: the workers' and the producer's
        # namespaces reach it there (never cut: a cut drops only the nodes' addresses)
        ledger_server = Server("valkey", address=broker.switch.gateway if broker.switch else None).start()
        broker.start()
    except BaseException:
        broker.stop()  # with --partitions, its namespace and pairs too
        raise
    workers: list[ChaosWorker] = []
    producer: Producer | None = None
    listener: EventListener | None = None
    try:
        broker_url = broker.url(args.transport)
        card["run"]["server"] = broker.describe()
        card["run"]["topology"] = broker.topology()
        env = {"CHAOS_LEDGER_URL": ledger_server.url,
               "CHAOS_TRANSPORT_OPTIONS": json.dumps(options),
               "CHAOS_ACKS_LATE": "0" if args.no_acks_late else "1"}
        if args.flow:
            env.update(CHAOS_FLOW="1", CHAOS_QUEUES=",".join(verdict.chaos_queues(True)))
        if args.shards:
            env["CHAOS_SHARDS"] = str(args.shards)
        for i, (pool, concurrency) in enumerate(profile.workers, 1):
            name = f"w{i}-{pool}"  # with --partitions, each worker reaches the broker by its own pair
            worker_env = {**env, "CHAOS_BROKER_URL": broker.url(args.transport, name)}
            prefix = tuple(broker.switch.exec_prefix(name)) if broker.switch and broker.switch.clients else ()
            workers.append(ChaosWorker(name, pool, concurrency, worker_env, log_dir, prefix=prefix))
            workers[-1].start()
        log(f"{len(workers)} workers up; {args.transport} on {card['run']['server']}; logs {log_dir}")
        if args.flow:  # the workers declared the flow queues; the cap is set before any load
            flow_app = Celery("chaos-flow", broker=broker_url, set_as_current=False)
            flow_app.conf.broker_transport_options = options
            card["run"]["flow_settings"] = {**flow.settings(), "limits": flow.apply_limit(flow_app)}
            log(f"flow: {card['run']['flow_settings']}")
        listener = EventListener(broker.url(args.transport, EVENTS), options, ledger_server.url)
        listener.start()
        injector = faults.FaultInjector(broker, workers, args.transport, profile,
                                        ledger_server.url, args.seed, flow_app,
                                        card["run"].get("partitions", {}).get("skipped"))
        if broker.recorder_error:
            log(f"power loss will be skipped: {broker.recorder_error}")
            card["run"]["recorder_error"] = broker.recorder_error
        plan = faults.schedule(profile, args.seed, kinds or faults.fault_kinds(broker)
                               + (FLOW_FAULT_KINDS if args.flow else ())
                               + (PARTITION_FAULT_KINDS if args.partitions else ())
                               + (SPLIT_BRAIN_KINDS if args.partitions and broker.replicated else ()))
        card["run"]["fault_plan"] = plan
        producer = Producer(broker.url(args.transport, PRODUCER), options, ledger_server.url, profile,
                            args.seed, args.flow, args.shards, args.together or 0,
                            broker.switch.client_namespace(PRODUCER) if broker.switch else None)
        began = time.monotonic()
        producer.start()
        # After a partition the next fault waits (partitions.CALM_SECONDS) and the rest of the
        # schedule, with the end of the load, moves back by as much: the gaps are kept.
        lag = calm_until = 0.0
        for at, fault in plan:
            due = max(began + at + lag, calm_until)
            lag = due - began - at
            time.sleep(max(0.0, due - time.monotonic()))  # the schedule, not a sync
            try:
                entry = injector.inject(fault)
            except Exception as error:  # recorded; the run goes on to its verdict
                entry = {"kind": fault, "t": time.time(), "error": repr(error)[:300]}
                ledger.record("fault", ledger_server.url, **entry)
            quiet = ("kind", "t", "server_said", "lost_task_ids", "refusal",  # in the scorecard
                     "acked", "resumed", "resume_acked")
            log(f"t+{time.monotonic() - began:6.1f}s {fault}: "
                f"{ {k: v for k, v in entry.items() if k not in quiet} }")
            if "healed" in entry:  # the calm counts from the heal (a split brain's fault returns later)
                calm = entry["healed"] + partitions.CALM_SECONDS - time.time()
                calm_until = time.monotonic() + max(0.0, calm)
        load_until = max(began + profile.load_seconds + lag, calm_until)
        time.sleep(max(0.0, load_until - time.monotonic()))
        if lag:
            card["run"]["schedule_lag_seconds"] = round(lag, 1)
        producer.stop()
        log(f"load over: sent {producer.sent}, submit errors {producer.errors}; draining")
        for worker in workers:
            if not worker.alive:
                worker.reap(5)
                worker.start()
        settle(broker, card)  # a failover the last fault set off ends before the drain
        card["run"]["drain_seconds_used"] = drain(profile, ledger_server.url, broker, args.transport, queues)
        listener.stop()
        settle(broker, card)
        if broker.replicated:
            card["run"]["primary_at_end"] = broker.current().port
        state = verdict.broker_state(broker.client(socket_timeout=10), args.transport, queues)
        records = ledger.read(ledger_server.url)
        (log_dir / "ledger.json").write_text(json.dumps(records))  # for a post-mortem
        card["verdict"] = verdict.compute(records, state, profile, args.transport, args.durability,
                                          card["run"].get("flow_settings"))
        card["faults"] = records["fault"]
        if broker.replicated:  # what the servers refused over the run (NOREPLICAS: the fence)
            card["run"]["server_errors"] = broker.refusals()
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
