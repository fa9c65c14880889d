"""scripts/bench/script_ab.py runs a script's two versions on a real server and says the
ratio (a tiny run: the figures are the benchmark's, not the test's); floor.py and the
benchmark's --instructions count under callgrind."""

from __future__ import annotations

from contextlib import closing

import pytest

from conftest import require_kind
from scripts.bench import floor, script_ab
from scripts.bench.peers import Peer
from scripts.bench.script_ab import CallgrindServer
from scripts.bench.server_cost import CALLGRIND_ENV, Probe
from scripts.servers import Server


@pytest.mark.parametrize(("script", "variant"),
                         [("publish", "plain"), ("publish", "dedup"), ("publish", "fair"),
                                            ("consume", "plain"), ("consume", "fair"), ("ack", "plain")])
def test_an_ab_run_measures_both_versions(script: str, variant: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    require_kind("valkey")
    result = script_ab.run(script, "HEAD", "valkey", rounds=1, n=40, batch=4, variant=variant)
    assert result["old"] > 0 and result["new"] > 0 and result["ratio"] == result["new"] / result["old"]
    script_ab.main(["--script", script, "--rounds", "1", "-n", "20", "--batch", "4", "--variant", variant])
    assert "new/old" in capsys.readouterr().out


def test_instructions_are_counted_inside_evalsha_only() -> None:
    """Under callgrind the cost is the server's instructions inside EVALSHA: a publish with a
    dedup id (a sha1, the hold's read and write) counts more than one without, and a call
    counts tens of thousands, not the millions the server's idle loop would add."""
    require_kind("valkey")
    result = script_ab.run("publish", "HEAD", "valkey", rounds=1, n=30, batch=1, variant="dedup",
                           instructions=True)
    assert 20_000 < result["old"] < result["new"] < 1_000_000, result


def test_the_floor_orders_its_probes() -> None:
    """scripts/bench/floor.py: a call costs more than the bare shell, a publish's commands
    more than one call, and publish.lua (its checks and formatting too) more than its
    commands bare; a broken probe (one that errors, or measures nothing) breaks the order."""
    require_kind("valkey")
    costs = list(floor.measure("valkey", n=30).values())
    assert 5_000 < costs[0] < costs[1] < costs[2] < costs[3] < 1_000_000, costs


def test_single_operations_are_priced() -> None:
    """floor.py --ops: a redis.call costs more than any Lua operation, and tonumber (which
    converts twice in Lua 5.1) more than `+ 0`; the figures docs/performance.md quotes."""
    require_kind("valkey")
    costs = floor.operations("valkey", calls=20, loops=20)
    assert costs["redis.call('TIME')"] > max(v for k, v in costs.items() if k != "redis.call('TIME')")
    assert costs["tonumber of a string"] > costs["a string + 0"] > 0, costs


def test_a_probe_of_a_callgrind_server_counts_its_instructions_per_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """python -m scripts.bench --instructions: a probe of the server named by CALLGRIND_ENV
    reads the instructions it ran between two snapshots (everything: a request's reading and
    reply too), per message; two round trips a message count about twice one; a probe of
    another server reads none."""
    require_kind("valkey")
    with CallgrindServer("valkey", whole=True) as server, closing(server.client()) as client:
        assert server.process is not None
        monkeypatch.setenv(CALLGRIND_ENV, f"{server.process.pid}:{server.port}:{server.directory}")
        probe = Probe(Peer("lua", f"redislua://127.0.0.1:{server.port}/0"))

        def per_message(round_trips: int) -> float:
            before = probe.snapshot()
            for i in range(50 * round_trips):
                client.set(f"k{i % 50}", "v")
            return float(probe.cost(before, probe.snapshot(), 50)["instructions_per_msg"])

        one, two = per_message(1), per_message(2)
        assert 1_000 < one < 100_000 and 1.5 < two / one < 2.5, (one, two)
        assert Probe(Peer("lua", f"redislua://127.0.0.1:{server.port + 1}/0")).callgrind is None
        probe.close()


def test_a_stock_peer_s_requests_are_its_commands_whatever_else_ran() -> None:
    """kombu's stock transport sends commands, ours script calls: a stray EVALSHA of another
    process on the shared server during a stock phase left its requests per message read as
    the EVALSHAs alone (0.01 where it sent 10, the bench of 2026-12-08). A server of its own:
    nothing else reaches it between the snapshots."""
    require_kind("valkey")
    with Server("valkey") as server, closing(server.client()) as client:
        stock = Probe(Peer("stock", f"redis://127.0.0.1:{server.port}/1"))
        ours = Probe(Peer("lua", f"redislua://127.0.0.1:{server.port}/1"))
        before = stock.snapshot()
        for i in range(20):
            client.lpush("stock-like", i)
        client.eval("return 1", 0)  # someone else's script call
        after = stock.snapshot()
        assert stock.cost(before, after, 10)["requests_per_msg"] == 2.1  # 20 LPUSH + the stray EVAL
        assert ours.cost(before, after, 10)["requests_per_msg"] == 0.1  # ours: script calls only
        stock.close()
        ours.close()
