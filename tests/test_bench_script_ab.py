"""scripts/bench/script_ab.py runs a script's two versions on a real server and says the
ratio (a tiny run: the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import pytest

from conftest import require_kind
from scripts.bench import script_ab


@pytest.mark.parametrize(("script", "variant"),
                         [("publish", "plain"), ("publish", "dedup"), ("publish", "fair"),
                                            ("consume", "plain"), ("consume", "fair")])
def test_an_ab_run_measures_both_versions(script: str, variant: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    require_kind("valkey")
    result = script_ab.run(script, "HEAD", "valkey", rounds=1, n=40, batch=4, variant=variant)
    assert result["old"] > 0 and result["new"] > 0 and result["ratio"] == result["new"] / result["old"]
    script_ab.main(["--script", script, "--rounds", "1", "-n", "20", "--batch", "4", "--variant", variant])
    assert "new/old" in capsys.readouterr().out
