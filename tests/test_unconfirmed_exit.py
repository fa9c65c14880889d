"""Issue 31 item 3: unconfirmed publishes the server refuses are never lost silently at exit.

A producer process with ``confirm_publish=False`` publishes while the server refuses writes
(out of memory: ``maxmemory 1``, ``noeviction``) and ends without closing its connection,
as a script that calls ``send_task`` and ends does. Its last batch goes out at exit and is
refused: the process must say so on stderr, naming the queue and how many.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_redis_lua import Keyspace, ScriptLibrary
from conftest import require_kind
from helpers import ROOT
from scripts.servers import Server

NAME = "outbox"
QUEUE = Queue(NAME, Exchange(NAME, "direct"), routing_key=NAME)
COUNT = 3

# The producer: publishes COUNT messages unconfirmed and ends, its connection left open.
PRODUCER = """
import sys
from kombu import Connection, Exchange
import celery_redis_lua  # noqa: F401  (registers redislua://)

conn = Connection(sys.argv[1], transport_options={"confirm_publish": False,
                                                  "publish_pipeline": int(sys.argv[4])})
producer = conn.Producer()
for i in range(int(sys.argv[2])):
    producer.publish({"i": i}, exchange=Exchange(sys.argv[3], "direct"), routing_key=sys.argv[3])
print("published", sys.argv[2])
"""


def refused_for_memory(client: redis.Redis) -> int:
    return int(client.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


@pytest.fixture(params=["valkey", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    require_kind(request.param)
    with Server(request.param, args=["--maxmemory-policy", "noeviction"]) as srv:
        yield srv


# A pipeline of 100 (the default): the last batch is sent at exit. Of 1: a publish is written
# at once and its reply still unread at exit (the exit must read it, not only send); one
# publish, since the next would raise the refusal of the one before.
@pytest.mark.parametrize(("pipeline", "count"), [(100, COUNT), (1, 1)])
def test_a_producer_that_exits_without_close_names_its_refused_publishes(server: Server,
                                                                         pipeline: int, count: int) -> None:
    url = f"redislua://127.0.0.1:{server.port}/0"
    with Connection(url) as conn:
        QUEUE(conn.default_channel).declare()
    client = server.client(socket_timeout=10)
    lib = ScriptLibrary(client, Keyspace())
    client.config_set("maxmemory", 1)  # every write is refused from now on
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        lib.publish(NAME, "{}")
    refused_before = refused_for_memory(client)

    run = subprocess.run([sys.executable, "-c", PRODUCER, url, str(count), NAME, str(pipeline)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)

    assert run.stdout.strip() == f"published {count}", run.stderr
    [stats] = lib.stats([NAME])
    assert stats.ready == 0
    assert refused_for_memory(client) - refused_before >= count  # sent (at exit) and refused
    said = run.stderr
    assert NAME in said and re.search(rf"\b{count}\b", said), (
        f"the producer exited with status {run.returncode} and said nothing of its {count} refused "
        f"publishes to {NAME!r} (stderr: {said!r})")
