"""The metrics script and the Prometheus exporter: counts that equal stats (also under load,
from one snapshot), the oldest ready message across priority bands, the next ETA, the
counters of redeliveries and drops, the HTTP endpoint, the CLI, and a real Prometheus
server scraping it."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from celery_redis_lua import Dedup, Keyspace, Policy, ScriptLibrary
from celery_redis_lua.protocol import ops
from celery_redis_lua.protocol.retry import DelayedRetry
from celery_redis_lua.tools.exporter import QueueCollector, serve
from helpers import same_slot_names, server_now_ms, wait_for_server_time, wait_until
from scripts.servers import Server, free_port


def test_metrics_match_stats_and_say_more(lib: ScriptLibrary) -> None:
    strict = lib.with_policy(delivery_limit=2, visibility_ms=60_000)
    a, b = same_slot_names(2, lib.keys, "m")
    now = server_now_ms(lib.client)
    strict.publish(a, "low-old", priority=1)
    wait_for_server_time(lib.client, now + 20)
    strict.publish(a, "high-new", priority=9)
    strict.publish(a, "later", eta_ms=now + 60_000)
    strict.publish(b, "other")
    delivered = strict.consume([a], 1).deliveries  # high-new (priority 9)
    assert [d.payload for d in delivered] == [b"high-new"]
    strict.reject(a, [delivered[0].id], requeue=True)  # redelivered, count 1
    again = strict.consume([a], 1).deliveries
    strict.reject(a, [again[0].id], requeue=True)  # attempt 2 of 2: dead-lettered
    rejected = strict.consume([a], 1).deliveries  # low-old
    strict.reject(a, [rejected[0].id], requeue=False)
    strict.publish(a, "fresh")

    [ma, mb] = strict.metrics([a, b])
    [sa, sb] = strict.stats([a, b])
    assert (ma.ready, ma.delayed, ma.in_flight, ma.dead) == (sa.ready, sa.delayed, sa.in_flight, sa.dead)
    assert (mb.ready, mb.delayed, mb.in_flight, mb.dead) == (sb.ready, sb.delayed, sb.in_flight, sb.dead)
    assert (ma.ready, ma.delayed, ma.in_flight, ma.dead) == (1, 1, 0, 2)
    assert ma.redelivered == 1
    assert ma.dropped == {"delivery-limit": 1, "rejected": 1}
    assert ma.next_eta == now + 60_000 and 59_000 < (ma.next_eta_in_ms or 0) <= 60_000
    assert ma.oldest_ready_at is not None and ma.oldest_ready_at >= now
    assert (mb.redelivered, mb.dropped, mb.next_eta) == (0, {}, None)


def test_the_oldest_ready_message_is_found_in_any_priority_band(lib: ScriptLibrary) -> None:
    """Ready scores sort by band first: the head of the set is the highest priority, not the
    oldest message."""
    oldest = lib.publish("bands", "oldest", priority=0)
    for priority in (255, 200, 7, 3):
        wait_for_server_time(lib.client, server_now_ms(lib.client) + 5)
        lib.publish("bands", f"p{priority}", priority=priority)
    [m] = lib.metrics(["bands"])
    score = int(float(lib.client.zscore(lib.keys.queue("bands"), oldest)))
    assert m.oldest_ready_at == score % 10**13  # its ready time (a band is 10^13 ms wide)
    lib.consume(["bands"], 5)
    [m] = lib.metrics(["bands"])
    assert (m.ready, m.in_flight, m.oldest_ready_at) == (0, 5, None)


def test_expired_and_timed_out_messages_are_counted(lib: ScriptLibrary) -> None:
    short = lib.with_policy(visibility_ms=50, delivery_limit=None)
    short.publish("ttl", "dies", ttl_ms=1)
    short.publish("ttl", "times-out")
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 5)
    assert [d.payload for d in short.consume(["ttl"], 2).deliveries] == [b"times-out"]
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 60)
    short.sweep(["ttl"])
    [m] = short.metrics(["ttl"])
    assert (m.dropped, m.redelivered, m.ready) == ({"expired": 1}, 1, 1)


@pytest.mark.parametrize("kind", ["valkey", "redis"])
def test_one_snapshot_under_load_equals_stats(request: pytest.FixtureRequest, kind: str) -> None:
    """metrics and stats in one MULTI see the same state while a producer and a consumer run."""
    from conftest import require_kind
    require_kind(kind)
    server = request.getfixturevalue(f"{kind}_server")
    standalone = server.client(socket_timeout=10)
    standalone.flushall()
    lib = ScriptLibrary(standalone, Keyspace("load:"), Policy(visibility_ms=60_000))
    lib.runner.load()
    stop = threading.Event()

    def produce() -> None:
        worker = ScriptLibrary(server.client(), lib.keys)
        while not stop.is_set():
            worker.run_many([worker.calls.publish("busy", "x", priority=i % 10) for i in range(20)])

    def consume() -> None:
        worker = ScriptLibrary(server.client(), lib.keys)
        while not stop.is_set():
            for delivery in worker.consume(["busy"], 15).deliveries:
                worker.ack("busy", [delivery.id])

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for thread in threads:
        thread.start()
    try:
        snapshots = []
        for _ in range(30):
            pipe = standalone.pipeline(transaction=True)
            calls = (ops.stats(lib.keys, lib.policy, ["busy"]), ops.metrics(lib.keys, lib.policy, ["busy"]))
            for call in calls:
                script = lib.runner.scripts[call.script]
                pipe.execute_command("EVALSHA", script.sha1, len(call.keys), *call.keys, *call.args)
            raw_stats, raw_metrics = pipe.execute()
            [s] = ops.stats(lib.keys, lib.policy, ["busy"]).decode(raw_stats)
            [m] = ops.metrics(lib.keys, lib.policy, ["busy"]).decode(raw_metrics)
            assert (m.ready, m.delayed, m.in_flight, m.dead) == (s.ready, s.delayed, s.in_flight, s.dead)
            snapshots.append(m.ready + m.in_flight)
            time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert len(set(snapshots)) > 1  # the load really moved the numbers


def test_discovery_lists_the_queues_that_exist(lib: ScriptLibrary) -> None:
    """Issue 42 §1.1: a binding with a stale-at time belongs to an expiring queue, which
    exists while its keys do; neither a live nor a stale one brings back a queue whose keys
    are gone. A binding for good (no lifetime) still names a queue never declared."""
    member = lib.keys.binding_member
    lib.declare("declared", expires_ms=60_000)
    lib.bind("ex", [member("rk", "", "declared")], lifetime_ms=60_000)
    lib.bind("ex", [member("rk", "", "expired")], lifetime_ms=60_000)  # its keys gone, binding live
    lib.bind("ex", [member("rk", "", "stale")], lifetime_ms=1)  # gone stale, not pruned yet
    lib.bind("ex", [member("rk", "", "for-good")])
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 5)
    assert lib.client.zcard(lib.keys.binding("ex")) == 4
    assert lib.queue_names() == ["declared", "for-good"]


def exported(collector: QueueCollector) -> set[str]:
    """The queues named by the series of one collection."""
    return {sample.labels.get("queue") or sample.labels["queue_name"] for family in collector.collect()
            for sample in family.samples if {"queue", "queue_name"} & set(sample.labels)}


def test_a_queue_gone_since_discovery_leaves_the_next_scrape(lib: ScriptLibrary) -> None:
    """The exporter discovers queues every --discover-interval; a queue whose keys went in
    between (here deleted; expired alike) has no series from the next scrape on, while one
    bound for good (no keys yet) and one named by --queue stay."""
    lib.declare("stays")
    lib.declare("goes")
    lib.bind("ex", [lib.keys.binding_member("rk", "", "bound-only")])
    collector = QueueCollector(lib, discover_interval=3600)
    assert exported(collector) == {"stays", "goes", "bound-only"}
    lib.delete("goes")
    assert exported(collector) == {"stays", "bound-only"}
    assert exported(QueueCollector(lib, ["goes"])) == {"goes"}  # named: zeros, as asked


# -- the HTTP endpoint ---------------------------------------------------------------------

def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture
def exporter(valkey_server: Server) -> Iterator[tuple[ScriptLibrary, int]]:
    client = valkey_server.client(socket_timeout=10)
    client.flushall()
    lib = ScriptLibrary(client, Keyspace("app:"))
    port = free_port()
    server, _ = serve(lib, port=port, address="127.0.0.1", discover_interval=1)
    yield lib, port
    server.shutdown()


def test_the_endpoint_exports_celery_exporter_names_and_ours(exporter: tuple[ScriptLibrary, int]) -> None:
    lib, port = exporter
    for i in range(7):
        lib.publish("jobs", f"m{i}", priority=i)
    lib.publish("jobs", "later", eta_ms=server_now_ms(lib.client) + 30_000, dedup=Dedup("later"))
    assert lib.publish("jobs", "later again", dedup=Dedup("later")).deduplicated
    lib.bind("ex", [lib.keys.binding_member("rk", "", "bound-only")])  # known from a binding alone
    lib.consume(["jobs"], 2)
    bound = ("celery_queue_length", (("queue_name", "bound-only"),))
    samples = wait_until(lambda: (s := scrape(port)) and bound in s and s, timeout=10,
                         what="the bound queue discovered")
    assert samples[("celery_queue_length", (("queue_name", "jobs"),))] == 5
    assert samples[("celery_redis_lua_queue_ready", (("queue", "jobs"),))] == 5
    assert samples[("celery_redis_lua_queue_delayed", (("queue", "jobs"),))] == 1
    assert samples[("celery_redis_lua_queue_in_flight", (("queue", "jobs"),))] == 2
    assert 25 < samples[("celery_redis_lua_queue_next_eta_seconds", (("queue", "jobs"),))] <= 30
    assert samples[("celery_redis_lua_up", ())] == 1
    assert ("celery_redis_lua_queue_redeliveries_total", (("queue", "jobs"),)) in samples
    deduplicated = ("celery_redis_lua_queue_deduplicated_total", (("mode", "simple"), ("queue", "jobs")))
    assert samples[deduplicated] == 1
    [stats] = lib.stats(["jobs"])
    assert (stats.ready, stats.delayed, stats.in_flight) == (5, 1, 2)


def test_the_endpoint_exports_each_queues_limits_and_0_for_none(exporter: tuple[ScriptLibrary, int]) -> None:
    lib, port = exporter
    lib.declare("capped")
    lib.declare("free")
    lib.limit("capped", in_flight=8, rate="30/m")
    samples = wait_until(lambda: (s := scrape(port)) and ("celery_redis_lua_queue_limit_in_flight",
                                                             (("queue", "free"),)) in s and s,
                         timeout=10, what="both queues discovered")
    assert samples[("celery_redis_lua_queue_limit_in_flight", (("queue", "capped"),))] == 8
    assert samples[("celery_redis_lua_queue_limit_rate_per_second", (("queue", "capped"),))] == 0.5
    assert samples[("celery_redis_lua_queue_limit_in_flight", (("queue", "free"),))] == 0
    assert samples[("celery_redis_lua_queue_limit_rate_per_second", (("queue", "free"),))] == 0


def test_the_exporter_runs_as_its_least_privilege_user(valkey_server: Server) -> None:
    from celery_redis_lua.protocol.acl import setuser
    admin = valkey_server.client()
    admin.flushall()
    admin.execute_command(*setuser("exporter", "exporter", "app:", password="pw"))
    ScriptLibrary(admin, Keyspace("app:")).publish("watched", "m")
    lib = ScriptLibrary(redis.Redis(port=valkey_server.port, username="exporter", password="pw"),
                        Keyspace("app:"))
    port = free_port()
    server, _ = serve(lib, port=port, address="127.0.0.1")
    try:
        samples = scrape(port)
        assert samples[("celery_queue_length", (("queue_name", "watched"),))] == 1
        assert samples[("celery_redis_lua_up", ())] == 1
    finally:
        server.shutdown()
    with pytest.raises(redis.ResponseError, match="has no permissions to run the 'hmget' command"):
        lib.publish("watched", "not allowed")  # a script outside its role fails at its first command


def test_an_unreachable_broker_is_up_0_not_an_error_page() -> None:
    port = free_port()
    lib = ScriptLibrary(redis.Redis(port=free_port(), socket_connect_timeout=1), Keyspace())
    server, _ = serve(lib, port=port, address="127.0.0.1")
    try:
        assert scrape(port)[("celery_redis_lua_up", ())] == 0
    finally:
        server.shutdown()


@pytest.mark.parametrize("with_queues", [False, True], ids=["no-queue", "queues"])
def test_up_is_0_on_the_first_scrape_after_the_broker_dies(with_queues: bool) -> None:
    """Issue 42 §1.7: with no queue, discovery (cached for --discover-interval) was the only
    round trip, and ``up`` stayed 1 until it was due again. Every scrape reaches the broker."""
    with Server("valkey") as server:
        lib = ScriptLibrary(server.client(socket_timeout=2, socket_connect_timeout=1), Keyspace())
        if with_queues:
            lib.publish("jobs", "m")
        port = free_port()
        http, _ = serve(lib, port=port, address="127.0.0.1")  # discovery every 30 s
        try:
            before = scrape(port)
            assert before[("celery_redis_lua_up", ())] == 1
            assert (("celery_queue_length", (("queue_name", "jobs"),)) in before) is with_queues
            server.kill()  # SIGKILL, by PID
            assert scrape(port)[("celery_redis_lua_up", ())] == 0
        finally:
            http.shutdown()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery_redis_lua", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "0"], "Invalid value for '--port'"),
    (["--port", "x"], "Invalid value for '--port'"),
    (["--discover-interval", "0"], "Invalid value for '--discover-interval'"),
])
def test_bad_exporter_arguments_name_themselves(valkey_server: Server, args: list[str], message: str) -> None:
    done = run_cli("exporter", "--url", valkey_server.url, *args)
    assert done.returncode != 0 and message in done.stderr


def test_the_exporter_command_serves_and_stops_on_sigterm(valkey_server: Server) -> None:
    port = free_port()
    url = f"redis://:{'s3cret'}@127.0.0.1:{valkey_server.port}/0"
    valkey_server.client().config_set("requirepass", "s3cret")
    process = subprocess.Popen([sys.executable, "-m", "celery_redis_lua", "exporter", "--url", url,
                                "--port", str(port), "--address", "127.0.0.1"],
                               stderr=subprocess.PIPE, text=True)
    try:
        samples = wait_until(lambda: _try_scrape(port), timeout=20, what="the exporter answers")
        assert samples[("celery_redis_lua_up", ())] == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        assert process.stderr is not None
        err = process.stderr.read()
        assert "s3cret" not in err and "***" in err
    finally:
        process.kill()
        redis.Redis(port=valkey_server.port, password="s3cret").config_set("requirepass", "")


def _try_scrape(port: int) -> Any:
    with contextlib.suppress(OSError):
        return scrape(port)
    return None


def test_a_port_in_use_is_a_clear_error(valkey_server: Server) -> None:
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("exporter", "--url", valkey_server.url, "--port", str(port), "--address", "127.0.0.1")
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


# -- a real Prometheus ---------------------------------------------------------------------

@pytest.fixture
def prometheus_binary() -> str:
    from conftest import require_tool
    return require_tool("prometheus", "prometheus", "scrape the exporter with a real Prometheus")


@contextlib.contextmanager
def prometheus(binary: str, tmp_path: Path, exporter_port: int,
               job: str) -> Iterator[Callable[[str], list[Any]]]:
    """A real Prometheus scraping the exporter every second; yields ``query(expression)``,
    the instant query's series ([] until Prometheus answers)."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": job,
                            "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]}]}))
    process = subprocess.Popen([binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
                                f"--storage.tsdb.path={tmp_path / 'data'}"],
                               stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))

    def query(expression: str) -> list[Any]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with contextlib.suppress(OSError):
            return json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]
        return []

    try:
        yield query
    finally:
        process.terminate()
        process.wait(20)


def test_a_real_prometheus_scrapes_the_queue_lengths(prometheus_binary: str, tmp_path: Path,
                                                     exporter: tuple[ScriptLibrary, int]) -> None:
    lib, exporter_port = exporter
    for i in range(12):
        lib.publish("scraped", f"m{i}")
    lib.consume(["scraped"], 3)
    with prometheus(prometheus_binary, tmp_path, exporter_port, "celery-redis-lua") as query:
        found = wait_until(lambda: query('celery_queue_length{queue_name="scraped"}'), timeout=60,
                           interval=0.5, what="Prometheus has the series")
        assert float(found[0]["value"][1]) == 9
        in_flight = wait_until(lambda: query('celery_redis_lua_queue_in_flight{queue="scraped"}'), timeout=30)
        assert float(in_flight[0]["value"][1]) == 3
        # The alert celery-mixin ships: it can fire on our queues.
        alert = 'sum by (queue_name) (celery_queue_length{queue_name!~"None"}) > 5'
        firing = wait_until(lambda: query(alert), timeout=30)
        assert firing[0]["metric"]["queue_name"] == "scraped"


DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "compose" / "grafana" / "dashboards" / \
    "celery-redis-lua.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every target of the dashboard, with the queue variable at
    'All' (its allValue)."""
    dashboard = json.loads(DASHBOARD.read_text())
    [variable] = dashboard["templating"]["list"]
    return [(panel["title"], target["expr"].replace("$queue", variable["allValue"]))
            for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_panel_of_the_dashboard_has_series(prometheus_binary: str, tmp_path: Path,
                                                 exporter: tuple[ScriptLibrary, int]) -> None:
    """The Grafana dashboard of examples/compose/, on a real exporter and a real Prometheus:
    a query that names a metric or label the exporter does not serve returns no series."""
    lib, exporter_port = exporter
    lib.declare("board", retry=DelayedRetry("failed", 60_000))
    for i in range(6):
        lib.publish("board", f"m{i}", task_id=f"t{i}")
    lib.publish("board", "later", eta_ms=server_now_ms(lib.client) + 60_000, dedup=Dedup("later"))
    assert lib.publish("board", "later again", dedup=Dedup("later")).deduplicated  # the dedup panel
    taken = lib.consume(["board"], 3).deliveries
    lib.reject("board", [taken[0].id], requeue=True, counts=[0])  # waits to retry; redelivered
    lib.reject("board", [taken[1].id], requeue=False, counts=[0])  # a dead letter
    lib.pause("board", "maintenance")
    lib.limit("board", in_flight=5, rate="10/s")  # the limit panels show a set limit
    with prometheus(prometheus_binary, tmp_path, exporter_port, "celery-exporter") as query:
        queries = dashboard_queries()
        assert len(queries) >= 10
        for title, expression in queries:  # rate() needs two scrapes: polled, not slept
            wait_until(lambda e=expression: query(e), timeout=60, interval=0.5,
                       what=f"series for panel {title!r}: {expression}")
        [retrying] = query('celery_redis_lua_queue_retrying{queue="board"}')
        assert float(retrying["value"][1]) == 1


def test_no_queue_under_the_prefix_is_said_once(valkey_server: Server,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """The compose example's --prefix app: on a broker whose queues have no prefix served no
    queue metrics, and said nothing."""
    client = valkey_server.client(socket_timeout=10)
    client.flushall()
    ScriptLibrary(client).publish("unprefixed", "m")
    collector = QueueCollector(ScriptLibrary(client, Keyspace("app:")), discover_interval=0)
    with caplog.at_level(logging.WARNING, logger="celery_redis_lua.tools.exporter"):
        assert collector.queues() == [] and collector.queues() == []
    warnings = [r.getMessage() for r in caplog.records if "no queues found" in r.getMessage()]
    assert warnings == ["celery-redis-lua exporter: no queues found under the key prefix 'app:'; "
                        "queues of another prefix (the transport's global_keyprefix) are not seen: "
                        "is --prefix right?"]
    assert QueueCollector(ScriptLibrary(client), discover_interval=0).queues() == ["unprefixed"]


def test_the_exporter_listens_on_loopback_unless_told() -> None:
    from celery_redis_lua.tools.cli.exporter import exporter as command

    [address] = [p for p in command.params if p.name == "address"]
    assert address.default == "127.0.0.1"
