"""Queues of stopped workers leave ``status`` and the exporter with their keys (issue 42
§1.1): each worker with events and remote control has a ``celeryev.<uuid>`` and a
``<hostname>.celery.pidbox`` queue, which expire x-expires after the worker stops, while
their bindings go stale only later (``binding_lifetime_floor``). Real workers start and
stop; within one binding lifetime only the live worker's queues are listed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from celery_redis_lua.tools.exporter import serve
from scripts.servers import free_port

from .harness import TESTS_DIR, Broker, Worker, running, wait_for

EXPIRES = 10  # s: x-expires of each worker's celeryev and pidbox queues (the least declare takes)
BINDING = 30  # s: binding_lifetime_floor, so their bindings outlive the queues by 20 s


def status_queues(broker: Broker) -> set[str]:
    """What ``celery-redis-lua status --json`` lists."""
    done = subprocess.run([sys.executable, "-m", "celery_redis_lua", "status", "--json",
                           "--url", broker.broker_url], capture_output=True, text=True, timeout=60,
                          cwd=TESTS_DIR)
    assert done.returncode == 0, done.stderr
    return {row["queue"] for row in json.loads(done.stdout)["queues"]}


def exported_queues(port: int) -> set[str]:
    """Every queue named by any series of the exporter's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {sample.labels.get("queue") or sample.labels["queue_name"]
            for family in text_string_to_metric_families(text) for sample in family.samples
            if "queue" in sample.labels or "queue_name" in sample.labels}


def workers_queues(names: set[str]) -> tuple[set[str], set[str]]:
    """The celeryev and the pidbox queues among ``names``."""
    return ({n for n in names if n.startswith("celeryev.")},
            {n for n in names if n.endswith(".celery.pidbox")})


def test_status_and_the_exporter_list_only_live_queues(broker: Broker, log_dir: object) -> None:
    broker.transport_options["binding_lifetime_floor"] = BINDING

    def worker(name: str) -> Worker:
        return Worker(broker, name=name, concurrency=1, gossip=True, extra_args=["-E"],
                      env={"CRL_QUEUE_EXPIRES": str(EXPIRES)}, log_dir=log_dir)  # type: ignore[arg-type]

    port, server = free_port(), None
    try:
        with running(worker("live")):
            with running(*(worker(f"gone{i}") for i in range(3))):
                every = wait_for(lambda: (names := status_queues(broker)) and all(
                    len(kind) == 4 for kind in workers_queues(names)) and names,
                    timeout=30, interval=0.2, what="the four workers' celeryev and pidbox queues")
                # Discovery every 30 s (the default): its first, now, is the last of the test,
                # so the scrapes themselves must see the stopped workers' queues go.
                server, _ = serve(broker.lib(), port=port, address="127.0.0.1")
                assert exported_queues(port) == every
            stopped = time.monotonic()  # the three workers have exited

            last: list[tuple[set[str], set[str]]] = []

            def only_live() -> set[str] | None:
                listed, exported = status_queues(broker), exported_queues(port)
                last[:] = [(listed, exported)]
                events, pidboxes = workers_queues(listed)
                return listed if listed == exported and len(events) == 1 and len(pidboxes) == 1 else None

            try:
                live = wait_for(only_live, timeout=EXPIRES + 5, interval=0.2, what="only live queues")
            except AssertionError:
                [(listed, exported)] = last
                raise AssertionError(f"{time.monotonic() - stopped:.1f} s after the stop, status lists "
                                     f"{sorted(listed)}, the exporter {sorted(exported)}") from None
            assert time.monotonic() - stopped < BINDING  # well within one binding lifetime
        [events], [pidbox] = workers_queues(live)
        assert events in every and pidbox.startswith("live@")
        assert "celery" in live
    finally:
        if server is not None:
            server.shutdown()
