"""The chaos harness's verdict: which fault explains a second run of a task.

A worker that loses its connection goes on running what it had received, and the late acks
of those tasks are lost with the channel, so the message runs again. The fault then came
between the first delivery's receipt and its start: the verdict dates a delivery by its
receipt, which the chaos app stamps on it in the worker's consumer (a real worker here)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from helpers import wait_until
from scripts.chaos import verdict
from scripts.chaos.workers import ChaosWorker
from scripts.servers import Server

WINDOW = 60.0
# The Valkey cluster run of 2026-12-02 (seed 2): a primary_kill, then a task the threads
# worker had received just before it started 1.7 s after it, and ran again 4.4 s later.
KILL = {"kind": "primary_kill", "t": 1796199610.74921, "writes_until": 1796199610.74921,
        "failover": True, "queues": ["celery"]}


def run(t: float, received: float | None = None, worker: str = "w3-threads@chaos") -> dict[str, Any]:
    entry: dict[str, Any] = {"t": t, "worker": worker}
    if received is not None:
        entry["received"] = received
    return entry


def test_a_fault_between_receipt_and_start_explains_the_second_run() -> None:
    prev = run(1796199612.4850237, received=1796199610.52)
    assert verdict.attribute(prev, run(1796199616.8532083), [KILL], WINDOW) is KILL


def test_without_a_receipt_the_start_stands_in() -> None:
    """Entries of runs recorded before the stamp: the rule they were judged by."""
    prev = run(1796199612.4850237)
    assert verdict.attribute(prev, run(1796199616.8532083), [KILL], WINDOW) is None


def test_a_fault_well_before_the_receipt_explains_nothing() -> None:
    prev = run(1796199620.0, received=1796199615.0)
    assert verdict.attribute(prev, run(1796199625.0), [KILL], WINDOW) is None


def test_a_worker_fault_on_another_worker_explains_nothing() -> None:
    kill = {"kind": "worker_kill", "t": 1796199611.0, "target": "w1-prefork@chaos"}
    prev = run(1796199612.0, received=1796199610.5)
    assert verdict.attribute(prev, run(1796199616.0), [kill], WINDOW) is None
    assert verdict.attribute(prev, run(1796199616.0), [{**kill, "target": prev["worker"]}], WINDOW)


@pytest.fixture
def ledger_server() -> Iterator[Server]:
    with Server("valkey") as server:
        yield server


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_the_chaos_app_stamps_each_start_with_its_receipt(
        valkey_server: Server, ledger_server: Server, tmp_path: Path, pool: str) -> None:
    broker_url = f"redislua://127.0.0.1:{valkey_server.port}/0"
    ledger_url = f"redis://127.0.0.1:{ledger_server.port}/0"
    worker = ChaosWorker("stamp", pool, 1, {"CHAOS_BROKER_URL": broker_url, "CHAOS_LEDGER_URL": ledger_url},
                         tmp_path)
    producer = Celery("stamp", broker=broker_url, set_as_current=False)
    worker.start()
    try:
        producer.send_task("chaos.work", ("fast", 0.0), queue="celery")
        client = ledger_server.client()
        [raw] = wait_until(lambda: client.lrange("chaos:start", 0, -1), timeout=30,
                           what="the task's start in the ledger")
    finally:
        worker.stop()
        producer.close()
    start = json.loads(raw)
    assert isinstance(start["received"], float)
    assert start["t"] - 30 < start["received"] <= start["t"]
