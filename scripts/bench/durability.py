"""What the ``durability`` transport option costs: kombu publish and consume+ack of our
transport on a primary with one replica attached, durability off against ``replicas:N``
(WAIT after each confirmed call) and ``aof`` (WAITAOF), in the same run, interleaved.

``python -m scripts.bench --durability`` adds these peers to the run (kombu level only);
``--durability-only`` runs nothing else. Settings, one peer each (its own db):

- Valkey, primary + replica without AOF: ``off``, ``replicas:1``
- Valkey, primary + replica with ``--appendonly yes --appendfsync everysec``:
  ``aof server, off`` (what turning the AOF on costs by itself), ``aof`` (WAITAOF 1 0) and
  ``aof+replicas:1`` (WAITAOF 1 1: waits for the replica's fsync, about a second a call
  with everysec, so it runs a handful of messages and a longer durability_timeout)
- Redis (Debian's 7.0: no WAITAOF), primary + replica without AOF: ``off``, ``replicas:1``

Every ratio is to ``off`` on the same server kind. Each job also times PING round trips
on one connection to the primary, to compare what a WAIT adds per message with a round trip.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from scripts.servers import Server, ServerUnavailable, server_binary

from . import kombu_level
from .peers import Peer

REPLICA_ARGS = ["--repl-diskless-sync-delay", "0"]
AOF_ARGS = ["--appendonly", "yes", "--appendfsync", "everysec"]
PING_ROUNDS = 500


@dataclass(frozen=True)
class Setting:
    key: str           # peer name suffix
    label: str         # the table's column
    durability: str | None
    aof_server: bool
    slow: bool = False  # about a second per confirmed call: a few messages only
    valkey_only: bool = False  # WAITAOF: Redis 7.2+ or Valkey


SETTINGS = [
    Setting("off", "off", None, False),
    Setting("rep1", "replicas:1", "replicas:1", False),
    Setting("aofoff", "aof server, off", None, True, valkey_only=True),
    Setting("aof", "aof", "aof", True, valkey_only=True),
    Setting("aofrep1", "aof+replicas:1", "aof+replicas:1", True, slow=True, valkey_only=True),
]
KIND_TAG = {"valkey": "vk", "redis": "rd"}


def wait_replicated(primary: Server, replica: Server, timeout: float = 30.0) -> None:
    """Until the replica's link is up and the primary lists it online."""
    deadline = time.monotonic() + timeout
    p, r = primary.client(socket_timeout=2), replica.client(socket_timeout=2)
    try:
        while True:
            rinfo, pinfo = r.info("replication"), p.info("replication")
            slave0 = pinfo.get("slave0")
            online = (slave0.get("state") == "online") if isinstance(slave0, dict) \
                else "state=online" in str(slave0 or "")
            # Redis 7.0 lists a replica fed by a diskless sync as online before it streams
            # commands to it (that starts on the replica's first ACK, up to a second later):
            # only a write that WAIT sees acknowledged says the replica really follows.
            if rinfo.get("master_link_status") == "up" and online:
                p.set("bench:replication-probe", 1)
                if p.execute_command("WAIT", 1, 200) >= 1:
                    p.delete("bench:replication-probe")
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica.port} of {primary.port} not in sync after {timeout}s")
            time.sleep(0.05)
    finally:
        p.close()
        r.close()


def pair(stack: ExitStack, kind: str, aof: bool) -> Server:
    """A primary with one replica attached (both stopped by ``stack``); the primary."""
    args = [*REPLICA_ARGS, *(AOF_ARGS if aof else [])]
    primary = stack.enter_context(Server(kind, args=args))
    replica = stack.enter_context(Server(kind, args=[*args, "--replicaof", "127.0.0.1", str(primary.port)]))
    wait_replicated(primary, replica)
    return primary


def start(stack: ExitStack, kinds: list[str], n: int, slow_n: int, slow_timeout: float
          ) -> tuple[list[Peer], dict[str, dict[str, Any]], dict[str, str]]:
    """Servers for every available kind; (peers, what each peer measures, skipped kinds)."""
    peers: list[Peer] = []
    meta: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for kind in kinds:
        try:
            server_binary(kind)
        except ServerUnavailable as error:
            skipped[f"durability-{kind}"] = str(error)
            continue
        primaries: dict[bool, Server] = {}
        for db, setting in enumerate(s for s in SETTINGS if kind == "valkey" or not s.valkey_only):
            if setting.aof_server not in primaries:
                primaries[setting.aof_server] = pair(stack, kind, setting.aof_server)
            port = primaries[setting.aof_server].port
            options: dict[str, Any] = {}
            if setting.durability:
                options["durability"] = setting.durability
                if setting.slow:
                    options["durability_timeout"] = slow_timeout
            name = f"{KIND_TAG.get(kind, kind)}-{setting.key}"
            peers.append(Peer(name, f"redislua://127.0.0.1:{port}/{db}", options=options or None,
                              n=slow_n if setting.slow else n))
            meta[name] = {"kind": kind, "setting": setting.label, "durability": setting.durability,
                          "server_args": [*REPLICA_ARGS, *(AOF_ARGS if setting.aof_server else [])],
                          "transport_options": options, "n": slow_n if setting.slow else n}
    return peers, meta, skipped


def ping_rtt_us(peer: Peer, rounds: int = PING_ROUNDS) -> float | None:
    client = peer.redis_client()
    if client is None:
        return None
    try:
        client.ping()
        times = []
        for _ in range(rounds):
            began = time.perf_counter()
            client.ping()
            times.append(time.perf_counter() - began)
        return statistics.median(times) * 1e6
    finally:
        client.close()


def run(peer: Peer, prefetch: int, size: int) -> tuple[dict[str, Any], str]:
    r = kombu_level.run(peer, peer.n or 1000, prefetch, size)
    r["ping_rtt_us"] = ping_rtt_us(peer)
    return r, (f"publish {r['publish']['msgs_per_s']:7,.0f} msg/s  consume+ack "
               f"{r['consume']['msgs_per_s']:7,.0f} msg/s  (n {r['n']}, PING {r['ping_rtt_us']:.0f} µs)")


PHASES = [("publish", "kombu publish"), ("consume", "kombu consume+ack")]


def summarize(runs: list[dict[str, Any]], meta: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per peer and phase: median msg/s, µs per message, the ratio to ``off`` of its kind
    and what the wait adds per message (µs) beside the median PING round trip."""
    out: dict[str, Any] = {}
    for name, info in meta.items():
        mine = [r["result"] for r in runs if r["peer"] == name and "error" not in r]
        entry: dict[str, Any] = {**info, "reps": len(mine),
                                 "failed": sum(1 for r in runs if r["peer"] == name and "error" in r)}
        rtts = [r["ping_rtt_us"] for r in mine if r.get("ping_rtt_us") is not None]
        entry["ping_rtt_us"] = statistics.median(rtts) if rtts else None
        for phase, _ in PHASES:
            rates = [r[phase]["msgs_per_s"] for r in mine]
            cpu = [r[phase]["server"]["cpu_us_per_msg"] for r in mine if r[phase].get("server")]
            entry[phase] = {"msgs_per_s": statistics.median(rates) if rates else None,
                            "msgs_per_s_all": rates,
                            "server_cpu_us_per_msg": statistics.median(cpu) if cpu else None}
        out[name] = entry
    for entry in out.values():
        base = out.get(f"{KIND_TAG.get(entry['kind'], entry['kind'])}-off")
        for phase, _ in PHASES:
            mine, theirs = entry[phase]["msgs_per_s"], base and base[phase]["msgs_per_s"]
            entry[phase]["ratio_to_off"] = mine / theirs if mine and theirs else None
            entry[phase]["added_us_per_msg"] = (1e6 / mine - 1e6 / theirs) if mine and theirs else None
    return out


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    if digits == 0 and abs(value) < 10:
        return f"{value:.2f}"
    return f"{value:,.{digits}f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}×" if value >= 0.1 else f"{value:.1g}×"


def _added(us: float | None) -> str:
    if us is None:
        return "–"
    return f"{us / 1e6:.2f} s" if abs(us) >= 1e5 else f"{us:,.0f} µs"


def _rate(phase: dict[str, Any]) -> str:
    """The median, and the range over the repetitions."""
    rates = phase["msgs_per_s_all"]
    if len(rates) < 2:
        return _num(phase["msgs_per_s"])
    return f"{_num(phase['msgs_per_s'])} ({_num(min(rates))}–{_num(max(rates))})"


def markdown(summary: dict[str, Any], versions: dict[str, str]) -> str:
    lines = ["| server | setting | n | kombu publish, msg/s (range) | ratio to off "
             "| kombu consume+ack, msg/s (range) | ratio to off | added per msg, publish / consume+ack "
             "| PING RTT, µs |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in summary.items():
        pub, con = e["publish"], e["consume"]
        added = "–" if e["setting"] == "off" else \
            " / ".join(_added(x["added_us_per_msg"]) for x in (pub, con))
        failed = f" ({e['failed']} failed)" if e["failed"] else ""
        lines.append(f"| {versions.get(name) or e['kind']} | {e['setting']}{failed} | {e['n']:,} | "
                     f"{_rate(pub)} | {_ratio(pub['ratio_to_off'])} | {_rate(con)} | "
                     f"{_ratio(con['ratio_to_off'])} | {added} | {_num(e['ping_rtt_us'])} |")
    return "\n".join(lines)
