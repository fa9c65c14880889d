"""A/B of one script's server cost: a git revision's version against the working tree's.

Both versions are loaded into one throwaway server and run in interleaved rounds (A B A B
...), each round on a flushed server; the cost is the INFO commandstats usec per EVALSHA
(which includes the commands a script runs), median over the rounds, and the ratio new/old.
It is how a change to a hot-path script shows it kept its cost ("within 5% of today's").

``--instructions`` counts instead the CPU instructions the server ran inside EVALSHA, under
valgrind's callgrind (the server started by it, collecting only within ``evalShaCommand``):
the same count for the same binary and inputs whatever else the host is doing, so one round
tells a 1% change apart where commandstats' microseconds wander by ±20% on a shared host.

    python -m scripts.bench.script_ab --script publish --base HEAD~1
    python -m scripts.bench.script_ab --script publish --base main --variant dedup --kind redis
    python -m scripts.bench.script_ab --script consume --base main --batch 10
    python -m scripts.bench.script_ab --script ack --base main --batch 1
    python -m scripts.bench.script_ab --script publish --base HEAD~1 --instructions --rounds 1

Workloads (the common path: no TTL, no ETA, a task id, a ~350-byte payload):
  publish  N publishes into one queue, pipelined; ``--variant dedup``: the new version with a
           unique dedup id per message (simple), against the base without (what it costs);
           ``--variant fair``: the new version with a fairness key (one of ten), against
           the base without.
  consume  N messages published with the working tree's publish, then consumed ``--batch`` at
           a time by the version under test (no ack); ``--variant fair``: published with a
           fairness key (one of ten), so the new version consumes a fair queue.
  ack      N messages published and consumed ``--batch`` at a time with the working tree's
           scripts, then acked ``--batch`` ids (id:delivery_count) a call by the version under
           test: a Celery worker's acks, which ride together.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.bench.server_cost import callgrind_dump
from scripts.servers import Server

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = '{"body":"W1sxLDJdLHt9LHt9XQ==","headers":{"id":"x","task":"tasks.add"}}' + "x" * 300


def queue_keys(queue: str) -> list[str]:
    return [f"{name}:{{{queue}}}" for name in
            ("queue", "delayed", "messages_index", "meta", "dead", "message", "state", "wake")]


def evalsha_usec(client: Any) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {"usec": 0, "calls": 0})
    return int(stats["usec"]), int(stats["calls"])


@dataclass
class CallgrindServer(Server):
    """A server run under callgrind, counting instructions inside EVALSHA only (``whole``:
    everything it runs, reading requests and writing replies too)."""

    whole: bool = False

    @staticmethod
    def require() -> None:
        """Refuse at once, naming the package, where valgrind is not installed."""
        if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
            raise SystemExit("instructions are counted under callgrind: "
                             "install valgrind (Debian's package valgrind)")

    def command_line(self) -> list[str]:
        assert self.directory is not None
        counted = ["--collect-atstart=yes"] if self.whole else ["--collect-atstart=no",
                                                                "--toggle-collect=evalShaCommand"]
        return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.directory / 'callgrind.out'}",
                *counted, *super().command_line()]

    def instructions(self) -> int:
        """The instructions counted since the last call (a dump resets the counters)."""
        assert self.process is not None and self.directory is not None
        return callgrind_dump(self.process.pid, self.directory)


# What a round measures: the server's µs (commandstats) or its instructions (callgrind).
COUNTER: dict[str, Any] = {}


def measured(client: Any, run: Callable[[], None], server: CallgrindServer | None = None) -> float:
    """Server µs (or, under callgrind, instructions) per EVALSHA of what ``run`` sends
    (``server``: counted by that one, else by the one this run put in COUNTER, if any)."""
    server = server or COUNTER.get("callgrind")
    usec0, calls0 = evalsha_usec(client)
    if server is not None:
        server.instructions()  # what ran before is not this round's
    run()
    usec1, calls1 = evalsha_usec(client)
    cost = server.instructions() if server is not None else usec1 - usec0
    return cost / max(1, calls1 - calls0)


def publish_round(client: Any, sha: str, n: int, tag: str, dedup: bool, fair: bool = False) -> float:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        args: list[Any] = [PAYLOAD, 0, "", "", 60_000, f"task-{tag}-{i}"]
        if dedup:
            args += ["", "", f"d-{tag}-{i}", "simple", ""]
        if fair:
            args += ["", "", "", "", "", f"tenant-{i % 10}"]
        pipe.evalsha(sha, 8, *queue_keys("q"), *args)
    return measured(client, pipe.execute)


def consume_round(client: Any, sha: str, publish_sha: str, n: int, batch: int, tag: str,
                  fair: bool = False) -> float:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        key = ["", "", "", "", "", f"tenant-{i % 10}"] if fair else []
        pipe.evalsha(publish_sha, 8, *queue_keys("q"), PAYLOAD, 0, "", "", 60_000, f"task-{tag}-{i}", *key)
    pipe.execute()
    pipe = client.pipeline(transaction=False)
    for _ in range(n // batch):
        pipe.evalsha(sha, 8, *queue_keys("q"), batch, 60_000, 0, 10_000)
    return measured(client, pipe.execute) / batch  # per message


def ack_round(client: Any, sha: str, publish_sha: str, consume_sha: str, n: int, batch: int,
              tag: str) -> float:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.evalsha(publish_sha, 8, *queue_keys("q"), PAYLOAD, 0, "", "", 60_000, f"task-{tag}-{i}")
    pipe.execute()
    pipe = client.pipeline(transaction=False)
    for _ in range(n // batch):
        pipe.evalsha(consume_sha, 8, *queue_keys("q"), batch, 60_000, 0, 10_000)
    deliveries = [reply[2:] for reply in pipe.execute()]  # 4 items per message after wake_in_ms, expired
    pipe = client.pipeline(transaction=False)
    for items in deliveries:
        tags = [f"{items[i + 1].decode()}:{int(items[i + 2])}" for i in range(0, len(items), 4)]
        pipe.evalsha(sha, 8, *queue_keys("q"), *tags)
    replies: list[Any] = []
    cost = measured(client, lambda: replies.extend(pipe.execute()))
    if sum(int(reply[0]) for reply in replies) != n - n % batch:  # each ack acked what it named
        raise RuntimeError(f"ack: {replies[:3]}... acked fewer than the {n - n % batch} consumed")
    return cost / batch  # per message


def run(script: str, base: str, kind: str, rounds: int, n: int, batch: int, variant: str,
        instructions: bool = False) -> dict[str, float]:
    old_source = subprocess.run(["git", "show", f"{base}:lua/{script}.lua"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    new_source = (ROOT / "lua" / f"{script}.lua").read_text()
    results: dict[str, list[float]] = {"old": [], "new": []}
    if instructions:
        CallgrindServer.require()
    with (CallgrindServer(kind) if instructions else Server(kind)) as server:
        if instructions:
            COUNTER["callgrind"] = server
        client = server.client(socket_timeout=60)
        old, new = client.script_load(old_source), client.script_load(new_source)
        publish_sha = client.script_load((ROOT / "lua" / "publish.lua").read_text())
        consume_sha = client.script_load((ROOT / "lua" / "consume.lua").read_text())
        for r in range(rounds):
            for name, sha in (("old", old), ("new", new)):
                client.flushall()
                tag = f"{r}-{name}"
                if script == "publish":
                    cost = publish_round(client, sha, n, tag, dedup=name == "new" and variant == "dedup",
                                         fair=name == "new" and variant == "fair")
                elif script == "consume":
                    cost = consume_round(client, sha, publish_sha, n, batch, tag, fair=variant == "fair")
                elif script == "ack":
                    cost = ack_round(client, sha, publish_sha, consume_sha, n, batch, tag)
                else:
                    raise SystemExit(f"no workload for script {script!r} (publish, consume, ack)")
                results[name].append(cost)
        client.close()
        COUNTER.pop("callgrind", None)
    medians = {name: statistics.median(costs) for name, costs in results.items()}
    return {**medians, "ratio": medians["new"] / medians["old"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--script", choices=["publish", "consume", "ack"], required=True)
    parser.add_argument("--base", default="HEAD", help="the git revision whose script is A (default HEAD)")
    parser.add_argument("--kind", choices=["valkey", "redis"], default="valkey")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("-n", type=int, default=4000, help="calls per round (publish) or messages (consume)")
    parser.add_argument("--batch", type=int, default=10, help="consume and ack: messages per call")
    parser.add_argument("--variant", choices=["plain", "dedup", "fair"], default="plain")
    parser.add_argument("--instructions", action="store_true",
                        help="count the server's instructions inside EVALSHA under callgrind, not its µs")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.n < args.batch or args.batch < 1:
        parser.error("--rounds and --batch must be >= 1 and -n at least --batch")
    result = run(args.script, args.base, args.kind, args.rounds, args.n, args.batch, args.variant,
                 args.instructions)
    unit = "instructions" if args.instructions else "µs"
    unit += " per call" if args.script == "publish" else " per message"
    print(f"{args.script} on {args.kind} ({args.rounds} rounds of {args.n}, variant {args.variant}): "
          f"{args.base} {result['old']:,.2f}, working tree {result['new']:,.2f} {unit}; "
          f"new/old {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
