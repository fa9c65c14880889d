"""Celery's ``revoke()`` reaches the broker (issue 39 §2).

``app.control.revoke(task_id)`` is a broadcast to the workers that are up, through the
``<namespace>.pidbox`` fanout exchange: a worker that is down never hears it, and every
worker forgets it at restart, so a countdown revoked while the workers were down ran anyway
(celery/celery#8888). The transport reads the command on its way out: each task named that
is still waiting in a queue (ready, delayed, waiting to retry) is dead-lettered there with
reason ``revoked`` by the cancel script, atomically against a consumer taking it; one in
flight is marked, so that if it comes back (its worker died, its lease lapsed, it was handed
back) it is dead-lettered ``revoked`` instead of run again. The broadcast goes to the workers
as before (``terminate=True`` included): a running task is theirs to revoke. No patch to
Celery: a producer on this transport is all it takes.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from typing import Any

from .library import ScriptLibrary

logger = logging.getLogger(__name__)

PIDBOX_SUFFIX = ".pidbox"  # kombu's Mailbox exchange: '<namespace>.pidbox' ('celery.pidbox')
EVENTS = "celeryev."  # a worker's event queues: 'celeryev.<uuid>'
MAX_TASK_ID = 256  # what publish indexes (a longer id was never indexed, so never found)


def revoked_task_ids(exchange: str, message: Mapping[str, Any]) -> list[str]:
    """The task ids of a pidbox ``revoke`` command (a str or a list of them); [] for any
    other message, or one this cannot read (another serializer)."""
    if not exchange.endswith(PIDBOX_SUFFIX):
        return []
    try:
        body = message["body"]
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        command = json.loads(body)
    except (KeyError, TypeError, ValueError):
        return []
    if not isinstance(command, dict) or command.get("method") != "revoke":
        return []
    ids = (command.get("arguments") or {}).get("task_id")
    ids = [ids] if isinstance(ids, str) else ids if isinstance(ids, list) else []
    return [i for i in dict.fromkeys(ids) if isinstance(i, str) and 0 < len(i) <= MAX_TASK_ID]


def revoke_waiting(lib: ScriptLibrary, task_ids: list[str]) -> int:
    """Dead-letter, reason 'revoked', each of ``task_ids`` waiting in any queue; how many were.
    One cancel call per queue and task, pipelined (grouped by slot on a cluster)."""
    # A worker's own queues (pidbox replies, events) never hold a task.
    queues = [q for q in lib.declared_queues() if not q.endswith(PIDBOX_SUFFIX) and not q.startswith(EVENTS)]
    calls = [lib.calls.cancel(queue, task_id, reason="revoked") for queue in queues for task_id in task_ids]
    results = lib.run_many(calls, raise_on_error=False) if calls else []
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        logger.warning("celery-redis-lua: revoke: %d of %d cancel calls failed (first: %s); those tasks "
                       "may still run", len(failed), len(calls), failed[0])
    outcomes = [r.outcome for r in results if not isinstance(r, Exception)]
    revoked, marked = outcomes.count("cancelled"), outcomes.count("in_flight")
    if revoked or marked:
        logger.info("celery-redis-lua: revoke of %d task(s): %d waiting message(s) dead-lettered in the "
                    "broker (reason 'revoked'), %d in flight marked not to run again", len(task_ids),
                    revoked, marked)
    return revoked
