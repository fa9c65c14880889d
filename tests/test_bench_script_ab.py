"""scripts/bench/script_ab.py runs a script's two versions on a real server and says the
ratio (a tiny run: the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import pytest

from conftest import require_kind
from scripts.bench import floor, script_ab


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
