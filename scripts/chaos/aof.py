"""Power loss (issue 40 §2): the broker is SIGKILLed and its AOF cut back to what was on
disk, as a power failure leaves it, then started again.

What is on disk is what the server fsynced. Redis 7.0 cannot tell a client that (WAITAOF
came in Redis 7.2), and Valkey 9.1.2's WAITAOF says it too early under ``appendfsync
everysec`` (it confirms a write that was only written, not fsynced: the bug Redis fixed in
8.0, redis/redis#13793). So the harness watches the server's own fsyncs: ``fsyncrec.c``,
built here with the system's C compiler and loaded with LD_PRELOAD, appends to
``fsync.log`` in the server's directory, after each fsync of an ``.aof`` file, the wall
clock before the call and the file's size before it. Every byte below that size was on
disk when the call returned, and every write the server finished before that moment is
below it (a client's reply follows its write), whatever server and version.

Redis 7's AOF is multi-part (``appendonlydir/``: a manifest, a base file, incr files): the
server appends to the last incr file, so that is the one cut. Three kinds:

- ``power_loss``: the last incr file cut to its size at the last fsync that returned. The
  server loads it as it is.
- ``power_loss_torn``: the same, plus part of the unfsynced tail, cut inside a command, as
  when the kernel had written back some pages of it: ``aof-load-truncated yes`` (the
  default) makes the server drop the partial command (and an unfinished MULTI) and load the
  rest.
- ``aof_corrupt``: the same as ``power_loss``, and one command of the fsynced part a few
  commands before its end overwritten (its ``*`` made ``!``): the server refuses to load
  ("Bad file format"). The harness does what docs/deployment.md tells an operator to do,
  ``redis-check-aof --fix`` (``valkey-check-aof`` for Valkey) on the manifest, which cuts the
  file at the bad command, and starts the server again. What that cut lost is reported as
  lost to an operator's repair, never silently.

The fault's entry says what the server did (its log's lines about the AOF), what was cut
(bytes, commands by name, the task ids in the cut bytes) and ``durable_until``: the moment
of the last fsync whose bytes the server kept. A publish confirmed before it must survive;
one confirmed after it and before the kill may be lost (the verdict's rule). On a server
with WAITAOF, a marker write confirmed by ``WAITAOF 1 0`` just before the kill tests the
server's own claim: ``waitaof`` records whether an fsync had covered the marker when the
server confirmed it.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from scripts.servers import Server

POWER_LOSS_KINDS = ("power_loss", "power_loss_torn", "aof_corrupt")
RECORDER_SOURCE = Path(__file__).with_name("fsyncrec.c")
FSYNC_LOG = "fsync.log"
# The corrupted command is this many commands before the end of the fsynced part (or the
# first, in a shorter file): the repair then costs a few commands, not the run.
CORRUPT_FROM_END = 3
# How long after the WAITAOF probe the kill comes, at most: a power loss at any point of
# the once-a-second fsync cycle, not just after an fsync.
KILL_PHASE_SECONDS = 1.0
TASK_ID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
EXAMPLES = 500
# The server log's lines worth reporting after a restart on a cut AOF.
AOF_LOG = re.compile(r"AOF|append only|Truncat|truncat|short read|Bad file format|MULTI|Reading|loaded",
                     re.IGNORECASE)


class RecorderUnavailable(RuntimeError):
    """The fsync recorder cannot be built here (no C compiler): power loss is skipped."""


def build_recorder() -> Path:
    """The recorder's shared object, compiled once per source version into the temp dir."""
    source = RECORDER_SOURCE.read_bytes()
    target = Path(tempfile.gettempdir()) / f"crl-fsyncrec-{hashlib.sha1(source).hexdigest()[:12]}.so"
    if target.exists():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RecorderUnavailable("no C compiler (cc) to build the fsync recorder scripts/chaos/fsyncrec.c")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(RECORDER_SOURCE),
                            "-ldl"], capture_output=True, text=True)
    if built.returncode:
        raise RecorderUnavailable(f"building the fsync recorder failed: {built.stderr[-300:]}")
    os.replace(partial, target)
    return target


def attach_recorder(server: Server) -> Path:
    """Make ``server`` start (and restart) with the recorder; returns its log's path."""
    assert server.directory is not None
    log = server.directory / FSYNC_LOG
    server.env = {**(server.env or {}), "LD_PRELOAD": str(build_recorder()), "CRL_FSYNC_LOG": str(log)}
    return log


@dataclass(frozen=True)
class AofFiles:
    directory: Path  # appendonlydir
    manifest: Path
    incr: Path  # the last incr file: the one the server appends to

    @classmethod
    def of(cls, client: redis.Redis) -> AofFiles:
        config = {str(k): str(v) for name in ("dir", "appenddirname", "appendfilename")
                  for k, v in client.config_get(name).items()}  # redis-py decodes CONFIG GET
        directory = Path(config["dir"]) / config["appenddirname"]
        manifest = directory / f"{config['appendfilename']}.manifest"
        incr = [line.split()[1] for line in manifest.read_text().splitlines()
                if line.split()[-2:] == ["type", "i"]]
        if not incr:
            raise RuntimeError(f"no incr file in {manifest}: {manifest.read_text()!r}")
        return cls(directory, manifest, directory / incr[-1])


@dataclass(frozen=True)
class Fsync:
    began: float  # wall clock before the call: every write finished before it is covered
    returned: float
    size: int  # the file's size before the call: these bytes are on disk


def fsyncs(log: Path, path: Path) -> list[Fsync]:
    """Each fsync of ``path`` that returned, in order."""
    if not log.exists():
        return []
    found = []
    for line in log.read_text().splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[3] == str(path):
            found.append(Fsync(int(parts[0]) / 1e9, int(parts[1]) / 1e9, int(parts[2])))
    return found


def commands(data: bytes) -> list[tuple[int, int, str, str]]:
    """The complete RESP commands of an AOF file from its start: (begin, end, name, first key)."""
    found, at, size = [], 0, len(data)
    while at < size:
        begin = at
        if data[at:at + 1] != b"*":
            break
        line_end = data.find(b"\r\n", at)
        if line_end < 0:
            break
        try:
            count = int(data[at + 1:line_end])
        except ValueError:
            break
        at, args, ok = line_end + 2, [], True
        for i in range(count):
            line_end = data.find(b"\r\n", at)
            if line_end < 0 or data[at:at + 1] != b"$":
                ok = False
                break
            length = int(data[at + 1:line_end])
            if line_end + 2 + length + 2 > size:
                ok = False
                break
            if i < 2:
                args.append(data[line_end + 2:line_end + 2 + length].decode(errors="replace"))
            at = line_end + 2 + length + 2
        if not ok:
            break
        found.append((begin, at, args[0].upper() if args else "", args[1] if len(args) > 1 else ""))
    return found


def published_ids(data: bytes, parsed: list[tuple[int, int, str, str]], kept: int) -> list[str]:
    """The task ids of the messages stored by the commands from ``kept`` on: a publish's
    effect is an HSET of the payload into the queue's ``message:{Q}`` hash (an ack's or a
    consume's effects name the task too, in the state string, and are left out)."""
    ids: dict[str, None] = {}
    for begin, end, name, key in parsed:
        if begin >= kept and name in ("HSET", "HMSET", "HSETNX") and key.startswith("message:"):
            ids.update(dict.fromkeys(m.decode() for m in TASK_ID.findall(data[begin:end])))
    return list(ids)


def loadable_prefix(parsed: list[tuple[int, int, str, str]], cut: int) -> int:
    """How much of a file cut at ``cut`` the server keeps: up to the last complete command,
    less an unfinished MULTI (the server reverts a MULTI without its EXEC)."""
    kept, multi_at = 0, None
    for begin, end, name, _ in parsed:
        if end > cut:
            break
        if name == "MULTI":
            multi_at = begin
        elif name == "EXEC":
            multi_at = None
        kept = end
    return multi_at if multi_at is not None else kept


def waitaof_probe(client: redis.Redis, files: AofFiles, log: Path, n: int) -> dict[str, Any]:
    """A marker write and ``WAITAOF 1 0``: had an fsync covering the marker returned when the
    server confirmed it? (No is the Valkey 9.1.2 bug: a confirmation before the fsync.)
    Redis 7.0 has no WAITAOF: said so."""
    key = f"chaos:power-loss-marker:{n}"
    client.set(key, str(time.time()))
    try:
        local, _ = client.execute_command("WAITAOF", 1, 0, 2000)
    except redis.ResponseError as error:
        return {"unavailable": str(error)[:120]}
    confirmed = time.time()
    data = files.incr.read_bytes()
    at = data.rfind(key.encode())
    # the marker's command ends after its key and its value: two more CRLF-ended lines
    end = data.find(b"\r\n", data.find(b"\r\n", data.find(b"\r\n", at) + 2) + 2) + 2 if at >= 0 else None
    covered = end is not None and any(f.size >= end and f.returned <= confirmed
                                      for f in fsyncs(log, files.incr))
    return {"confirmed": bool(local), "confirmed_at": confirmed, "marker_end": end,
            "fsynced_when_confirmed": covered}


def server_log_since(server: Server, offset: int) -> list[str]:
    assert server.directory is not None
    path = server.directory / "server.log"
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    return [line.split(" ", 4)[-1][:200] for line in lines if AOF_LOG.search(line)][-12:]


def log_size(server: Server) -> int:
    assert server.directory is not None
    path = server.directory / "server.log"
    return path.stat().st_size if path.exists() else 0


def check_aof_tool(server: Server) -> tuple[str, str]:
    """(the name to call it by, its executable) of the server's AOF checker: Debian's
    ``redis-check-aof``; for Valkey its server binary, which is the checker when called
    ``valkey-check-aof``."""
    if server.kind == "redis":
        tool = shutil.which("redis-check-aof")
        if tool is None:
            raise RuntimeError("redis-check-aof is not installed (Debian: redis-tools)")
        return "redis-check-aof", tool
    return "valkey-check-aof", server.binary


def run_checker(server: Server, target: Path) -> dict[str, Any]:
    name, executable = check_aof_tool(server)
    done = subprocess.run([name, "--fix", str(target)], executable=executable, input="y\n",
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return {"command": f"{name} --fix {target.parent.name}/{target.name}", "exit_code": done.returncode,
            "said": lines[-6:]}


def check_aof(server: Server, files: AofFiles) -> dict[str, Any]:
    """The operator's repair (docs/deployment.md): ``redis-check-aof --fix`` on the manifest,
    answering its question with y. Valkey 9.1.2's checker takes its own RDB base file (magic
    ``VALKEY``, not ``REDIS``) for a bad RESP file and refuses the manifest (valkey-io/valkey
    #4739, open): the documented fallback is the checker on the last incr file alone."""
    repair = run_checker(server, files.manifest)
    if repair["exit_code"]:
        repair = {**run_checker(server, files.incr), "manifest_check": repair}
    return repair


def cut_point(kind: str, parsed: list[tuple[int, int, str, Any]], fsynced: int, rng: random.Random,
              entry: dict[str, Any]) -> tuple[int, int | None]:
    """(where the file is cut, where a byte is overwritten or None): at the fsynced size; for
    a torn write inside the first command past it; for a corrupt file, an fsynced command
    CORRUPT_FROM_END from the end is broken too. Why neither could be done goes in ``entry``."""
    cut, corrupt_at = fsynced, None
    if kind == "power_loss_torn":
        tail = next(((b, e) for b, e, _, _ in parsed if e > fsynced), None)
        if tail is not None and tail[1] - 1 > max(tail[0], fsynced) + 1:
            cut = rng.randint(max(tail[0], fsynced) + 1, tail[1] - 1)
        else:
            entry["torn"] = "no unfsynced command to tear: cut at the fsynced size"
    elif kind == "aof_corrupt":
        within = [c for c in parsed if c[1] <= fsynced]
        if within:
            corrupt_at = within[max(0, len(within) - CORRUPT_FROM_END)][0]
        else:
            entry["corrupt"] = "no fsynced command in the incr file to corrupt"
    return cut, corrupt_at


def restart(server: Server, files: AofFiles, entry: dict[str, Any], kept: int) -> int:
    """Start the server on the cut file; one that refuses to load it is repaired as an
    operator would (redis-check-aof --fix) and started again. Returns the bytes kept."""
    try:
        server.start(timeout=60)
        entry["server"] = "loaded"
    except (RuntimeError, TimeoutError) as error:
        entry["server"] = "refused to load"
        entry["refusal"] = str(error)[-300:]
        entry["repair"] = check_aof(server, files)
        kept = entry["repair"]["file_bytes_after"] = files.incr.stat().st_size
        server.start(timeout=60)
        entry["server"] = "refused to load; loaded after check-aof --fix"
    return kept


def power_loss(server: Server, log: Path, kind: str, rng: random.Random, n: int = 0, *,
               probe: bool = True, phase_seconds: float = KILL_PHASE_SECONDS) -> dict[str, Any]:
    """The fault (see the module's docstring); ``n`` numbers the markers of one run. A test
    leaves out the WAITAOF probe and the random phase."""
    admin = server.client(socket_timeout=10)
    try:
        files = AofFiles.of(admin)
        entry: dict[str, Any] = {"aof_file": files.incr.name}
        if probe:
            entry["waitaof"] = waitaof_probe(admin, files, log, n)
    finally:
        admin.close()
    time.sleep(rng.uniform(0, phase_seconds))  # the fault's phase in the fsync cycle
    killed = time.time()
    server.kill()
    data = files.incr.read_bytes()
    if not log.exists():
        raise RuntimeError(f"no fsync recorded in {log}: the recorder is not loaded; nothing to cut by")
    records = fsyncs(log, files.incr)
    fsynced = min(records[-1].size, len(data)) if records else 0
    parsed = commands(data)
    cut, corrupt_at = cut_point(kind, parsed, fsynced, rng, entry)
    with files.incr.open("r+b") as f:
        f.truncate(cut)
        if corrupt_at is not None:
            f.seek(corrupt_at)
            f.write(b"!")
    kept = loadable_prefix(parsed, cut if corrupt_at is None else corrupt_at)
    entry.update(killed_at=killed, file_bytes=len(data), fsynced_bytes=fsynced, cut_at=cut,
                 fsyncs_recorded=len(records),
                 last_fsync_at=records[-1].began if records else None,
                 unfsynced_seconds=round(killed - records[-1].began, 3) if records else None)
    if corrupt_at is not None:
        entry["corrupted_at"] = corrupt_at
    logged_from = log_size(server)
    began = time.time()
    kept = restart(server, files, entry, kept)
    entry["down_seconds"] = round(time.time() - killed, 3)
    entry["restart_seconds"] = round(time.time() - began, 3)
    entry["server_said"] = server_log_since(server, logged_from)
    truncated = next((int(m.group(1)) for line in entry["server_said"]
                      if (m := re.search(r"Truncating the AOF \S+ at offset (\d+)", line))), None)
    if truncated is not None:  # the server's own figure: what it kept of the torn file
        entry["server_truncated_at"] = truncated
        kept = truncated
    entry["kept_bytes"] = kept
    entry["lost_bytes"] = len(data) - kept
    entry["lost_commands"] = dict(Counter(name for b, _, name, _ in parsed if b >= kept))
    partial = len(data) - (parsed[-1][1] if parsed else 0)
    if partial:
        entry["lost_partial_command_bytes"] = partial  # a write the kill interrupted
    ids = published_ids(data, parsed, kept)
    entry["lost_task_ids"] = ids[:EXAMPLES]  # of the publishes cut
    entry["lost_task_id_count"] = len(ids)
    # the last fsync whose bytes the server kept: every write finished before it survived
    entry["durable_until"] = max((f.began for f in records if f.size <= kept), default=None)
    return entry
