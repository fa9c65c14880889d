"""The keeper is the only thread the transport starts (kombu/keeper.py).

A process that publishes unconfirmed, consumes with acks and acks (so every part of the
outbox and the held table is in use) runs one background thread: the keeper. Before the
keeper step it ran three (acks, leases, unconfirmed publishes).
"""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT
from kombu_support import Broker

# Publishes unconfirmed, consumes with acks, holds one delivery unacked while it looks (the
# keeper is busy then: extending it), acks the rest, and prints the other threads' names.
PROCESS = """
import json, sys, threading
from kombu import Connection, Consumer, Exchange, Queue
import celery_redis_lua  # noqa: F401  (registers redislua://)

queue = Queue("counted", Exchange("counted", "direct"), routing_key="counted")
got = []
with Connection(sys.argv[1], transport_options={"confirm_publish": False, "visibility_timeout": 3}) as conn:
    producer = conn.Producer()
    for i in range(20):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key="counted", declare=[queue])
    with Consumer(conn, [queue], callbacks=[lambda body, message: got.append(message)]):
        while len(got) < 20:
            conn.drain_events(timeout=10)
        for message in got[1:]:
            message.ack()
        producer.publish({"i": "more"}, exchange=queue.exchange, routing_key="counted")
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        got[0].ack()
print(json.dumps(threads))
"""


def test_a_consuming_acking_unconfirmed_publishing_process_runs_one_background_thread(
        kind_broker: Broker) -> None:
    url = f"redislua://127.0.0.1:{kind_broker.server.port}/0"
    run = subprocess.run([sys.executable, "-c", PROCESS, url], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    threads = json.loads(run.stdout.strip().splitlines()[-1])
    assert threads == ["celery-redis-lua-keeper"], threads
