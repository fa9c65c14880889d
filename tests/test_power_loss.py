"""The chaos harness's power loss (issue 40 §2, scripts/chaos/aof.py) on real servers: write,
let the server fsync, write more, SIGKILL, cut the AOF back to the size of the last fsync the
recorder saw return, start again, and see what is there.

The fsync is held off for the second batch by ``CONFIG SET appendfsync no`` (the server then
never fsyncs on its own), so the second batch is certainly on no disk: the test does not
depend on where the once-a-second fsync falls."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from helpers import wait_until
from scripts.chaos import aof
from scripts.servers import Server, ServerUnavailable, server_binary

KINDS = ("redis", "valkey")


@pytest.fixture(params=KINDS)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    try:
        server_binary(request.param)
        aof.build_recorder()
    except (ServerUnavailable, aof.RecorderUnavailable) as error:
        pytest.skip(str(error))
    if request.param == "redis":
        try:
            aof.check_aof_tool(Server("redis"))
        except RuntimeError as error:
            pytest.skip(str(error))
    server = Server(request.param, args=["--appendonly", "yes", "--appendfsync", "everysec"])
    server.log = aof.attach_recorder(server)  # type: ignore[attr-defined]
    server.start()
    yield server
    server.stop()


def write_fsynced_then_unfsynced(server: Server, batch: str) -> tuple[set[str], set[str]]:
    """A batch the server fsyncs (the recorder sees an fsync covering the whole file), then one
    it does not; returns both batches' keys."""
    client = server.client()
    files = aof.AofFiles.of(client)
    fsynced = {f"{batch}:on-disk:{i}" for i in range(40)}
    for key in fsynced:
        client.set(key, "x" * 50)
    size = files.incr.stat().st_size
    wait_until(lambda: any(f.size >= size for f in aof.fsyncs(server.log, files.incr)),  # type: ignore[attr-defined]
               timeout=5, what="an fsync covering the first batch")
    client.config_set("appendfsync", "no")
    unfsynced = {f"{batch}:in-page-cache:{i}" for i in range(40)}
    for key in unfsynced:
        client.set(key, "y" * 50)
    client.close()
    return fsynced, unfsynced


def keys(server: Server, batch: str) -> set[str]:
    client = server.client(decode_responses=True)
    try:
        return set(client.keys(f"{batch}:*"))
    finally:
        client.close()


def test_a_power_loss_keeps_what_was_fsynced_and_loses_the_rest(server: Server) -> None:
    fsynced, unfsynced = write_fsynced_then_unfsynced(server, "a")
    entry = aof.power_loss(server, server.log, "power_loss", random.Random(1), probe=False,  # type: ignore[attr-defined]
                           phase_seconds=0)
    print(entry)
    assert keys(server, "a") == fsynced
    assert entry["server"] == "loaded" and entry["kept_bytes"] == entry["fsynced_bytes"] == entry["cut_at"]
    assert entry["lost_commands"] == {"SET": len(unfsynced)}, entry
    assert entry["durable_until"] is not None and entry["durable_until"] <= entry["killed_at"]


def test_a_tail_torn_inside_a_command_loads_up_to_it(server: Server) -> None:
    """aof-load-truncated yes (the default): the partial command is dropped, the rest loaded."""
    fsynced, unfsynced = write_fsynced_then_unfsynced(server, "b")
    entry = aof.power_loss(server, server.log, "power_loss_torn", random.Random(2), probe=False,  # type: ignore[attr-defined]
                           phase_seconds=0)
    print(entry)
    present = keys(server, "b")
    assert fsynced <= present and present < fsynced | unfsynced
    assert entry["fsynced_bytes"] < entry["cut_at"] and entry["kept_bytes"] < entry["cut_at"]
    assert sum(entry["lost_commands"].values()) == len(fsynced | unfsynced) - len(present)
    assert any("truncat" in line.lower() for line in entry["server_said"]), entry["server_said"]


@pytest.mark.parametrize("server", [pytest.param("redis", marks=pytest.mark.slow), "valkey"], indirect=True)
def test_a_corrupt_aof_is_refused_then_repaired_by_the_operator_s_tool(server: Server) -> None:
    """A bad command in the fsynced part: the server will not start; redis-check-aof --fix
    (valkey-check-aof) cuts the file there, and the fault says what that cost. (A refused
    start takes about 3 s to notice, redis-py's retries of the probe: Redis's is slow-marked;
    Valkey's also covers its checker's fallback to the incr file.)"""
    fsynced, _ = write_fsynced_then_unfsynced(server, "c")
    entry = aof.power_loss(server, server.log, "aof_corrupt", random.Random(3), probe=False,  # type: ignore[attr-defined]
                           phase_seconds=0)
    print(entry)
    assert entry["server"] == "refused to load; loaded after check-aof --fix", entry
    assert "Bad file format" in entry["refusal"] or "Bad file format" in " ".join(entry["server_said"]), entry
    assert entry["repair"]["exit_code"] == 0, entry["repair"]
    present = keys(server, "c")
    # the corrupted command and everything after it, fsynced or not, is gone; before it, kept
    assert present < fsynced and len(fsynced) - len(present) == aof.CORRUPT_FROM_END, entry
    assert entry["kept_bytes"] == entry["corrupted_at"] == entry["repair"]["file_bytes_after"]
    # the one fsync covered bytes past the bad command: no fsync's bytes were all kept
    assert entry["durable_until"] is None, entry
