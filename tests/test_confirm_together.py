"""confirm_together() (protocol/together.py) through plain kombu on real servers: a block's
confirmed publishes are stored, in order, by one script call when the block ends; a full
round (``publish_pipeline`` messages) goes at once; what the server refused is raised at the end, naming the
queue, with the others stored; a route that went stale inside the block is followed afresh;
an exception in the block does not drop what it published; a nested block joins the outer;
a lost server is raised at the end; another thread is not in the block; a cluster's queues
each get their call."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from celery_redis_lua import Keyspace, ScriptLibrary, UnconfirmedPublishError, confirm_together
from conftest import cluster_url
from helpers import ScriptCalls, wait_until
from scripts.servers import Cluster, Server
from test_unconfirmed import stored

EXCHANGE = Exchange("unconfirmed", "direct")
QUEUE = Queue("unconfirmed", EXCHANGE, routing_key="u")
OTHER = Queue("unconfirmed-2", EXCHANGE, routing_key="u")


@pytest.fixture
def server(scratch_server: Server) -> Server:
    return scratch_server  # a fresh one of each kind (conftest.py)


def connection(server: Server, **options: Any) -> Connection:
    return Connection(f"redislua://127.0.0.1:{server.port}/0", transport_options=options)


def ready(server: Server, queue: str = QUEUE.name) -> int:
    return ScriptLibrary(server.client(), Keyspace()).stats([queue])[0].ready


def declared(conn: Connection) -> Any:
    producer = conn.Producer(serializer="raw")
    producer.publish("first", exchange=EXCHANGE, routing_key="u", declare=[QUEUE])
    return producer


def test_a_blocks_publishes_are_stored_in_order_when_it_ends(server: Server) -> None:
    with connection(server) as conn:
        producer = declared(conn)
        counted = ScriptCalls(server.client())
        with confirm_together():
            for i in range(50):
                producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="u")
            assert ready(server) == 1  # returned before stored: only the one before the block
        assert ready(server) == 51
        calls = counted.stop()
        producer.publish("after", exchange=EXCHANGE, routing_key="u")
        assert ready(server) == 52  # outside a block, stored before publish returns
    assert calls.get("publish") == 1, calls  # one script call stored the fifty
    assert stored(server) == ["first", *(f"m{i}" for i in range(50)), "after"]


def test_a_full_pipeline_goes_at_once(server: Server) -> None:
    with connection(server, publish_pipeline=10) as conn:
        producer = declared(conn)
        with confirm_together():
            for i in range(25):
                producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="u")
            assert ready(server) == 21  # two full pipelines written, their replies read
        assert ready(server) == 26


def test_what_the_server_refused_is_raised_at_the_end_and_the_rest_is_stored(server: Server) -> None:
    keys = Keyspace()
    bad = Queue("refused", EXCHANGE, routing_key="r")
    with connection(server) as conn:
        producer = declared(conn)
        producer.publish("declared", exchange=EXCHANGE, routing_key="r", declare=[bad])
        server.client().set(keys.wake(bad.name), "not a list")  # someone else's bad write
        with pytest.raises(UnconfirmedPublishError) as raised, confirm_together():
            producer.publish("a", exchange=EXCHANGE, routing_key="u")
            producer.publish("b", exchange=EXCHANGE, routing_key="r", headers={"id": "task-b"})
            producer.publish("c", exchange=EXCHANGE, routing_key="u")
    assert re.match(r"1 unconfirmed publish\(es\) to 'refused'.*WRONGTYPE", str(raised.value)), raised.value
    assert raised.value.task_ids == ["task-b"]
    assert stored(server) == ["first", "a", "c"]


def test_a_route_that_went_stale_in_the_block_is_followed_afresh(server: Server) -> None:
    """The cached table routes to both queues; an unbind in another connection lands before
    the block ends: that publish is refused as stale and published again at the end, with a
    fresh lookup, to the first queue only."""
    with connection(server) as conn:
        producer = conn.Producer(serializer="raw")
        producer.publish("both", exchange=EXCHANGE, routing_key="u", declare=[QUEUE, OTHER])
        producer.publish("both again", exchange=EXCHANGE, routing_key="u")  # the table is cached now
        with confirm_together():
            with Connection(f"redislua://127.0.0.1:{server.port}/0") as other:
                OTHER(other.default_channel).unbind_from(exchange=EXCHANGE, routing_key="u")
            producer.publish("first only", exchange=EXCHANGE, routing_key="u")
            assert ready(server) == 2  # in the block's pipeline, its route not yet judged
    assert stored(server, QUEUE.name) == ["both", "both again", "first only"]
    assert stored(server, OTHER.name) == ["both", "both again"]


def test_an_exception_in_the_block_drops_nothing_it_published(server: Server) -> None:
    with connection(server) as conn:
        producer = declared(conn)
        with pytest.raises(KeyError), confirm_together():
            producer.publish("sent", exchange=EXCHANGE, routing_key="u")
            assert ready(server) == 1
            raise KeyError("the caller's own error")
    assert stored(server) == ["first", "sent"]


def test_a_nested_block_joins_the_outer_one(server: Server) -> None:
    with connection(server) as conn:
        producer = declared(conn)
        with confirm_together():
            with confirm_together():
                producer.publish("inner", exchange=EXCHANGE, routing_key="u")
            assert ready(server) == 1  # the outer block confirms it
        assert ready(server) == 2


def test_a_lost_server_is_raised_at_the_end_for_messages_without_a_task_id(server: Server) -> None:
    """Without a task id a message whose outcome is unknown is not sent again (it might be
    stored): raised at once, all three named."""
    with connection(server) as conn:
        producer = declared(conn)
        with pytest.raises(UnconfirmedPublishError) as raised, confirm_together():
            for i in range(3):
                producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="u")
            server.stop()  # before the block's end: none of the three was sent
    assert re.match(r"3 unconfirmed publish\(es\) to 'unconfirmed' were refused by the server; "
                    r"the first: ConnectionError", str(raised.value)), raised.value
    assert raised.value.task_ids == [None, None, None]


def test_a_restarted_server_is_waited_for_and_a_task_is_stored_once(server: Server) -> None:
    """With task ids (every Celery task's) the block's end sends them again until the server
    is back (it restarts 0.5 s in), and the task index keeps a resent one from being stored
    twice: the first of them is stored before the block, with the same id."""
    with connection(server) as conn:
        producer = declared(conn)
        producer.publish("m0", exchange=EXCHANGE, routing_key="u", headers={"id": "t0"})
        with confirm_together():
            for i in range(3):
                producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="u", headers={"id": f"t{i}"})
            server.client().bgsave()
            wait_until(lambda: server.client().info("persistence")["rdb_bgsave_in_progress"] == 0,
                       timeout=10, what="the snapshot written")
            server.stop(signal.SIGKILL)
            done = threading.Event()

            def down_then_up() -> None:
                time.sleep(0.5)  # the server's downtime, not a synchronisation
                server.start()
                done.wait(60)  # the server dies with the thread that started it (PR_SET_PDEATHSIG)

            threading.Thread(target=down_then_up, daemon=True).start()
        try:
            assert stored(server) == ["first", "m0", "m1", "m2"]
        finally:
            done.set()


def test_the_block_is_its_threads_alone(server: Server) -> None:
    """Another thread publishing meanwhile (a connection of its own, as Celery's producer pool
    gives each thread) is confirmed one by one, as outside any block."""
    with connection(server) as conn, connection(server) as others:
        producer, theirs = declared(conn), others.Producer(serializer="raw")
        with confirm_together():
            producer.publish("mine", exchange=EXCHANGE, routing_key="u")
            thread = threading.Thread(target=lambda: theirs.publish("theirs", exchange=EXCHANGE,
                                                                    routing_key="u"))
            thread.start()
            thread.join(10)
            assert ready(server) == 2  # "first" and theirs: stored before their publish returned
        assert stored(server) == ["first", "theirs", "mine"]


def test_on_a_cluster_each_queues_publishes_are_stored_at_the_end(valkey_cluster: Cluster) -> None:
    queues = [Queue(f"together-{i}", EXCHANGE, routing_key=f"k{i}") for i in range(3)]
    with Connection(cluster_url(valkey_cluster)) as conn:
        producer = conn.Producer(serializer="raw")
        for queue in queues:
            producer.publish("declared", exchange=EXCHANGE, routing_key=queue.routing_key, declare=[queue])
        lib = ScriptLibrary(valkey_cluster.client(), Keyspace())
        with confirm_together():
            for i in range(30):
                producer.publish(f"m{i}", exchange=EXCHANGE, routing_key=f"k{i % 3}")
            assert [s.ready for s in lib.stats([q.name for q in queues])] == [1, 1, 1]
        assert [s.ready for s in lib.stats([q.name for q in queues])] == [11, 11, 11]


def test_a_fenced_primary_is_waited_out_at_the_end(server: Server) -> None:
    """min-replicas-to-write with no replica: the server refuses every write (NOREPLICAS)
    until the fence is lifted, 0.5 s into the block's end; the end waits it out, as a publish
    of its own would (fence_timeout), and stores all three."""
    admin = server.client()
    with connection(server) as conn:
        producer = declared(conn)
        with confirm_together():
            for i in range(3):
                producer.publish(f"m{i}", exchange=EXCHANGE, routing_key="u")
            admin.config_set("min-replicas-to-write", 1)
            threading.Timer(0.5, lambda: admin.config_set("min-replicas-to-write", 0)).start()
        assert ready(server) == 4


def test_a_fence_that_outlasts_fence_timeout_is_raised(server: Server) -> None:
    admin = server.client()
    with connection(server, fence_timeout=0.2) as conn:
        producer = declared(conn)
        try:
            with pytest.raises(UnconfirmedPublishError, match="NoReplicasError"), confirm_together():
                producer.publish("fenced", exchange=EXCHANGE, routing_key="u")
                admin.config_set("min-replicas-to-write", 1)
        finally:
            admin.config_set("min-replicas-to-write", 0)
    assert stored(server) == ["first"]


GREEN = """
from gevent import monkey
monkey.patch_all()
import sys
import gevent
from kombu import Connection, Queue
from celery_redis_lua import Keyspace, ScriptLibrary, confirm_together
import redis
url, port = sys.argv[1], int(sys.argv[2])
queue = Queue("green", routing_key="green")
mine, theirs = (Connection(url).Producer(serializer="raw") for _ in range(2))
mine.publish("warm", exchange="", routing_key="green", declare=[queue])
theirs.publish("warm", exchange="", routing_key="green")
lib = ScriptLibrary(redis.Redis(port=port), Keyspace())
seen = {}

def in_a_block():
    with confirm_together():
        mine.publish("mine", exchange="", routing_key="green")
        gevent.sleep(0.2)  # the other greenlet runs meanwhile, its publish outside any block
        seen["in the block"] = lib.stats(["green"])[0].ready

def outside():
    gevent.sleep(0.05)
    theirs.publish("theirs", exchange="", routing_key="green")
    seen["theirs returned"] = lib.stats(["green"])[0].ready

gevent.joinall([gevent.spawn(in_a_block), gevent.spawn(outside)], raise_error=True)
print(seen["theirs returned"], seen["in the block"], lib.stats(["green"])[0].ready)
"""


def test_a_greenlets_block_is_its_own(valkey_server: Server, tmp_path: Path) -> None:
    """gevent: a block is the greenlet's (contextvars), so another greenlet's publish while it
    is open is confirmed at once, and the block's is stored at its end."""
    pytest.importorskip("gevent", reason="gevent is not installed (pip install gevent)")
    script = tmp_path / "green.py"
    script.write_text(GREEN)
    valkey_server.client().flushall()
    done = subprocess.run([sys.executable, str(script), f"redislua://127.0.0.1:{valkey_server.port}/0",
                           str(valkey_server.port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["3", "3", "4"], "theirs stored at once, mine at the block's end"
