"""Group commit (issue 41 §1): confirmed publishes one process has in flight at once to one
server ride one script call per queue, each caller answered on its own. The rounds are made
deterministic by pausing the server's writes (CLIENT PAUSE WRITE) while the callers pile up
behind the first, whose call the pause holds."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from kombu import Exchange, Producer, Queue

from celery_redis_lua import Keyspace, Published, ScriptError, ScriptLibrary
from celery_redis_lua.protocol.fairness import BadFairnessKey
from celery_redis_lua.protocol.group import GroupCommit, Pending, group_for, server_of
from celery_redis_lua.protocol.ops import Outgoing, StaleRoute
from conftest import Broker
from helpers import server_now_ms, wait_until
from scripts.servers import Server


def evalshas(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {"calls": 0})["calls"])


def pile_up(client: redis.Redis, group: GroupCommit, jobs: list[Callable[[], Any]],
            before_unpause: Callable[[], Any] = lambda: None, refused: int = 0) -> list[Any]:
    """Run ``jobs`` (each one publish through ``group``) at once in threads: the first is held
    by a write pause until all the others wait behind it, so they go in the next round. Each
    job's result, or the exception it raised. ``refused``: how many of the others fail before
    they reach the group (a message Python refuses as it is built)."""
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except Exception as error:
            results[i] = error

    client.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")
    try:
        threads = [threading.Thread(target=run, args=(0,))]
        threads[0].start()
        wait_until(lambda: group._leading or results[0] is not None, timeout=10,
                   what="the first publish leads")
        assert results[0] is None, f"the first publish returned at once: {results[0]!r}"
        threads += [threading.Thread(target=run, args=(i,)) for i in range(1, len(jobs))]
        for thread in threads[1:]:
            thread.start()
        wait_until(lambda: group.waiting == len(jobs) - 1 - refused
                   and sum(r is not None for r in results) == refused,
                   timeout=10, what="the others wait behind it")
        before_unpause()
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a caller never got its answer"
    return results


@pytest.fixture
def server(valkey_server: Server) -> Iterator[redis.Redis]:
    client = valkey_server.client(socket_timeout=30)
    client.flushall()
    yield client
    client.close()


def libraries(client: redis.Redis, n: int) -> list[ScriptLibrary]:
    """``n`` libraries on clients of their own (as Celery's producers each have a connection),
    each with its scripts loaded."""
    pool = client.connection_pool.connection_kwargs
    libs = [ScriptLibrary(redis.Redis(host=pool["host"], port=pool["port"], socket_timeout=30),
                          Keyspace("app:"), visibility_ms=60_000) for _ in range(n)]
    libs[0].runner.load(["publish"])
    return libs


def test_publishes_in_flight_at_once_ride_one_call_and_each_gets_its_own_id(server: redis.Redis) -> None:
    libs = libraries(server, 8)
    libs[0].declare("q")
    group = group_for(libs[0])
    assert all(group_for(lib) is group for lib in libs), "one server, keyspace and policy: one group"
    calls, rounds = evalshas(server), group.rounds
    results = pile_up(server, group, [
        lambda lib=lib, i=i: group.publish(lib, "q", Outgoing(f"m{i}", task_id=f"t{i}"))
        for i, lib in enumerate(libs)])
    assert all(isinstance(r, Published) for r in results), results
    assert len(set(results)) == 8
    assert group.rounds - rounds == 2, "the first alone, then the seven together"
    assert evalshas(server) - calls == 2, "the seven in one call"
    for i, message_id in enumerate(results):  # each caller's id is its own message's
        assert libs[0].locate("q", f"t{i}").id == message_id
        assert server.hget(libs[0].keys.message("q"), message_id) == f"m{i}".encode()


def test_a_message_the_script_refuses_is_its_callers_error_alone(server: redis.Redis) -> None:
    """The batch is refused as a whole, then sent again one message per call: the others are
    stored, the bad one's caller gets the script's error about its own message."""
    libs = libraries(server, 4)
    libs[0].declare("q")
    group = group_for(libs[0])
    bad_task_id = "x" * 300  # Python passes it; the script refuses it
    jobs = [lambda: group.publish(libs[0], "q", Outgoing("first")),
            lambda: group.publish(libs[1], "q", Outgoing("fine")),
            lambda: group.publish(libs[2], "q", Outgoing("bad", task_id=bad_task_id)),
            lambda: group.publish(libs[3], "q", Outgoing("fine too"))]
    first, fine, bad, fine_too = pile_up(server, group, jobs)
    assert isinstance(bad, ScriptError) and "task_id must be at most 256 bytes, got 300" in str(bad)
    assert "message" not in str(bad), "its own call's error, not a batch's"
    stored = {v.decode() for v in server.hvals(libs[0].keys.message("q"))}
    assert stored == {"first", "fine", "fine too"}
    assert all(isinstance(r, Published) for r in (first, fine, fine_too))


def test_what_python_refuses_and_a_stale_route_are_each_their_callers_alone(server: redis.Redis) -> None:
    libs = libraries(server, 4)
    libs[0].declare("q")
    libs[0].declare("other")
    looked_up = server_now_ms(server) - 10
    libs[0].rerouted("q", "tasks", looked_up + 5)
    group = group_for(libs[0])
    jobs = [lambda: group.publish(libs[0], "q", Outgoing("first")),
            lambda: group.publish(libs[1], "q", Outgoing("keyed", fairness_key="k" * 300)),
            lambda: group.publish(libs[2], "q", Outgoing("stale", route=("tasks", looked_up))),
            lambda: group.publish(libs[3], "other", Outgoing("elsewhere"))]
    first, keyed, stale, elsewhere = pile_up(server, group, jobs, refused=1)
    assert isinstance(keyed, BadFairnessKey)
    assert isinstance(stale, StaleRoute) and stale.changed_ms == looked_up + 5
    assert isinstance(first, Published) and isinstance(elsewhere, Published)
    assert [v.decode() for v in server.hvals(libs[0].keys.message("q"))] == ["first"]
    assert [v.decode() for v in server.hvals(libs[0].keys.message("other"))] == ["elsewhere"]


def test_a_killed_connection_leaves_nobody_waiting_and_nobody_told_a_lie(server: redis.Redis) -> None:
    """The connection of the leader's held call, and every other, is killed before the pause
    ends: each caller returns (redis-py may send again on a new connection, or raise), and
    every caller told "stored" has its message stored."""
    libs = libraries(server, 3)
    libs[0].declare("q")
    group = group_for(libs[0])
    kill = lambda: server.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # noqa: E731
    results = pile_up(server, group, [lambda lib=lib, i=i: group.publish(lib, "q", Outgoing(f"m{i}"))
                                      for i, lib in enumerate(libs)], before_unpause=kill)
    assert all(isinstance(r, Published | redis.ConnectionError) for r in results), results
    for i, result in enumerate(results):
        if isinstance(result, Published):
            assert server.hget(libs[0].keys.message("q"), result) == f"m{i}".encode()
    assert group.waiting == 0 and not group._leading


def test_the_kombu_producers_of_threads_ride_together_and_not_with_the_option_off(
        kind_broker: Broker) -> None:
    """Eight threads, each with its own kombu connection (as Celery's producer pool gives
    them), publish confirmed at once: one round for the seven behind the first; with
    group_commit=False, each its own call."""
    # The default exchange: a named one's route lookup (a script the pause would hold too) is
    # not what this test is about.
    queue = Queue("jobs", Exchange("", type="direct"), routing_key="jobs")
    for option, expected in ((True, 2), (False, 0)):
        kind_broker.client.flushall()
        connections = [kind_broker.connection(group_commit=option) for _ in range(8)]
        producers = [Producer(c.channel()) for c in connections]
        producers[0].publish({"warm": True}, exchange="", routing_key="jobs", declare=[queue])
        for producer in producers[1:]:  # connected, scripts loaded
            producer.publish({"warm": True}, exchange="", routing_key="jobs")
        lib = producers[0].channel.lib
        group = group_for(lib)
        rounds = group.rounds
        jobs = [lambda p=p, i=i: p.publish({"i": i}, exchange="", routing_key="jobs")
                for i, p in enumerate(producers)]
        if option:
            pile_up(kind_broker.client, group, jobs)
        else:
            threads = [threading.Thread(target=job) for job in jobs]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
        assert group.rounds - rounds == expected, option
        assert lib.size("jobs") == 16
        for connection in connections:
            connection.release()


def test_one_group_per_server_database_and_user() -> None:
    def client(**kwargs: Any) -> redis.Redis:
        return redis.Redis(**{"host": "127.0.0.1", "port": 1, **kwargs})

    assert server_of(client()) == server_of(client())
    assert server_of(client()) != server_of(client(port=2))
    assert server_of(client()) != server_of(client(db=1))
    assert server_of(client()) != server_of(client(username="other"))


GREEN = """
from gevent import monkey
monkey.patch_all()
import sys
import gevent
import redis
from kombu import Connection, Producer, Queue
from celery_redis_lua.protocol.group import group_for
url, port = sys.argv[1], int(sys.argv[2])
queue = Queue("green", routing_key="green")
connections = [Connection(url) for _ in range(8)]
producers = [Producer(c.channel()) for c in connections]
for producer in producers:
    producer.publish({"warm": True}, exchange="", routing_key="green", declare=[queue])
group = group_for(producers[0].channel.lib)
rounds, published = group.rounds, group.published
# The first greenlet's call is held by the pause while the others join: a round trip that
# lasts (a remote server's) is what greenlets can ride.
redis.Redis(port=port).execute_command("CLIENT", "PAUSE", 1000, "WRITE")
gevent.joinall([gevent.spawn(p.publish, {"i": i}, exchange="", routing_key="green")
                for i, p in enumerate(producers)], raise_error=True)
print(group.rounds - rounds, group.published - published, producers[0].channel.lib.size("green"))
"""


def test_greenlets_ride_together(valkey_server: Server, tmp_path: Any) -> None:
    """gevent: a leader's socket wait lets the other greenlets run and join the next round
    (on localhost a round trip is shorter than a publish's Python, so few wait: see
    docs/performance.md)."""
    pytest.importorskip("gevent", reason="gevent is not installed (pip install gevent)")
    script = tmp_path / "green.py"
    script.write_text(GREEN)
    client = valkey_server.client(socket_timeout=10)
    client.flushall()
    done = subprocess.run([sys.executable, str(script), f"redislua://127.0.0.1:{valkey_server.port}/0",
                           str(valkey_server.port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rounds, published, size = (int(x) for x in done.stdout.split())
    assert (rounds, published, size) == (2, 8, 16), "the first alone, the seven behind it together"
    client.close()


def test_a_blocks_round_rides_with_the_publishes_in_flight(server: redis.Redis) -> None:
    """A confirm_together() block's round (protocol/together.py: publish_all) joins the
    round being gathered like any caller's publish: the first publish alone, then the block's
    three and another thread's single one together, in one call; each pending answered."""
    libs = libraries(server, 3)
    libs[0].declare("q")
    group = group_for(libs[0])
    block = [Pending("q", Outgoing(f"b{i}", task_id=f"b{i}")) for i in range(3)]
    answers: dict[str, Any] = {}
    calls, rounds = evalshas(server), group.rounds
    server.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")
    try:
        lead = threading.Thread(target=lambda: answers.update(lead=group.publish(
            libs[0], "q", Outgoing("lead", task_id="lead"))))
        lead.start()
        wait_until(lambda: group._leading, timeout=10, what="the first publish leads")
        others = [threading.Thread(target=lambda: group.publish_all(libs[1], block)),
                  threading.Thread(target=lambda: answers.update(single=group.publish(
                      libs[2], "q", Outgoing("single", task_id="single"))))]
        for thread in others:
            thread.start()
        wait_until(lambda: group.waiting == 4, timeout=10, what="the block and the single one wait")
    finally:
        server.execute_command("CLIENT", "UNPAUSE")
    for thread in [lead, *others]:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a caller never got its answer"
    assert all(isinstance(p.result, Published) for p in block), [p.result for p in block]
    assert isinstance(answers["lead"], Published) and isinstance(answers["single"], Published)
    assert group.rounds - rounds == 2 and evalshas(server) - calls == 2, "the lead, then four in one call"
    assert libs[0].size("q") == 5
