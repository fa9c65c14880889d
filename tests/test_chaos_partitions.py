"""Partitions with the kernel's tools (issue 40 §1, scripts/chaos/netns.py, partitions.py).

Cheap: the recovery measure and the partition rules of the verdict on hand-made ledgers.
Real (root and network namespaces, else skipped with the reason): a cut is a silent drop
for an established connection (a timeout, no RST), a one-way cut lets the client's
commands through and drops the replies, and a short chaos schedule with every partition
kind passes with each kind's recovery within the limit (latency reported unavailable where
the kernel has no netem)."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Any

import pytest

from scripts.chaos import ledger, netns, partitions, verdict
from scripts.chaos.profiles import PROFILES
from scripts.servers import ServerUnavailable, server_binary
from tests.test_chaos_smoke import chaos_harness, in_jepsen_terms

T0 = 1796300000.0
W1, W2 = "w1-prefork@chaos", "w3-threads@chaos"


def cut(kind: str, at: float, healed: float, target: str = W1, pid: int | None = 11) -> dict[str, Any]:
    return {"kind": kind, "t": T0 + at, "target": target, "target_pid": pid,
            "oneway": kind.endswith("oneway"), "healed": T0 + healed, "writes_until": T0 + healed,
            "partitioned_seconds": healed - at}


def records() -> dict[str, list[dict[str, Any]]]:
    return {kind: [] for kind in ledger.KINDS}


def batch(at: float, pid: int, tid: str = "x") -> dict[str, Any]:
    return {"t": T0 + at, "after": T0 + at - 0.01, "pid": pid, "channel": 1,
            "deliveries": [["celery", tid, 0]]}


def test_recovery_is_the_first_consume_of_the_cut_worker_after_the_heal() -> None:
    found = records()
    found["batch"] = [batch(9.0, 11), batch(10.5, 22), batch(11.2, 11), batch(12.0, 11),
                      batch(31.0, 11), batch(40.0, 11)]
    found["submit"] = [{"id": "p", "t": T0 + 20.9, "sent": T0 + 21.3, "eligible": T0 + 20.9}]
    faults = [cut("partition_worker", 0.0, 10.0), cut("partition_oneway", 25.0, 30.0),
              cut("partition_producer", 15.0, 20.0, target="producer", pid=None),
              {"kind": "latency", "t": T0 + 33, "skipped": "no netem qdisc on this kernel"}]
    result = partitions.recovery(found, faults)
    assert result["kinds"]["partition_worker"] | {"never_examples": []} == {
        "partitions": 1, "p50": 1.2, "p99": 1.2, "max": 1.2, "never_recovered": 0, "never_examples": [],
        "ok": True}
    assert result["kinds"]["partition_oneway"]["max"] == 1.0
    assert result["kinds"]["partition_producer"]["max"] == 1.3  # the first publish confirmed after
    assert result["skipped"] == {"latency": "no netem qdisc on this kernel"}
    assert result["ok"]
    assert "latency skipped: no netem" in partitions.line(result)


def test_a_slow_or_missing_recovery_fails_its_kind() -> None:
    found = records()
    found["batch"] = [batch(16.0, 11)]
    slow = partitions.recovery(found, [cut("partition_worker", 0.0, 10.0)])
    assert slow["kinds"]["partition_worker"]["p99"] == 6.0 and not slow["ok"]
    never = partitions.recovery(found, [cut("partition_oneway", 20.0, 30.0)])
    assert never["kinds"]["partition_oneway"]["never_recovered"] == 1 and not never["ok"]
    assert "**FAILS**" in partitions.line(never)


def test_without_batches_a_start_received_after_the_heal_counts() -> None:
    found = records()
    found["start"] = [{"id": "a", "t": T0 + 14.0, "worker": W1, "received": T0 + 13.0},
                      {"id": "b", "t": T0 + 12.0, "worker": W2, "received": T0 + 11.0}]
    result = partitions.recovery(found, [cut("partition_worker", 0.0, 10.0)])
    assert result["kinds"]["partition_worker"]["p50"] == 3.0


def run_twice(found: dict[str, list[dict[str, Any]]], tid: str, first: str, second: str) -> None:
    found["submit"].append({"id": tid, "t": T0 + 1, "sent": T0 + 1.01, "eligible": T0 + 1, "kind": "fast",
                            "priority": 0, "seconds": 0.01, "queue": "celery"})
    found["batch"] += [batch(2.0, 11, tid), batch(20.0, 22, tid), batch(12.0, 11)]
    found["start"] += [{"id": tid, "t": T0 + 2.0, "worker": first, "pid": 11, "received": T0 + 1.9},
                       {"id": tid, "t": T0 + 20.0, "worker": second, "pid": 22, "received": T0 + 19.9}]
    found["finish"] += [{"id": tid, "t": T0 + 20.1, "worker": second, "pid": 22}]
    found["event"] = [{"id": tid, "t": T0 + 20.1}]


def judged(found: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return verdict.compute(found, {"pending": 0, "clean": True}, PROFILES["smoke"], "ours")


def test_a_duplicate_is_the_partition_of_the_worker_that_held_the_task() -> None:
    found = records()
    run_twice(found, "t1", W1, W2)
    found["fault"] = [cut("partition_worker", 3.0, 10.0, target=W1)]
    result = judged(found)
    assert result["duplicates_by_fault"] == {"partition_worker": 1} and result["unattributable"] == 0
    assert result["partitions"]["kinds"]["partition_worker"]["p50"] == 2.0
    assert result["verdict"] == "PASS", result


def test_a_stale_copy_run_by_the_partitioned_worker_is_its_partitions_duplicate() -> None:
    """The second run on the partitioned worker (a delivery it held across the cut, its lease
    lapsed meanwhile), the first on a worker nobody cut off, of the delivery that followed."""
    found = records()
    run_twice(found, "t1", W2, W1)
    found["start"][0]["delivery_count"], found["start"][1]["delivery_count"] = 1, 0
    found["fault"] = [cut("partition_oneway", 1.5, 10.0, target=W1)]
    result = judged(found)
    assert result["duplicates_by_fault"] == {"partition_oneway": 1} and result["unattributable"] == 0


def test_a_stale_copy_is_attributed_when_the_first_run_was_received_after_the_heal() -> None:
    """The partitioned worker received the message before its cut and held it across; the
    lease lapsed, another worker received the redelivery after the heal and ran it; then the
    partitioned worker ran its stale copy (the short schedule of 2026-12-07 00:02, six such)."""
    found = records()
    run_twice(found, "t1", W2, W1)
    found["start"][0].update(delivery_count=1, t=T0 + 16.0, received=T0 + 15.5)
    found["start"][1].update(delivery_count=0, received=T0 + 1.5)
    found["fault"] = [cut("partition_worker", 5.0, 12.0, target=W1)]
    result = judged(found)
    assert result["duplicates_by_fault"] == {"partition_worker": 1}, result["unattributable_examples"]


def test_a_publish_across_the_producers_cut_stored_twice_is_its_duplicate() -> None:
    """The publish reached the broker just as the cut came, its reply did not come back; the
    producer's retry after the heal stored it again: two first deliveries, each run once."""
    found = records()
    run_twice(found, "t1", W1, W2)
    found["submit"][0]["sent"] = T0 + 19.5  # returned after the heal, on the retry
    found["fault"] = [cut("partition_producer", 1.02, 19.0, target="producer", pid=None)]
    result = judged(found)
    assert result["duplicates_by_fault"] == {"partition_producer": 1}, result["unattributable_examples"]
    assert result["duplicates_of_retried_publishes"] == 1


def test_another_workers_or_the_producers_partition_explains_no_duplicate() -> None:
    for fault in (cut("partition_worker", 3.0, 10.0, target=W2, pid=22),
                  cut("partition_producer", 3.0, 10.0, target="producer", pid=None)):
        found = records()
        run_twice(found, "t1", W1, W2)
        found["fault"] = [fault]
        result = judged(found)
        assert result["unattributable"] == 1 and result["verdict"] == "FAIL", fault["kind"]


def test_a_kind_recovering_too_slowly_fails_the_run() -> None:
    found = records()
    run_twice(found, "t1", W1, W1)
    found["batch"] = [batch(2.0, 11, "t1"), batch(20.0, 11, "t1")]
    found["fault"] = [cut("partition_oneway", 3.0, 10.0, target=W1)]
    result = judged(found)
    assert result["duplicates_by_fault"] == {"partition_oneway": 1}
    assert result["partitions"]["kinds"]["partition_oneway"]["p99"] == 10.0
    assert result["verdict"] == "FAIL"


# -- real namespaces ----------------------------------------------------------------------

def needs_namespaces() -> None:
    why = netns.unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")


def namespaces_left() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith("crl-part-")]


def exchange(sock: socket.socket, command: bytes) -> bytes | str:
    sock.sendall(command)
    try:
        return sock.recv(64)
    except OSError as error:
        return type(error).__name__


@pytest.mark.timeout(120)
def test_a_cut_drops_silently_and_a_oneway_cut_lets_commands_through() -> None:
    needs_namespaces()
    try:
        server_binary("valkey")
    except ServerUnavailable as error:
        pytest.skip(str(error))
    from scripts.chaos.broker import NetnsServer

    network = netns.Topology(("harness", "client")).create()
    server = NetnsServer("valkey", topology=network)
    try:
        server.start()
        address = (network.broker_address("client"), server.port)
        client = socket.create_connection(address, timeout=2)
        assert exchange(client, b"PING\r\n") == b"+PONG\r\n"
        network.partition("client")
        began = time.monotonic()
        assert exchange(client, b"PING\r\n") == "TimeoutError"  # no RST, no ICMP: a silent drop
        assert time.monotonic() - began >= 1.9
        with pytest.raises(TimeoutError):
            socket.create_connection(address, timeout=2)  # the SYN is dropped too
        assert exchange(client, b"SET both-ways yes\r\n") == "TimeoutError"
        assert server.client(socket_timeout=5).get("both-ways") is None  # it never arrived
        network.heal("client")
        client.settimeout(10)
        replies = b""  # the same connection: its PING and SET retransmitted, each answered
        while not replies.endswith(b"+OK\r\n"):
            replies += client.recv(64)
        assert replies == b"+PONG\r\n+OK\r\n"
        network.partition("client", oneway=True)
        assert exchange(client, b"SET partitioned yes\r\n") == "TimeoutError"
        assert server.client(socket_timeout=5).get("partitioned") == b"yes"  # it arrived, ran
        network.heal("client")
    finally:
        server.stop()
        network.destroy()
    assert network.name not in namespaces_left()


@pytest.mark.timeout(240)
def test_a_short_schedule_of_every_partition_kind_passes() -> None:
    """Issue 40 §1 in `make test`: Valkey in its own namespace, each partition kind once
    (2-4 s), then the verdict: PASS, every duplicate attributed, recovery within 5 s."""
    needs_namespaces()
    chaos = chaos_harness("valkey")
    card = chaos.run(chaos.parse(["--broker", "valkey", "--seed", "44", "--partitions",
                                  "--load-seconds", "52",
                                  "--faults", "partition_worker,partition_producer,partition_oneway,latency",
                                  "--partition-seconds", "2,4", "--no-doc"]))
    result = card["verdict"]
    detail = {key: result.get(key) for key in ("partitions", "faults_applied", "faults_skipped", "lost_ids",
                                               "unattributable_examples", "broker")}
    assert set(result["faults_applied"]) == set(partitions.CUTS), detail
    assert card["run"]["partitions"]["namespaces"] == "available"
    why_not_latency = netns.netem_unavailable()
    assert ("latency" in result["faults_skipped"]) == bool(why_not_latency), detail
    for kind in partitions.CUTS:
        assert result["partitions"]["kinds"][kind]["p99"] <= partitions.RECOVERY_LIMIT, detail
    in_jepsen_terms(result, detail)
    assert result["unattributable"] == 0 and result["lost"] == 0, detail
    assert result["verdict"] == "PASS", detail
    assert not [name for name in namespaces_left() if name == card["run"]["topology"]["namespace"]]


def test_a_namespace_left_by_a_dead_harness_is_removed_and_no_other() -> None:
    needs_namespaces()
    dead, alive = "crl-part-999999999-1", "crl-part-1-1"  # no such pid; pid 1 (init) lives
    for name in (dead, alive):
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        assert dead in netns.remove_stale()
        assert dead not in namespaces_left() and alive in namespaces_left()
    finally:
        for name in (dead, alive):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
