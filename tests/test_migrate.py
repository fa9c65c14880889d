"""Moving in from kombu's stock Redis transport: celery-redis-lua migrate moves what stock
kombu holds (every priority list, and the unacked hash) into our queues exactly once, in
stock's delivery order, and a migration killed in the middle and run again loses and
duplicates nothing. Stock messages are made by real stock kombu / Celery producers."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Queue

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.tools.migrate import Migration
from conftest import require_kind
from helpers import wait_until
from scripts.servers import Server

DIES_HOLDING_TWO = """
import os, signal, sys
from kombu import Connection, Consumer, Queue
with Connection(sys.argv[1]) as connection:
    got = []
    with Consumer(connection, [Queue("celery")], callbacks=[lambda body, m: got.append(m)],
                  prefetch_count=2):
        while len(got) < 2:
            connection.drain_events(timeout=10)
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(params=["valkey", "redis"])
def stock_and_ours(request: pytest.FixtureRequest) -> Iterator[tuple[Server, Server]]:
    require_kind(request.param)
    with Server(request.param) as stock, Server(request.param) as ours:
        yield stock, ours


def stock_app(server: Server) -> Celery:
    app = Celery("stock-producer", broker=f"redis://127.0.0.1:{server.port}/0", set_as_current=False)
    app.conf.broker_transport_options = {"queue_order_strategy": "priority"}
    return app


def send(app: Celery, label: str, priority: int = 0, queue: str = "celery") -> str:
    return app.send_task("tasks.note", (label,), priority=priority, queue=queue).id


def drain_ours(lib: ScriptLibrary, queue: str) -> list[tuple[str, str]]:
    """(label, task id) in our delivery order."""
    got = []
    while deliveries := lib.consume([queue], 100).deliveries:
        for d in deliveries:
            envelope = json.loads(d.payload)
            got.append((envelope["headers"]["argsrepr"].strip("(),'"), envelope["headers"]["id"]))
            lib.ack(queue, [d.id])
    return got


def test_a_migration_keeps_stock_delivery_order_and_unacked_messages(
        stock_and_ours: tuple[Server, Server]) -> None:
    stock, ours = stock_and_ours
    app = stock_app(stock)
    plan = [("p0-a", 0), ("p9-a", 9), ("p5-a", 5), ("p0-b", 0), ("p3-a", 3), ("p9-b", 9), ("p7-a", 7)]
    sent = {label: send(app, label, priority) for label, priority in plan}
    sent["other"] = send(app, "other", queue="reports")
    # A stock worker that died (SIGKILL) holding two messages, prefetched and unacked.
    died = subprocess.run([sys.executable, "-c", DIES_HOLDING_TWO, f"redis://127.0.0.1:{stock.port}/0"],
                          capture_output=True, text=True, timeout=60)
    assert died.returncode == -signal.SIGKILL and "held" in died.stdout, died.stderr
    assert stock.client().hlen("unacked") == 2

    lib = ScriptLibrary(ours.client(), Keyspace())
    before = Migration(stock.client(), lib).run(dry_run=True)
    assert before.planned == {"celery": 7 - 2, "reports": 1, "(unacked, routed by their routing key)": 2}
    report = Migration(stock.client(), lib).run()
    assert (report.moved, report.skipped) == ({"celery": 7, "reports": 1}, [])
    assert stock.client().hlen("unacked") == 0 and not stock.client().keys("_crl.migrating:*")
    assert not ours.client().keys("migrated:*")  # records go when the migration is complete
    order = drain_ours(lib, "celery")
    assert sorted(tid for _, tid in order) == sorted(v for k, v in sent.items() if k != "other")
    labels = [label for label, _ in order]
    # stock delivers step 0 (priorities 0-2) first, then 3-5, 6-8, 9; FIFO within a step.
    assert [x for x in labels if x in {"p0-a", "p0-b"}] == ["p0-a", "p0-b"]  # the two held ones
    steps = {"p0-a": 0, "p0-b": 0, "p3-a": 3, "p5-a": 3, "p7-a": 6, "p9-a": 9, "p9-b": 9}
    assert [steps[x] for x in labels] == sorted(steps[x] for x in labels)
    assert drain_ours(lib, "reports")[0][1] == sent["other"]


def test_a_killed_migration_run_again_moves_each_message_once(stock_and_ours: tuple[Server, Server]) -> None:
    stock, ours = stock_and_ours
    source = stock.client()
    app = stock_app(stock)
    with app.producer_or_acquire() as producer:
        for i in range(3000):
            app.send_task("tasks.note", (f"m{i:04d}",), priority=(0, 9)[i % 2], producer=producer)
    expected = {json.loads(raw)["headers"]["id"] for key in ("celery", "celery\x06\x169")
                for raw in source.lrange(key, 0, -1)}
    assert len(expected) == 3000
    command = [sys.executable, "-m", "celery_redis_lua", "migrate",
               "--from", f"redis://127.0.0.1:{stock.port}/0", "--url", ours.url]
    lib = ScriptLibrary(ours.client(), Keyspace())
    for kill_at in (400, 1500):
        migration = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(lambda at=kill_at: lib.stats(["celery"])[0].ready >= at, timeout=120, interval=0.001,
                   what=f"{kill_at} moved")
        migration.send_signal(signal.SIGKILL)
        migration.wait(10)
    assert source.llen("celery") + source.llen("celery\x06\x169") > 0  # it really was interrupted
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    moved = drain_ours(lib, "celery")
    assert len(moved) == 3000 and {tid for _, tid in moved} == expected  # none lost, none twice
    assert source.llen("celery") == 0 and not source.keys("_crl.migrating:*")
    assert not ours.client().keys("migrated:*")


def test_the_destination_is_written_only_by_scripts(stock_and_ours: tuple[Server, Server]) -> None:
    """DESIGN rule 1 holds for migrate: MONITOR on our server sees Python send no writing
    command itself; the messages and their records are written inside the scripts."""
    stock, ours = stock_and_ours
    app = stock_app(stock)
    for i in range(6):
        send(app, f"m{i}", priority=(0, 9)[i % 2])
    seen: list[dict] = []
    watching = threading.Event()

    def watch() -> None:
        with ours.client().monitor() as monitor:
            watching.set()
            for command in monitor.listen():
                if command["command"] == "ECHO end-of-migration":
                    return
                seen.append(command)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert watching.wait(10)
    report = Migration(stock.client(), ScriptLibrary(ours.client(), Keyspace())).run()
    ours.client().echo("end-of-migration")
    watcher.join(10)
    assert report.total == 6 and not watcher.is_alive()
    direct = {c["command"].split()[0].upper() for c in seen if c["client_type"] != "lua"}
    allowed = {"EVALSHA", "SCRIPT", "HGET", "MULTI", "EXEC", "PING", "CLIENT", "HELLO", "SELECT"}
    assert direct <= allowed, direct  # reads and housekeeping
    inside = [c["command"].split()[0].upper() for c in seen if c["client_type"] == "lua"]
    assert inside.count("HSETNX") == 6 and "DEL" in inside  # marked one by one, cleared at the end


def test_stock_and_ours_share_one_database(stock_and_ours: tuple[Server, Server]) -> None:
    """During a rolling switch stock and our transport run on one database: no key of ours
    is one of stock's (before, both wrote _kombu.binding.* with different types)."""
    server, _ = stock_and_ours
    stock = stock_app(server)
    ours = Celery("ours", broker=f"redislua://127.0.0.1:{server.port}/0", set_as_current=False)
    import celery_redis_lua  # noqa: F401  (registers redislua://)
    for i in range(5):
        send(stock, f"stock-{i}")
        ours.send_task("tasks.note", (f"ours-{i}",))
    client = server.client()
    types = {key: client.type(key) for key in client.keys("*")}
    assert types[b"_kombu.binding.celery"] == b"set" and types[b"binding:celery"] == b"zset"
    assert client.llen("celery") == 5
    assert ScriptLibrary(client, Keyspace()).stats(["celery"])[0].ready == 5
    with Connection(f"redis://127.0.0.1:{server.port}/0") as stock_conn, \
            Connection(f"redislua://127.0.0.1:{server.port}/0") as our_conn:
        got: dict[str, list[str]] = {"stock": [], "ours": []}
        for name, conn in (("stock", stock_conn), ("ours", our_conn)):
            with Consumer(conn, [Queue("celery")],
                          callbacks=[lambda body, m, name=name: (got[name].append(body[0][0]), m.ack())]):
                deadline = time.monotonic() + 20
                while len(got[name]) < 5 and time.monotonic() < deadline:
                    with contextlib.suppress(TimeoutError):
                        conn.drain_events(timeout=1)
        assert sorted(got["stock"]) == [f"stock-{i}" for i in range(5)]
        assert sorted(got["ours"]) == [f"ours-{i}" for i in range(5)]
    assert redis.Redis(port=server.port).llen("celery") == 0


def test_bad_migrate_arguments_name_themselves(valkey_server: Server) -> None:
    cli = [sys.executable, "-m", "celery_redis_lua", "migrate"]
    done = subprocess.run([*cli, "--url", valkey_server.url], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--from" in done.stderr
    done = subprocess.run([*cli, "--from", "redis://:hunter2@127.0.0.1:1/0", "--url", valkey_server.url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot reach" in done.stderr and "hunter2" not in done.stderr
