"""The ledger: a separate Valkey where the producer, the workers and the fault injector
record what happened, by task id, as JSON list entries under ``chaos:<kind>``.

``submit``: id, t (before the publish), sent (after it returned), kind, priority, eligible
(the ETA of a countdown, else t), seconds, queue; ``submit_error``: id, t, kind, error;
``start`` / ``finish``: id, t, worker, pid (a start also its delivery count and receipt);
``batch`` (our transport's workers, batches.py): t, after, pid, channel, deliveries as
[queue, task id, delivery count] in the order taken; ``fault``, ``event``,
``listener_error``; ``flow_end`` (with ``--flow``, scripts/chaos/flow.py): id, t, started (the
start's t), worker, pid, kind, delivery_count, outcome ("ok", or "retry": rejected with requeue)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

import redis

KINDS = ("submit", "submit_error", "start", "finish", "fault", "event", "listener_error", "batch",
         "flow_end")
_client: dict[str, Any] = {"pid": None, "url": None, "client": None}


def client(url: str | None = None) -> redis.Redis:
    """One client per process and ledger (a prefork child builds its own after the fork; a
    second run in one process, as the two smoke tests in one pytest session, its own ledger's)."""
    url = url or os.environ["CHAOS_LEDGER_URL"]
    if _client["pid"] != os.getpid() or _client["url"] != url:
        _client["client"] = redis.Redis.from_url(url)
        _client["pid"], _client["url"] = os.getpid(), url
    ledger: redis.Redis = _client["client"]
    return ledger


def record(stream: str, url: str | None = None, /, **fields: Any) -> None:
    client(url).rpush(f"chaos:{stream}", json.dumps(fields))


def read(url: str) -> dict[str, list[dict[str, Any]]]:
    ledger = redis.Redis.from_url(url)
    try:
        return {kind: [json.loads(raw) for raw in ledger.lrange(f"chaos:{kind}", 0, -1)]
                for kind in KINDS}
    finally:
        ledger.close()


def by_id(entries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in sorted(entries, key=lambda e: e["t"]):
        grouped[entry["id"]].append(entry)
    return grouped
