"""Broker mechanics: a celery-benchmark-style load through kombu, for any transport.

Like redis-performance/celery-benchmark: prefill N messages (each carrying its
enqueue time), then W concurrent consumers (processes, one connection each) drain
the queue; latency is enqueue -> dequeue (time in the queue), recorded in HDR
histograms, with a per-second series of throughput and latency percentiles. Unlike
that tool, each consumer is a real kombu Consumer that acks every message (with the
transport's own ack bookkeeping, which celery-benchmark leaves out), so its numbers
are not an upper bound but what a kombu consumer gets. The result entry follows
celery-benchmark's JSON schema (plus ``server`` and ``rep``).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from array import array
from typing import Any

from kombu import Consumer, Producer

from . import hdr
from .peers import Peer, bind_queue, body_of_size, delete_queue, unique_queue
from .server_cost import Probe

POLL_SECONDS = 0.25


def _consume(peer: Peer, name: str, prefetch: int, n: int, counter: Any, barrier: Any, start: Any,
             results: Any) -> None:
    samples = array("d")  # dequeue monotonic ns, latency µs, ...
    errors = 0
    try:
        with peer.connection() as conn:
            channel = conn.channel()

            def on_message(body: Any, message: Any) -> None:
                now = time.monotonic_ns()
                message.ack()
                samples.append(now)
                samples.append((now - body["enqueued_ns"]) / 1000)
                with counter.get_lock():
                    counter.value += 1

            consumer = Consumer(channel, [bind_queue(name)], callbacks=[on_message], accept=["json"],
                                prefetch_count=prefetch)
            barrier.wait()
            start.wait()
            with consumer:
                while counter.value < n:
                    try:
                        conn.drain_events(timeout=POLL_SECONDS)
                    except TimeoutError:
                        continue
                    except Exception:
                        errors += 1
    finally:
        results.put((samples.tobytes(), errors))


def run(peer: Peer, n: int, workers: int, prefetch: int, size: int, timeout: float,
        warmup: int = 0) -> dict[str, Any]:
    """One trial; returns a celery-benchmark ``results[]`` entry."""
    if warmup:
        run(peer, warmup, workers, prefetch, size, timeout)
    name = unique_queue("m")
    queue = bind_queue(name)
    probe = Probe(peer)
    ctx = mp.get_context("fork")
    counter, barrier, start, results = ctx.Value("q", 0), ctx.Barrier(workers + 1), ctx.Event(), ctx.Queue()
    try:
        with peer.connection() as conn:
            channel = conn.channel()
            queue(channel).declare()
            producer = Producer(channel, exchange=queue.exchange, routing_key=name, serializer="json")
            before = probe.snapshot()
            for _ in range(n):
                producer.publish(body_of_size(size, enqueued_ns=time.monotonic_ns()))
            after_prefill = probe.snapshot()
            channel.close()
        procs = [ctx.Process(target=_consume, args=(peer, name, prefetch, n, counter, barrier, start,
                                                    results), daemon=True) for _ in range(workers)]
        for proc in procs:
            proc.start()
        barrier.wait(timeout=60)
        began = time.monotonic_ns()
        start.set()
        samples, errors = array("d"), 0
        deadline = time.monotonic() + timeout
        for _ in procs:
            raw, errs = results.get(timeout=max(1.0, deadline - time.monotonic()) + 30)
            samples.frombytes(raw)
            errors += errs
        for proc in procs:
            proc.join(timeout=30)
        after = probe.snapshot()
    finally:
        probe.close()
        delete_queue(peer, name)
    dequeued, latency = samples[0::2], samples[1::2]
    last = max(dequeued, default=began)
    duration = max(1e-9, (last - began) / 1e9)
    seconds = int(duration) + 1
    buckets: list[list[float]] = [[] for _ in range(seconds)]
    for at, lat in zip(dequeued, latency, strict=True):
        buckets[min(seconds - 1, int((at - began) // 1_000_000_000))].append(lat)
    per_second = [hdr.per_second(bucket) for bucket in buckets]
    series = {key: [entry[key] for entry in per_second] for key in ("p50", "p90", "p99", "p999", "max")}
    return {
        "workers": workers, "total_jobs": len(latency), "duration_s": round(duration, 3),
        "jobs_per_sec": round(len(latency) / duration, 1), "timed_out": duration > timeout,
        "throughput_per_sec": [len(bucket) for bucket in buckets],
        "errors_per_sec": [0] * seconds, "latency_per_sec_us": series,
        "latency_us": hdr.summary(latency), "errors": errors, "prefetch": prefetch,
        "server": {"prefill": probe.cost(before, after_prefill, n),
                   "drain": probe.cost(after_prefill, after, n)},
    }


def document(peer: Peer, tag: str, timestamp: str, n: int, workers: list[int], warmup: int,
             results: list[dict[str, Any]]) -> dict[str, Any]:
    """celery-benchmark's JSON document for one peer."""
    return {"tag": tag, "timestamp": timestamp,
            "config": {"url": peer.url, "transport": peer.transport, "workers": workers,
                       "jobs_per_trial": n, "queues": ["bench-m-<random per trial>"],
                       "warmup_jobs": warmup},
            "results": results}
