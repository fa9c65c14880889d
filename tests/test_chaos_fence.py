"""The chaos harness's fenced brokers (issue 40 §3): a Sentinel group whose data servers run
with ``min-replicas-to-write 1``; the verdict's duplicates per failover fault and by when, on
hand-made ledgers (each mutant moves one duplicate to another phase or fault); the fence's
refusals counted from a real server's INFO errorstats across a kill; and a short run through
a fenced Redis group with a SENTINEL FAILOVER and a primary kill, in `make test`."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import redis

from scripts.chaos import ledger, report, verdict
from scripts.chaos.broker import FENCE_MAX_LAG, Broker
from scripts.chaos.profiles import PROFILES
from scripts.servers import Server
from test_chaos_smoke import chaos_harness, in_jepsen_terms

T0 = 1796300000.0
W1, W2 = "w1-prefork@chaos", "w3-threads@chaos"
# A SENTINEL FAILOVER at T0 whose old primary was demoted 11 s later (the window).
FAILOVER = {"kind": "sentinel_failover", "t": T0, "failover": True, "writes_until": T0 + 11.0,
            "old_primary": 1, "new_primary": 2}
KILL = {"kind": "primary_kill", "t": T0 + 40.0, "failover": True, "writes_until": T0 + 40.0}
WORKER_KILL = {"kind": "worker_kill", "t": T0 + 80.0, "target": W1}


def records_with(runs: dict[str, list[tuple[float, float]]],
                 faults: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A ledger: each task submitted 20 s before T0, one start per (received, started) pair
    (on W1, then W2 for the next), finished once."""
    records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in ledger.KINDS}
    for tid, starts in runs.items():
        records["submit"].append({"id": tid, "t": T0 - 20, "sent": T0 - 19.99, "kind": "fast",
                                  "priority": 0, "eligible": T0 - 20, "seconds": 0.1, "queue": "celery"})
        for i, (received, started) in enumerate(starts):
            records["start"].append({"id": tid, "kind": "fast", "t": T0 + started, "received": T0 + received,
                                     "worker": (W1, W2)[i % 2], "pid": 1, "delivery_count": i})
        records["finish"].append({"id": tid, "t": T0 + starts[-1][1] + 0.1, "worker": W2, "pid": 1})
        records["event"].append({"id": tid, "t": T0 + starts[-1][1] + 0.2})
    records["fault"] = faults
    return records


def judged(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    state = {"ready": 0, "unacked": 0, "unacked_index": 0, "pending": 0, "clean": True}
    return verdict.compute(records, state, PROFILES["smoke"], "ours")


# Received before the failover, again as its window closed; received in the window, again in
# it; received before, swept back late; and one duplicate across the primary kill.
RUNS = {"a": [(-2.0, -1.9), (11.5, 11.6)], "b": [(3.0, 3.1), (5.0, 5.1)],
        "c": [(-1.0, -0.9), (20.0, 20.1)], "d": [(39.0, 39.1), (45.0, 45.1)]}


def test_duplicates_per_failover_fault_and_by_when() -> None:
    v = judged(records_with(RUNS, [FAILOVER, KILL]))
    assert v["unattributable"] == 0
    assert v["duplicates_by_fault"] == {"sentinel_failover": 3, "primary_kill": 1}
    assert v["duplicates_per_fault"] == {"sentinel_failover": 3.0, "primary_kill": 1.0}
    by = v["failover_duplicates"]
    assert by["sentinel_failover"] == {"faults": 1, "duplicates": 3, "per_fault": 3.0, "phases": {
        "before -> on_close": 1, "during -> during": 1, "before -> later": 1}}
    assert by["primary_kill"] == {"faults": 1, "duplicates": 1, "per_fault": 1.0,
                                  "phases": {"before -> later": 1}}
    assert v["verdict"] == "PASS", v["unattributable_examples"]


def test_per_fault_divides_by_every_fault_of_the_kind_applied() -> None:
    """Two failovers, duplicates after one of them: 1.5 per fault, not 3."""
    second = {**FAILOVER, "t": T0 + 60.0, "writes_until": T0 + 71.0}
    v = judged(records_with(RUNS, [FAILOVER, KILL, second]))
    assert v["failover_duplicates"]["sentinel_failover"]["faults"] == 2
    assert v["failover_duplicates"]["sentinel_failover"]["per_fault"] == 1.5
    assert v["duplicates_per_fault"]["sentinel_failover"] == 1.5


@pytest.mark.parametrize(("mutant", "phase"), [
    ((11.0 + verdict.ON_CLOSE_SECONDS + 0.5), "before -> later"),  # past the close: swept back
    (10.0, "before -> during"),  # still inside the window
])
def test_a_duplicate_moved_in_time_changes_its_phase(mutant: float, phase: str) -> None:
    v = judged(records_with({"a": [(-2.0, -1.9), (mutant, mutant + 0.1)]}, [FAILOVER]))
    assert v["failover_duplicates"]["sentinel_failover"]["phases"] == {phase: 1}


def test_a_duplicate_a_worker_fault_explains_is_no_failovers() -> None:
    v = judged(records_with({"w": [(79.5, 79.6), (85.0, 85.1)]}, [FAILOVER, WORKER_KILL]))
    assert v["duplicates_by_fault"] == {"worker_kill": 1}
    assert v["failover_duplicates"] == {}


def test_the_report_and_the_jepsen_table_show_them() -> None:
    v = judged(records_with(RUNS, [FAILOVER, KILL]))
    line = report.failover_duplicates_line(v["failover_duplicates"])
    assert "sentinel_failover 3 in 1 faults, 3.00 per fault (" in line, line
    errors = {"NOREPLICAS": 7, "READONLY": 2}
    assert "NOREPLICAS 7" in report.refusals_line(errors) and "READONLY 2" in report.refusals_line(errors)
    card = {"run": {"transport": "ours", "broker": "redis-sentinel-fenced", "profile": "smoke", "seed": 1,
                    "server_errors": errors}, "verdict": v}
    table = report.jepsen_table([card])
    assert "| duplicates per sentinel_failover | 3.00 |" in table, table
    assert "| writes refused by the fence (NOREPLICAS) | 7 |" in table, table
    assert "| lost, explained by unreplicated writes at a failover | 0 |" in table, table
    longer = {**card, "run": {**card["run"], "profile_settings": {"visibility_timeout": 20.0}}}
    assert "redis-sentinel-fenced, smoke s1, visibility 20 s |" in report.jepsen_table([longer])
    assert "smoke s1 |" in report.jepsen_table([{**card, "run": {**card["run"], "profile_settings": {
        "visibility_timeout": PROFILES["smoke"].visibility_timeout}}}])


def test_a_fenced_kind_starts_every_data_server_with_the_fence() -> None:
    broker = Broker.create("redis-sentinel-fenced")
    assert broker.group is not None and broker.fenced and not Broker.create("redis-sentinel").fenced
    args = list(broker.group.args)
    assert args[args.index("--min-replicas-to-write") + 1] == "1"
    assert args[args.index("--min-replicas-max-lag") + 1] == str(FENCE_MAX_LAG)
    assert PROFILES["long"].visibility_timeout > FENCE_MAX_LAG  # acks refused no longer than a lease
    assert Broker.create("redis-sentinel2-fenced").group.replicas == 2  # type: ignore[union-attr]


def test_refusals_counted_across_a_kill() -> None:
    """A primary without its replica refuses a write (NOREPLICAS); its counts are banked
    before a kill, so the restarted server's fresh counts add to them."""
    chaos_harness("redis")
    server = Server("redis", args=["--min-replicas-to-write", "1", "--min-replicas-max-lag", "5"]).start()
    broker = Broker("redis-sentinel-fenced", server=server)
    try:
        client = server.client()
        for _ in range(3):
            with pytest.raises(redis.ResponseError, match=r"^NOREPLICAS"):
                client.set("k", "v")
        assert client.get("k") is None  # reads go on
        assert broker.refusals()["NOREPLICAS"] == 3
        broker.bank_errors(server)
        server.kill()
        server.start()
        with pytest.raises(redis.ResponseError, match=r"^NOREPLICAS"):
            server.client().set("k", "v")
        assert broker.refusals()["NOREPLICAS"] == 4
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_a_short_run_through_a_fenced_sentinel_group() -> None:
    """About 35 s of load on a fenced Redis group (one replica) with a SENTINEL FAILOVER and a
    SIGKILL of the primary: the fence refused writes (each new primary has no replica until
    the old one rejoins it), the transport waited them out, and nothing was lost, none of it
    to unreplicated writes."""
    chaos = chaos_harness("redis")
    card = chaos.run(chaos.parse(["--profile", "smoke", "--broker", "redis-sentinel-fenced", "--seed", "501",
                                  "--load-seconds", "35", "--faults", "sentinel_failover,primary_kill",
                                  "--no-doc"]))
    v = card["verdict"]
    detail = {key: v[key] for key in ("lost_ids", "broker", "unattributable_examples", "faults_applied",
                                      "failover_duplicates")}
    applied = Counter(v["faults_applied"])
    assert applied == Counter({"sentinel_failover": 1, "primary_kill": 1}), card["faults"]
    assert v["failovers"] == 2 and not [f for f in card["faults"] if f.get("error")], card["faults"]
    assert card["run"]["server_errors"].get("NOREPLICAS", 0) > 0, card["run"]["server_errors"]
    assert v["lost"] == 0 and v["lost_explained_by_failover"] == 0, detail
    in_jepsen_terms(v, detail)
    assert v["verdict"] == "PASS", detail


def test_err_in_the_servers_refusals_counts_connection_handshakes(redis_server: Server) -> None:
    """The scorecard's ERR count is mostly new connections' handshakes (the report line says
    so): redis-py 8 sends CLIENT SETINFO (twice) and CLIENT MAINT_NOTIFICATIONS, which Redis
    7.0 refuses with ERR. If redis-py stops, the line's explanation is wrong: this fails."""
    def errs() -> int:
        return int(redis_server.client().info("errorstats").get("errorstat_ERR", {}).get("count", 0))
    before = errs()  # that client's own handshake is counted before the read
    for _ in range(5):
        client = redis_server.client()
        client.ping()
        client.close()
    assert errs() - before == 5 * 3 + 3  # five connections and the last read's own
    assert "ERR 12 (mostly new connections' handshakes" in report.refusals_line({"ERR": 12})
