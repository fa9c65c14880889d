"""kombu level: Producer.publish of N messages, then consume + ack of the same N.

One connection, one channel, a fresh queue per run (deleted afterwards). The
consume phase starts with the N messages already in the queue and uses a Consumer
with the given prefetch, acking each message in its callback, as a worker would.
Server cost is measured per phase, and the client's CPU (this process, every thread: the
ack sender's too) per message. For our transport on one server, the single-connection
round-trip ceiling is measured in the same run: a redis-py loop of a no-op EVALSHA.
"""

from __future__ import annotations

import time
from typing import Any

from kombu import Consumer, Producer

from .peers import Peer, bind_queue, body_of_size, delete_queue, unique_queue
from .server_cost import Probe

DRAIN_TIMEOUT = 10.0  # seconds without a single delivery = the run is broken


def run(peer: Peer, n: int, prefetch: int, size: int, queue_name: str | None = None) -> dict[str, Any]:
    """With ``queue_name``, on that queue as it is (the consume phase takes the first ``n`` of
    what it holds; the queue is left in place, as deep as before); else on a fresh one."""
    name = queue_name or unique_queue("k")
    queue = bind_queue(name)
    body = body_of_size(size)
    probe = Probe(peer)
    try:
        with peer.connection() as conn:
            channel = conn.channel()
            queue(channel).declare()
            producer = Producer(channel, exchange=queue.exchange, routing_key=name, serializer="json")

            before = probe.snapshot()
            began, cpu = time.perf_counter(), time.process_time()
            with peer.block():
                for _ in range(n):
                    producer.publish(body)
            publish_s, publish_cpu = time.perf_counter() - began, time.process_time() - cpu
            after_publish = probe.snapshot()

            acked = 0

            def on_message(_body: Any, message: Any) -> None:
                # Exactly n acked: a transport that hands over a prefetch batch per
                # drain_events (ours) would otherwise ack up to prefetch - 1 more than it is
                # timed for; the rest go back to the queue when the channel closes.
                nonlocal acked
                if acked < n:
                    message.ack()
                    acked += 1

            consumer = Consumer(channel, [queue], callbacks=[on_message], accept=["json"],
                                prefetch_count=prefetch)
            began, cpu = time.perf_counter(), time.process_time()
            with consumer:
                while acked < n:
                    conn.drain_events(timeout=DRAIN_TIMEOUT)
            consume_s, consume_cpu = time.perf_counter() - began, time.process_time() - cpu
            after_consume = probe.snapshot()
            channel.close()
        publish = {"seconds": publish_s, "msgs_per_s": n / publish_s,
                   "client_cpu_us_per_msg": publish_cpu * 1e6 / n,
                   "server": probe.cost(before, after_publish, n)}
        consume = {"seconds": consume_s, "msgs_per_s": n / consume_s,
                   "client_cpu_us_per_msg": consume_cpu * 1e6 / n,
                   "server": probe.cost(after_publish, after_consume, n)}
        total_cpu = None
        if publish["server"] and consume["server"]:
            total_cpu = publish["server"]["cpu_us_per_msg"] + consume["server"]["cpu_us_per_msg"]
        return {"n": n, "prefetch": prefetch, "publish": publish, "consume": consume,
                "server_cpu_us_per_msg": total_cpu, "ceiling": ceiling(peer, n)}
    finally:
        probe.close()
        if queue_name is None:
            delete_queue(peer, name)


def ceiling(peer: Peer, n: int) -> dict[str, float] | None:
    """What one connection can do: ``n`` no-op EVALSHAs in a loop, one round trip each (our
    transport on one server only; None otherwise)."""
    if not peer.url.startswith("redislua://"):
        return None
    client = peer.redis_client()
    assert client is not None
    try:
        sha = client.script_load("return 1")
        began = time.perf_counter()
        for _ in range(n):
            client.evalsha(sha, 0)
        return {"evalsha_per_s": n / (time.perf_counter() - began)}
    finally:
        client.close()
