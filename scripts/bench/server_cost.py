"""What a run costs the server: Redis commands per message by name and CPU per message.

For Redis-based peers this is the INFO commandstats and INFO cpu delta over a phase,
shared with scripts/bench/lua_level.py: commands the harness itself sends are left out;
``requests`` are the commands clients sent, ``calls`` every command the server ran, a
script's inner ones included. Only redis-py and kombu are imported here, so a benchmark
of another checkout (``--checkout``) runs it with that checkout's package.
No CONFIG RESETSTAT and no FLUSHALL: deltas work on a server shared with anything.
For RabbitMQ the CPU of its ``beam.smp`` process comes from /proc (read only).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from .peers import Peer

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# 'PID:PORT:DIR' of the run's server under callgrind (python -m scripts.bench --instructions),
# for every job's probe of that server (a --checkout peer's subprocess too, and not one of a
# throwaway server of its own): each snapshot dumps its counters.
CALLGRIND_ENV = "BENCH_CALLGRIND"
HARNESS_COMMANDS = {"info", "config", "ping", "flushall", "script", "client", "hello", "command"}
SCRIPT_COMMANDS = {"evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro"}
# Commands the harness itself sends (snapshots, setup, connection handshake).


def snapshot(client: Any) -> dict[str, Any]:
    """INFO cpu and commandstats of a server, or summed over a cluster's primaries."""
    if hasattr(client, "get_primaries"):
        nodes = [snapshot(client.get_redis_connection(node)) for node in client.get_primaries()]
        commands: dict[str, tuple[int, int]] = {}
        for one in nodes:
            for name, (calls, usec) in one["commands"].items():
                before = commands.get(name, (0, 0))
                commands[name] = (before[0] + calls, before[1] + usec)
        return {"cpu": sum(n["cpu"] for n in nodes), "cpu_main": sum(n["cpu_main"] for n in nodes),
                "commands": commands}
    cpu = client.info("cpu")
    stats = client.info("commandstats")
    return {
        "cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "cpu_main": float(cpu.get("used_cpu_sys_main_thread", 0.0))
        + float(cpu.get("used_cpu_user_main_thread", 0.0)),
        "commands": {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
                     for name, v in stats.items()},
    }


def server_cost(before: dict[str, Any], after: dict[str, Any], n: int,
                scripted: bool | None = None) -> dict[str, Any]:
    """Per message, between two snapshots. ``scripted``: whether the peer's requests are script
    calls (ours), or plain commands (stock kombu: a stray EVALSHA of another process on the
    shared server must not make its 10 requests a task read as 0.01); None: told by whether
    any script ran."""
    commands: dict[str, dict[str, float]] = {}
    for name, (calls_after, usec_after) in after["commands"].items():
        if name.split("|")[0] in HARNESS_COMMANDS:
            continue
        calls_before, usec_before = before["commands"].get(name, (0, 0))
        if calls_after - calls_before:
            commands[name] = {"calls": calls_after - calls_before, "usec": usec_after - usec_before}
    top = {k: v for k, v in commands.items() if k in SCRIPT_COMMANDS}
    if scripted is None:
        scripted = bool(top)
    if not scripted:
        top = commands
    inner = {k: v for k, v in commands.items() if k not in top}
    return {
        "cpu_us_per_msg": (after["cpu"] - before["cpu"]) * 1e6 / n,
        "cpu_main_us_per_msg": (after["cpu_main"] - before["cpu_main"]) * 1e6 / n,
        # requests: what clients sent (EVALSHA, or the stock commands incl. MULTI/EXEC);
        # calls: every command the server ran, a script's inner commands included.
        "requests_per_msg": sum(v["calls"] for v in top.values()) / n,
        "calls_per_msg": sum(v["calls"] for v in commands.values()) / n,
        # EVALSHA's usec already includes its inner commands: do not add them twice.
        "cmd_us_per_msg": sum(v["usec"] for v in top.values()) / n,
        "inner_cmd_us_per_msg": sum(v["usec"] for v in inner.values()) / n if scripted else 0.0,
        "commands": commands,
    }



def callgrind_dump(pid: int, directory: Path) -> int:
    """The instructions a server run under callgrind counted since its last dump: a dump
    (callgrind_control -d) writes them to a file of its own and resets the counters."""
    before = set(directory.glob("callgrind.out.*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True, timeout=60)
    (dump,) = set(directory.glob("callgrind.out.*")) - before
    try:
        for line in dump.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    finally:
        dump.unlink()
    raise RuntimeError(f"{dump}: no totals line")


def _beam_pid() -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() != "beam.smp":
                continue
            if b"rabbit" in (proc / "cmdline").read_bytes():
                return int(proc.name)
        except OSError:
            continue
    return None


class Probe:
    """Snapshots of one peer's server; ``cost(before, after, n)`` per message."""

    def __init__(self, peer: Peer) -> None:
        self.client = peer.redis_client()
        self.beam = None if self.client is not None else (_beam_pid() if "amqp" in peer.url else None)
        self.callgrind = self._callgrind()
        self.counted = 0  # the callgrind server's instructions this probe's dumps have read
        # Ours sends script calls; kombu's stock transport (no transport class of another
        # package) sends commands; another package's: told by what ran.
        self.scripted = True if peer.is_ours else (False if peer.is_stock else None)

    def _callgrind(self) -> tuple[int, Path] | None:
        """The pid and dump directory of the callgrind server this probe reads, if it is one."""
        named = os.environ.get(CALLGRIND_ENV)
        if not named or self.client is None:
            return None
        pid, port, directory = named.split(":", 2)
        ours = getattr(self.client, "connection_pool", None)
        if ours is None or str(ours.connection_kwargs.get("port")) != port:
            return None
        return int(pid), Path(directory)

    @property
    def available(self) -> bool:
        return self.client is not None or self.beam is not None

    def snapshot(self) -> dict[str, Any] | None:
        if self.client is not None:
            taken = snapshot(self.client)
            if self.callgrind:  # a running total: a dump resets the server's counters
                self.counted += callgrind_dump(*self.callgrind)
                taken["instructions"] = self.counted
            return taken
        if self.beam is not None:
            try:
                fields = Path(f"/proc/{self.beam}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return None
            return {"cpu": (int(fields[11]) + int(fields[12])) / CLOCK_TICKS}  # utime + stime
        return None

    def cost(self, before: dict[str, Any] | None, after: dict[str, Any] | None, n: int) -> dict[str, Any]:
        if before is None or after is None or n <= 0:
            return {}
        if self.client is not None:
            cost = server_cost(before, after, n, self.scripted)
            if "instructions" in after:  # the whole server's: the phase's requests, its cron, and
                # whatever else reached it meanwhile (one probe at a time dumps it: its jobs)
                cost["instructions_per_msg"] = (after["instructions"] - before["instructions"]) / n
            return cost
        return {"cpu_us_per_msg": (after["cpu"] - before["cpu"]) * 1e6 / n,
                "note": "beam.smp utime+stime (/proc, 10 ms ticks)"}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def version_of(peer: Peer) -> str:
    """'redis 7.0.15', 'valkey 9.1.2', 'RabbitMQ 3.10.8' or '' when unknown."""
    client = peer.redis_client()
    if client is not None:
        try:
            info = client.info("server")
            if "valkey_version" in info:
                return f"valkey {info['valkey_version']}"
            return f"redis {info.get('redis_version', '?')}"
        finally:
            client.close()
    try:
        with peer.connection() as conn:
            conn.connect()
            props = getattr(conn.connection, "server_properties", {}) or {}
            product, version = props.get("product", ""), props.get("version", "")
            parts = (v.decode() if isinstance(v, bytes) else str(v) for v in (product, version))
            return " ".join(parts).strip()
    except Exception:
        return ""
