"""Least-privilege ACL users (docs/deployment.md, "Least privilege"): the transport works as them, the
server refuses what they were not given, and without CLIENT UNBLOCK blocking waits still
end at once when the consumed queues change."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_redis_lua.protocol.acl import commands_for, script_commands, setuser
from celery_redis_lua.protocol.contract import load_scripts
from celery_redis_lua.tools.cli import main as cli_main
from helpers import ROOT
from kombu_support import drain
from scripts.servers import Server

PREFIX = "app:"
PASSWORD = "least-Pw1"


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    from conftest import require_kind
    require_kind(request.param)
    with Server(request.param) as started:
        admin = started.client()
        for user, role, unblock in (("worker", "worker", True), ("producer", "producer", True),
                                    ("nounblock", "worker", False)):
            admin.execute_command(*setuser(user, role, PREFIX, password=PASSWORD, unblock=unblock))
        # A service that refuses CLIENT ID too (a proxy without per-connection ids).
        no_id = setuser("noid", "worker", PREFIX, password=PASSWORD, unblock=False)
        admin.execute_command(*no_id, "-client|id")
        yield started


def connection(server: Server, user: str, **options: Any) -> Connection:
    return Connection(f"redislua://{user}:{PASSWORD}@127.0.0.1:{server.port}/0",
                      transport_options={"global_keyprefix": PREFIX, **options})


def as_user(server: Server, user: str) -> redis.Redis:
    return redis.Redis(port=server.port, username=user, password=PASSWORD)


def test_the_docs_show_what_the_acl_command_prints() -> None:
    page = (ROOT / "docs" / "deployment.md").read_text()
    shown = re.findall(r"^ACL SETUSER .+$", page, flags=re.MULTILINE)
    roles = ("worker", "producer", "exporter")
    expected = {" ".join(setuser(f"celery-{role}", role, PREFIX)) for role in roles}
    assert expected <= set(shown), "docs/deployment.md's ACL SETUSER lines differ from `celery-redis-lua acl`"


def test_the_acl_command_prints_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["acl", "--role", "producer", "--prefix", PREFIX, "--durability"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == " ".join(setuser("celery-producer", "producer", PREFIX,
                                                               durability=True))


def test_every_command_a_script_calls_is_granted_to_the_worker() -> None:
    """A command added to a script without the ACL knowing it would fail as NOPERM in
    production only: the list is read off the scripts, and this pins the reading."""
    inside = script_commands(load_scripts())
    assert {"hset", "zadd", "xreadgroup", "time", "pexpireat"} <= inside
    assert inside <= set(commands_for("worker"))


def test_the_worker_user_runs_the_transport(server: Server) -> None:
    queue = Queue("jobs", Exchange("jobs", "topic"), routing_key="jobs.#")
    broadcast = Queue("b1", Exchange("bcast", "fanout"))
    with connection(server, "producer") as producer_conn:
        producer = Producer(producer_conn)
        producer.publish({"n": 1}, exchange=queue.exchange, routing_key="jobs.a", declare=[queue])
        producer.publish({"n": 2}, exchange=queue.exchange, routing_key="jobs.b", priority=9,
                         declare=[queue])
    got: list[Any] = []
    on_message = lambda body, message: (got.append(body), message.ack())  # noqa: E731
    with connection(server, "worker") as worker_conn, \
            Consumer(worker_conn, [queue, broadcast], callbacks=[on_message]):
        drain(worker_conn, got, 2)
        Producer(worker_conn).publish({"n": 3}, exchange=broadcast.exchange, routing_key="",
                                      declare=[broadcast])
        drain(worker_conn, got, 3)
        message = worker_conn.default_channel.basic_get("jobs")
        assert message is None
    assert got == [{"n": 2}, {"n": 1}, {"n": 3}]


@pytest.mark.parametrize(("user", "command"), [
    ("worker", ("FLUSHALL",)),
    ("worker", ("KEYS", "*")),
    ("worker", ("CONFIG", "GET", "maxmemory")),
    ("worker", ("SCRIPT", "FLUSH")),
    ("worker", ("SET", "outside-the-prefix", "1")),
    ("worker", ("EVAL", "return redis.call('SET', KEYS[1], 1)", 1, "outside")),
    ("producer", ("BLPOP", f"{PREFIX}wake:{{jobs}}", "0.01")),
    ("producer", ("XREADGROUP", "GROUP", "g", "c", "STREAMS", f"{PREFIX}/0.bcast", ">")),
    ("nounblock", ("CLIENT", "UNBLOCK", "1")),
])
def test_what_a_user_was_not_given_is_refused(server: Server, user: str, command: tuple[Any, ...]) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        as_user(server, user).execute_command(*command)


@pytest.mark.parametrize("user", ["nounblock", "noid"])
def test_without_client_unblock_a_wait_on_old_queues_ends_at_once(server: Server, user: str) -> None:
    """Adding a queue ends the pending BLPOP (its keys name the old set): with CLIENT
    UNBLOCK (or CLIENT ID) refused, by closing the wait's connection. A message to the new
    queue then arrives long before blocking_timeout."""
    with connection(server, user, blocking_timeout=30) as conn:
        got: list[Any] = []
        first = Consumer(conn, [Queue("old")], callbacks=[lambda body, m: (got.append(body), m.ack())])
        first.consume()
        Producer(conn).publish("warm", routing_key="old", declare=[Queue("old")])
        drain(conn, got, 1)
        time.sleep(0.2)  # the channel is now blocked in BLPOP on 'old' alone (nothing to poll for)
        second = Consumer(conn.default_channel, [Queue("new")],
                          callbacks=[lambda body, m: (got.append(body), m.ack())])
        second.consume()
        began = time.monotonic()
        with connection(server, "producer") as producer_conn:
            Producer(producer_conn).publish("fresh", routing_key="new", declare=[Queue("new")])
        drain(conn, got, 2, timeout=10)
        assert time.monotonic() - began < 5
        assert got == ["warm", "fresh"]
        assert not conn.default_channel.queue_wait.can_unblock
