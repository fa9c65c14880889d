"""`celery-redis-lua publish` is a Celery producer: a real worker runs what it publishes,
with the given args and kwargs, in priority order among tasks sent by Celery itself, and a
countdown not before it is due (by the broker's clock).

Everything is published before the worker starts; with concurrency 1 and prefetch 1 the
order of the ledger's 'ran' entries is the order in which the broker handed them out.
The worker's ``time.time()`` and the broker's TIME read the same kernel clock (same
machine), as in test_countdown.py.
"""

from __future__ import annotations

from pathlib import Path

from celery import Celery
from click.testing import CliRunner

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.tools.cli import main
from scripts.servers import Server

from .harness import Broker, Worker, running, wait_for

TASK = "celery_e2e.app.note"
COUNTDOWN = 3.0


def cli_publish(broker: Broker, *options: str) -> str:
    result = CliRunner().invoke(main, ["publish", TASK, *options, "--url", broker.broker_url])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def test_worker_runs_cli_published_tasks_in_priority_order_and_after_their_countdown(
        broker: Broker, producer: Celery, servers: tuple[Server, Server], log_dir: Path) -> None:
    client = servers[0].client()
    lib = ScriptLibrary(client, Keyspace())
    ids = {
        "cli-p0": cli_publish(broker, "--args", '["cli-p0"]', "--priority", "0"),
        "celery-p3": producer.send_task(TASK, ("celery-p3",), priority=3).id,
        "cli-p9": cli_publish(broker, "--kwargs", '{"label": "cli-p9"}', "--priority", "9"),
        "celery-p5": producer.send_task(TASK, ("celery-p5",), priority=5).id,
    }
    assert lib.stats(["celery"])[0].ready == 4  # the whole backlog waits in the broker

    worker = Worker(broker, name="cli-producer", concurrency=1, env={"CRL_PREFETCH": "1"},
                    log_dir=log_dir)
    with running(worker):
        wait_for(lambda: len(broker.entries("ran")) >= 4, timeout=60, what="the backlog to run")
        # Now the worker is idle: a countdown the CLI failed to pass on would run at once.
        seconds, micros = client.time()
        sent = seconds + micros / 1_000_000
        ids["cli-later"] = cli_publish(broker, "--args", '["cli-later"]', "--priority", "255",
                                       "--countdown", str(COUNTDOWN))
        assert lib.stats(["celery"])[0].delayed == 1
        wait_for(lambda: len(broker.entries("ran")) >= 5, timeout=30, what="the countdown task")
    ran = {entry["label"]: entry for entry in broker.entries("ran")}
    assert {label: entry["id"] for label, entry in ran.items()} == ids  # each ran once, by its id
    assert [e["label"] for e in broker.entries("ran")] == [
        "cli-p9", "celery-p5", "celery-p3", "cli-p0", "cli-later"]
    later = ran["cli-later"]
    assert later["at"] - sent >= COUNTDOWN, f"ran {later['at'] - sent:.3f}s after publish"
    assert (later["delivery_count"], later["redelivered"]) == (0, False)
