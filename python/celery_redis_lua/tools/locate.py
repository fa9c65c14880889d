"""Where is my task, and cancel it in the broker.

Celery reports PENDING for a task that is queued, delayed, running, dead-lettered or was
never sent. The broker knows which: publish indexes each message under its Celery task id
(the envelope's ``headers.id``), in its queue's state hash, and the scripts that drop a
message drop its entries. :func:`locate_task` asks every queue (or the ones given) with the
locate script, then looks for the task among the queues' dead letters; :func:`cancel_task`
takes a ready or delayed message out with the cancel script (as a dead letter with reason
``cancelled``, so it can be replayed) and leaves one in flight alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..protocol.library import ScriptLibrary
from ..protocol.ops import Cancelled
from .envelope import task_of

DEAD_PAGE = 1000  # dead letters read per call while searching a queue's stream


@dataclass(frozen=True)
class Whereabouts:
    """``state``: 'ready', 'delayed', 'retry' (waiting for a delayed retry), 'in_flight',
    'dead' or 'absent' (acked, expired, purged, never published, or published without its
    task id). Times are the server's unix ms."""

    task_id: str
    state: str
    queue: str | None = None
    message_id: str | None = None
    priority: int | None = None
    delivery_count: int | None = None
    ahead: int | None = None  # ready: messages before it (an estimate while others publish)
    eta_ms: int | None = None  # delayed, retry: when it is ready
    deadline_ms: int | None = None  # in flight: when the sweep takes it back unless acked
    expires_at_ms: int | None = None  # its message TTL deadline, if any
    reason: str | None = None  # dead
    dead_entry: str | None = None  # dead: the stream entry id (its first part is unix ms)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def locate_task(lib: ScriptLibrary, task_id: str, queues: Sequence[str] | None = None) -> Whereabouts:
    """Where ``task_id`` is: the first queue whose index has it, else its newest dead letter."""
    names = list(queues) if queues else lib.queue_names()
    for queue in names:
        found = lib.locate(queue, task_id)
        if found.state == "missing":
            continue
        common: dict[str, Any] = {"queue": queue, "message_id": found.id, "priority": found.priority,
                  "delivery_count": found.delivery_count, "expires_at_ms": found.expires_at}
        if found.state == "ready":
            return Whereabouts(task_id, "ready", ahead=found.detail, **common)
        if found.state in ("delayed", "retry"):
            return Whereabouts(task_id, found.state, eta_ms=found.detail, **common)
        return Whereabouts(task_id, "in_flight", deadline_ms=found.detail, **common)
    for queue in names:
        letter = _newest_dead_letter(lib, queue, task_id)
        if letter is not None:
            return Whereabouts(task_id, "dead", queue=queue, message_id=letter.id, priority=letter.priority,
                               delivery_count=letter.delivery_count, reason=letter.reason,
                               dead_entry=letter.entry_id)
    return Whereabouts(task_id, "absent")


def _newest_dead_letter(lib: ScriptLibrary, queue: str, task_id: str) -> Any:
    """The newest dead letter of ``queue`` for ``task_id`` (streams are capped by
    dead_letter_maxlen, so this reads a bounded number of pages)."""
    newest, after = None, None
    while True:
        page = lib.dead_list(queue, count=DEAD_PAGE, after=after)
        for letter in page:
            if task_of(letter.payload)[1] == task_id:
                newest = letter
        if len(page) < DEAD_PAGE:
            return newest
        after = page[-1].entry_id


def cancel_task(lib: ScriptLibrary, task_id: str, queues: Sequence[str] | None = None) -> Cancelled:
    """Cancel ``task_id`` in the first queue that holds it; 'missing' if none does."""
    for queue in list(queues) if queues else lib.queue_names():
        done = lib.cancel(queue, task_id)
        if done.outcome != "missing":
            return done
    return Cancelled("", "missing")


@contextlib.contextmanager
def library_of(app: Any) -> Iterator[ScriptLibrary]:
    """The script library of ``app``'s broker connection (our transport)."""
    with app.connection_for_write() as connection:
        lib = getattr(connection.default_channel, "lib", None)
        if not isinstance(lib, ScriptLibrary):
            raise TypeError(f"the app's broker transport is {type(connection.transport).__name__}, "
                            "not celery-redis-lua's")
        yield lib


def where(app: Any, task_id: str, queues: Sequence[str] | None = None) -> Whereabouts:
    """``celery_redis_lua.where(app, task_id)``: where the task is, through the app's broker."""
    with library_of(app) as lib:
        return locate_task(lib, task_id, queues)


def cancel(app: Any, task_id: str, queues: Sequence[str] | None = None) -> Cancelled:
    """``celery_redis_lua.cancel(app, task_id)``: cancel a ready or delayed task through the
    app's broker connection, so it never runs. A task already in flight is reported
    (``outcome == 'in_flight'``) and left alone: revoke it in Celery."""
    with library_of(app) as lib:
        return cancel_task(lib, task_id, queues)
