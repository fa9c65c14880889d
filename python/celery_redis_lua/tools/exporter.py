"""``celery-redis-lua exporter``: Prometheus metrics of every queue, from the metrics script.

``celery_queue_length{queue_name=...}`` means what celery-exporter's does on kombu's stock
Redis transport (``LLEN``: messages ready to be delivered; not delayed, not in flight), so
existing dashboards, the celery-mixin alerts and KEDA's Prometheus scaler work unchanged.
The ``celery_redis_lua_*`` families say what only this broker knows. A scrape costs one
metrics call per group of queues sharing a cluster slot (one in all on a standalone
server), each bounded whatever the backlog; queues are discovered by a SCAN of their meta
keys and the binding tables (bindings for good only), at most every ``discover_interval``
seconds, and a discovered queue whose keys are gone has no series from the next scrape on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..protocol import logical
from ..protocol.eviction import Eviction, read_eviction
from ..protocol.library import ScriptLibrary
from ..protocol.ops import QueueMetrics

logger = logging.getLogger(__name__)

PREFIX = "celery_redis_lua"


class QueueCollector(Collector):
    """Collects on every scrape; a broker that cannot be reached makes ``*_up`` 0."""

    def __init__(self, lib: ScriptLibrary, queues: Sequence[str] = (), *,
                 discover_interval: float = 30.0) -> None:
        self.lib = lib
        self.fixed = list(queues)
        self.discover_interval = discover_interval
        self._known: list[str] = []
        self._bound: set[str] = set()  # of the discovered, those only bound (for good)
        self._discovered_at = float("-inf")
        self._lock = threading.Lock()  # the HTTP server may scrape from several threads

    def queues(self) -> list[str]:
        if self.fixed and time.monotonic() - self._discovered_at >= self.discover_interval:
            # A sharded queue named: its shards too (found by their names, a SCAN).
            self._known = [m for queue in self.fixed for m in logical.members_of(self.lib, queue)]
            self._discovered_at = time.monotonic()
        elif not self.fixed and time.monotonic() - self._discovered_at >= self.discover_interval:
            declared, bound = self.lib.declared_queues(), self.lib.bound_queues()
            found = sorted(set(declared) | set(bound))
            if not found and (self._known or self._discovered_at == float("-inf")):
                # Said once per change: an exporter given the wrong --prefix serves no queue
                # metrics, and nothing else would say why.
                logger.warning("celery-redis-lua exporter: no queues found under the key prefix %r; "
                               "queues of another prefix (the transport's global_keyprefix) are not "
                               "seen: is --prefix right?", self.lib.keys.prefix)
            self._known, self._bound = found, set(bound)
            self._discovered_at = time.monotonic()
        return self._known

    def gone(self, m: QueueMetrics) -> bool:
        """A discovered queue whose keys expired (or were deleted) since discovery: its series
        go at once, not at the next discovery. One named by --queue, or bound for good (it
        has no keys until something is published to it), stays."""
        return not (m.exists or self.fixed or m.queue in self._bound)

    def collect(self) -> Iterator[Metric]:
        began = time.perf_counter()
        with self._lock:
            try:
                names = self.queues()
                found = [m for m in self.lib.metrics(names) if not self.gone(m)] if names else []
                # Every scrape reads the policy, so every scrape reaches the broker, with no
                # queue too: up is 0 the moment it is gone.
                eviction = read_eviction(self.lib.client)
                up = 1
            except (redis.RedisError, OSError) as error:
                logger.warning("celery-redis-lua exporter: scrape failed: %s", error)
                found, up, eviction = [], 0, Eviction(None)
        yield from families(found)
        yield _gauge("eviction_policy", "1 when the broker's maxmemory-policy may evict its keys (any "
                     "policy but noeviction: docs/managed.md), 0 for noeviction; absent: not known.",
                     ["policy"], [([eviction.policy], int(eviction.risky))] if eviction.policy else [])
        yield _gauge("up", "1 when the last scrape reached the broker.", [], [([], up)])
        yield _gauge("scrape_duration_seconds", "How long the last scrape took.", [],
                     [([], time.perf_counter() - began)])


def _gauge(name: str, doc: str, labels: list[str], samples: Iterable[tuple[list[str], float]]) -> Metric:
    family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


def shard_family(folded: list[tuple[QueueMetrics, list[QueueMetrics]]]) -> Metric:
    return _gauge("queue_shard", "A shard of a sharded queue (x-shards): its messages by state "
                  "(ready, delayed, in_flight, dead); the queue's own series add its shards' up.",
                  ["queue", "shard", "state"],
                  (([q.queue, s.queue, state], getattr(s, state)) for q, shards in folded for s in shards
                   for state in ("ready", "delayed", "in_flight", "dead")))


def families(found: Sequence[QueueMetrics]) -> Iterator[Metric]:
    """The metric families of one scrape: a sharded queue's series are its own and its
    shards' added up, and each shard's are in ``celery_redis_lua_queue_shard``."""
    folded = logical.fold(found)
    yield shard_family(folded)
    found = [q for q, _ in folded]
    length = GaugeMetricFamily("celery_queue_length", "Messages ready to be delivered (what LLEN "
                               "counts on kombu's stock Redis transport).", labels=["queue_name"])
    for m in found:
        length.add_metric([m.queue], m.ready)
    yield length
    per_queue: list[tuple[str, str, Callable[[QueueMetrics], float]]] = [
        ("ready", "Messages ready to be delivered.", lambda m: m.ready),
        ("delayed", "Messages waiting for their ETA or countdown.", lambda m: m.delayed),
        ("retrying", "Of the delayed, messages waiting for a delayed retry (x-delayed-retry-type) "
         "after a failed or returned delivery.", lambda m: m.retrying),
        ("in_flight", "Messages delivered and not yet acked.", lambda m: m.in_flight),
        ("dead_letters", "Entries in the queue's dead-letter stream.", lambda m: m.dead),
        ("oldest_ready_age_seconds", "Since the oldest ready message became ready (0: none).",
         lambda m: (m.oldest_ready_age_ms or 0) / 1000),
    ]
    for name, doc, value in per_queue:
        yield _gauge(f"queue_{name}", doc, ["queue"], (([m.queue], value(m)) for m in found))
    paused = GaugeMetricFamily("celery_queue_paused", "1 while the queue is paused (celery-redis-lua "
                               "pause): it takes publishes and delivers nothing.", labels=["queue_name"])
    for m in found:
        paused.add_metric([m.queue], 0 if m.paused is None else 1)
    yield paused
    # A queue's limits (celery-redis-lua limit), on every queue: 0 means no limit, so a
    # dashboard can plot in_flight against limit_in_flight without a missing series.
    yield _gauge("queue_limit_in_flight", "Most messages of the queue in flight, across all consumers "
                 "(celery-redis-lua limit --in-flight; 0: no limit).", ["queue"],
                 (([m.queue], m.limits.in_flight or 0) for m in found))
    yield _gauge("queue_limit_rate_per_second", "Most deliveries per second, across all consumers "
                 "(celery-redis-lua limit --rate, as per second; 0: no limit).", ["queue"],
                 (([m.queue], m.limits.rate_per_second or 0) for m in found))
    due = [([m.queue], m.next_eta_in_ms / 1000) for m in found if m.next_eta_in_ms is not None]
    yield _gauge("queue_next_eta_seconds", "Until the earliest delayed message is due (absent: none).",
                 ["queue"], due)
    redelivered = CounterMetricFamily(f"{PREFIX}_queue_redeliveries", "Messages redelivered (timed out "
                                      "or rejected with requeue), since the queue was created.",
                                      labels=["queue"])
    dropped = CounterMetricFamily(f"{PREFIX}_queue_dropped", "Messages dead-lettered (or deleted when "
                                  "dead_letter_maxlen is 0) by reason, since the queue was created.",
                                  labels=["queue", "reason"])
    deduplicated = CounterMetricFamily(f"{PREFIX}_queue_deduplicated", "Publishes a dedup id dropped "
                                       "(simple, throttle) or messages a newer one replaced (debounce), by "
                                       "mode, since the queue was created.", labels=["queue", "mode"])
    for m in found:
        redelivered.add_metric([m.queue], m.redelivered)
        for reason, count in sorted(m.dropped.items()):
            dropped.add_metric([m.queue, reason], count)
        for mode, count in sorted(m.deduplicated.items()):
            deduplicated.add_metric([m.queue, mode], count)
    yield redelivered
    yield dropped
    yield deduplicated


def serve(lib: ScriptLibrary, *, port: int, address: str, queues: Sequence[str] = (),
          discover_interval: float = 30.0) -> Any:
    """Start the HTTP server (a thread) on ``address:port``; returns (server, thread)."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector(lib, queues, discover_interval=discover_interval))
    return start_http_server(port, addr=address, registry=registry)
