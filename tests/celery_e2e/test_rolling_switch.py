"""A rolling switch from kombu's stock Redis transport: a stock Celery worker and one of ours
on one database, each fed by its own producers, run every task without an error (no key of
ours is one of stock's), and what the stock side left behind migrates over."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Server

from .harness import Broker, Worker, running, wait_for

ON_REDIS = True  # its Redis run is in `make test` too (conftest.py)


def test_a_stock_worker_and_ours_share_one_database(servers: tuple[Server, Server],
                                                    log_dir: Path) -> None:
    broker_server, results = servers
    stock = Broker(broker_url=f"redis://127.0.0.1:{broker_server.port}/0", result_url=results.url)
    ours = Broker(broker_url=f"redislua://127.0.0.1:{broker_server.port}/0", result_url=results.url,
                  transport_options={"sweep_interval": 1})
    producers = {name: Celery(f"{name}-producer", broker=b.broker_url, set_as_current=False)
                 for name, b in (("stock", stock), ("ours", ours))}
    old = Worker(stock, name="stock-worker", log_dir=log_dir)
    new = Worker(ours, name="our-worker", log_dir=log_dir)
    with running(old, new):
        for i in range(20):
            for name, app in producers.items():
                app.send_task("celery_e2e.app.note", (f"{name}-{i}",))
        wait_for(lambda: len(ours.entries("ran")) >= 40, timeout=60, what="all 40 tasks ran")
        ran = {e["label"]: e["hostname"] for e in ours.entries("ran")}
        assert {label for label in ran if label.startswith("stock-")} == {f"stock-{i}" for i in range(20)}
        expected_host = {"stock": "stock-worker@", "ours": "our-worker@"}
        for label, host in ran.items():
            assert host.startswith(expected_host[label.split("-")[0]]), (label, host)
        # Both answer remote control on the same database, each through its own transport.
        for name, app in producers.items():
            hosts = [host for reply in app.control.ping(timeout=5) for host in reply]
            assert len(hosts) == 1 and hosts[0].startswith(expected_host[name]), hosts
    for worker in (old, new):
        log = worker.log_path.read_text()
        assert "WRONGTYPE" not in log and "Traceback" not in log, worker.log_tail()
    # Tasks sent to the stock side after its worker stopped: migrated into ours, then run.
    for i in range(5):
        producers["stock"].send_task("celery_e2e.app.note", (f"late-{i}",))
    command = [sys.executable, "-m", "celery_redis_lua", "migrate", "--from", stock.broker_url,
               "--url", ours.broker_url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "moved 5 message(s)" in done.stdout, done.stderr
    lib = ScriptLibrary(broker_server.client(), Keyspace())
    assert lib.stats(["celery"])[0].ready == 5
    with running(Worker(ours, name="after", log_dir=log_dir)):
        wait_for(lambda: {f"late-{i}" for i in range(5)} <= {e["label"] for e in ours.entries("ran")},
                 timeout=60, what="the migrated tasks ran")
