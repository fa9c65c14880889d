"""The benchmark rotates its peers from one repetition to the next: the first peer of a round
ran 8-20 % faster on the Celery threads rows (docs/bench/keeper-ab-20261204.md), so a fixed
order would bias every ratio the same way."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from scripts.bench.__main__ import jobs


def test_each_peer_runs_first_in_turn() -> None:
    options = argparse.Namespace(variants=["threads_late"], drains=[], mech_workers=[], shutdown=False,
                                 repeat=3, memory_n=0, backlog_sizes=[])
    peers = [SimpleNamespace(name=name, publish_variant=False) for name in ("a", "b", "c")]
    todo = jobs(options, peers)  # type: ignore[arg-type]
    firsts = {rep: next(p.name for r, s, p in todo if r == rep and s == "celery_threads_late")
              for rep in (1, 2, 3)}
    assert firsts == {1: "a", 2: "b", 3: "c"}
    assert sorted((r, s, p.name) for r, s, p in todo) == sorted(
        (r, s, name) for r in (1, 2, 3) for s in ("kombu", "celery_threads_late") for name in "abc")
