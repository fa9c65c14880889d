"""The chaos run's command line: its options and which combinations it refuses
(``python -m scripts.chaos --help``)."""

from __future__ import annotations

import argparse

from celery_redis_lua.protocol.shards import MAX_SHARDS
from scripts.chaos import flow
from scripts.chaos.broker import BROKERS
from scripts.chaos.profiles import (
    ALL_FAULT_KINDS,
    FLOW_FAULT_KINDS,
    PARTITION_FAULT_KINDS,
    PROFILES,
    SPLIT_BRAIN_KINDS,
)

DESCRIPTION = "``python -m scripts.chaos``: one chaos run, its verdict, its scorecard."


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.chaos", description=DESCRIPTION)
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
                             "client (default: none; ours gives a dead connection up after its "
                             "partition_timeout, 5 s, stock waits for TCP itself)")
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
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, its combinations checked (a bad one is refused by name)."""
    parser = make_parser()
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
