"""scripts/bench/iothreads.py runs our transport on a Valkey with io-threads on and off (a
tiny run: the figures are the benchmark's, not the test's)."""

from __future__ import annotations

from conftest import require_kind
from scripts.bench.iothreads import one_level


def test_each_phase_is_measured_on_the_main_thread_and_the_whole_server() -> None:
    require_kind("valkey")
    for level in (1, 2):
        result = one_level(level, publishers=2, n=40, size=100)
        assert set(result) == {"publish_main", "publish_all", "consume_main", "consume_all"}
        assert 0 < result["publish_main"] <= result["publish_all"] + 1
        assert 0 < result["consume_main"] <= result["consume_all"] + 1
