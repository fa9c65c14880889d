"""Confirm together (issue 41 §1): the publishes a block makes are confirmed at its end, many
per script call, instead of one round trip each.

    from celery_redis_lua import confirm_together

    with confirm_together():
        group(add.s(i, i) for i in range(100)).apply_async()

Group commit (group.py) rides publishes that are in flight at the same time; a loop in one
thread (Celery's ``group().apply_async()``, a chord's header, ``chunks``, ``send_task`` in a
loop) has one in flight at a time, so each waits for its own round trip. Inside the block a
confirmed publish (the transport's default) returns once its message is gathered; the
gathered messages go as a round of group commit (one ``publish`` call per queue and up to
MAX_BATCH messages, the calls of different queues in one pipeline, with whatever other
threads of the process publish to that server meanwhile) when ``publish_pipeline`` of them
have gathered, and at the block's end. The end reads every
reply, publishes again (confirmed, on a connection of its own) what a cached route that went
stale refused, and raises :class:`UnconfirmedPublishError` naming what the server refused or
what a lost connection left unknown (its ``task_ids``: which tasks). Nothing the block
published is unconfirmed once it has ended: the promise moves from each publish to the
block's end (with ``durability``, the round's wait is part of it). A fenced primary's
refusal (``NOREPLICAS``) is waited out as a publish of its own waits it out, for up to
``fence_timeout``; a demoted primary's (``READONLY``) and a lost connection, for up to
LOST_SECONDS or ``fence_timeout`` if longer, the latter only for a message with a task id.
Kombu's retry policy, which a publish of its own rides after that, does not apply to a block:
with a fenced group that refuses writes for 10-15 s after a failover, raise ``fence_timeout``.

What it gives up, inside the block only: a crash loses what has gathered and not gone, as
with ``confirm_publish=False``. A publish whose outcome a lost connection left unknown can
be sent again: with a task id (every Celery task has one) the task index finds the stored
copy, and nothing is stored twice.

The block is the context's (a thread's, or a greenlet's: contextvars); a block inside
another joins it, and the outer one's end confirms both. :func:`confirm_groups` opens one in
each of a Celery app's producer scopes: every group, chord header and ``chunks`` then rides
one call, with no change where they are sent. Fanout publishes (broadcast) are
not queue publishes and stay confirmed one by one. With ``confirm_publish=False`` the
channel's own pipeline is used as before; the block adds nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .fence import NoReplicasError, pauses, refusal
from .group import Pending, group_for
from .ops import Outgoing, StaleRoute
from .unconfirmed import Send, UnconfirmedPublishError

__all__ = ["Together", "confirm_groups", "confirm_together", "current", "gather"]

Redeliver = Callable[[list[Send]], None]  # publish these again, confirmed (the kombu channel's)
# How long a message a lost connection or a demoted primary refused is sent again: a restart
# or a failover (kombu's retry policy, which a publish of its own rides, is not the block's).
LOST_SECONDS = 10.0


@dataclass(eq=False)
class _Gathered:
    """A block's publishes through one script library (a kombu channel's)."""

    lib: Any
    size: int
    fence_timeout: float
    redeliver: Redeliver
    pending: list[tuple[Send, Pending]] = field(default_factory=list)
    stale: list[Send] = field(default_factory=list)
    refused: list[tuple[str, BaseException, str | None]] = field(default_factory=list)  # + task id

    def go(self) -> None:
        """Send what has gathered (a round of group commit); send again what may go again
        (:func:`_again`), backing off from 50 ms to 1 s; record what became of each."""
        batch, self.pending = self.pending, []
        began, waits = time.monotonic(), pauses()
        while batch:
            with contextlib.suppress(Exception):  # a lost connection: every pending's result, below
                group_for(self.lib).publish_all(self.lib, [pending for _, pending in batch])
            waited = time.monotonic() - began
            again = [(sent, p) for sent, p in batch if _again(sent, p.result, waited, self.fence_timeout)]
            if not again:
                break
            self._record([(sent, p) for sent, p in batch if not any(p is q for _, q in again)])
            batch = [(sent, Pending(p.queue, p.message)) for sent, p in again]
            time.sleep(next(waits))  # nothing tells when a replica catches up or a server is back
        self._record(batch)

    def _record(self, batch: list[tuple[Send, Pending]]) -> None:
        for sent, pending in batch:
            result = pending.result
            if isinstance(result, StaleRoute):
                if not self.stale or self.stale[-1] is not sent:  # a message routed to several queues
                    self.stale.append(sent)
            elif isinstance(result, BaseException) or result is None:
                self.refused.append((pending.queue, result or RuntimeError("not sent"), _task_id(sent)))
            else:
                sent.stored.add(pending.queue)


def _task_id(sent: Send) -> str | None:
    headers = sent.message.get("headers")
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id if isinstance(task_id, str) else None


def _again(sent: Send, result: object, waited: float, fence_timeout: float) -> bool:
    """Whether a message may go again after ``waited`` seconds: refused before it ran, by a
    fenced primary (within ``fence_timeout``, as a publish of its own waits it out) or by a
    demoted one (READONLY, within LOST_SECONDS or ``fence_timeout`` if longer); or left unknown
    by a lost connection, within the same, when it has a task id (the task index finds a stored
    copy: a lost reply's message is not stored twice). Without a task id it is raised: it might
    be stored."""
    if isinstance(result, ResponseError) and isinstance(refusal(result), NoReplicasError):
        return waited < fence_timeout
    # A failover can be a lost connection, then a demoted primary, then a fence (the promoted
    # replica without one of its own): what the user allows for a fence is allowed for all.
    window = max(LOST_SECONDS, fence_timeout)
    if isinstance(result, ReadOnlyError):
        return waited < window
    lost = isinstance(result, RedisConnectionError | RedisTimeoutError)
    return lost and waited < window and _task_id(sent) is not None


class Together:
    """One block's publishes (see the module's docstring)."""

    def __init__(self) -> None:
        self._gathered: dict[int, _Gathered] = {}

    def add(self, lib: Any, limits: tuple[int, float], sent: Send, queue: str, message: Outgoing,
            redeliver: Redeliver) -> None:
        """Gather ``message`` for ``queue`` (of the publish ``sent``); send the gathered ones
        when ``limits[0]`` of them are waiting (``limits[1]``: the fence timeout)."""
        gathered = self._gathered.get(id(lib))
        if gathered is None or gathered.lib is not lib:
            gathered = self._gathered[id(lib)] = _Gathered(lib, *limits, redeliver)
        gathered.pending.append((sent, Pending(queue, message)))
        if len(gathered.pending) >= gathered.size:
            gathered.go()

    def finish(self) -> None:
        """Send what is left, publish again what a stale route refused, and raise what was
        refused or left unknown, every library's together."""
        for gathered in self._gathered.values():  # every library's sent before any is raised
            gathered.go()
        refused: list[tuple[str, BaseException, str | None]] = []
        for gathered in self._gathered.values():
            refused += gathered.refused
            if not gathered.stale:
                continue
            try:
                gathered.redeliver(gathered.stale)
            except Exception as error:  # each may or may not have gone again: all named
                refused += [(f"exchange {sent.exchange!r}", error, _task_id(sent)) for sent in gathered.stale]
        if refused:
            raise UnconfirmedPublishError([(queue, error) for queue, error, _ in refused],
                                          [task_id for _, _, task_id in refused])


_CURRENT: ContextVar[Together | None] = ContextVar("celery_redis_lua_together", default=None)


def current() -> Together | None:
    """The block this context is in, or None."""
    return _CURRENT.get()


def gather(lib: Any, limits: tuple[int, float], sent: Send, queue: str, message: Outgoing,
           redeliver: Redeliver) -> None:
    """Gather a publish in this context's block (:meth:`Together.add`): ``limits`` are the
    channel's ``publish_pipeline`` and ``fence_timeout``."""
    scope = _CURRENT.get()
    if scope is None:
        raise RuntimeError("celery-redis-lua: a publish gathered outside a confirm_together() block")
    scope.add(lib, limits, sent, queue, message, redeliver)


@contextlib.contextmanager
def confirm_together() -> Iterator[None]:
    """Confirm the block's publishes together at its end (see the module's docstring). What
    the block published before an exception in it is sent all the same."""
    if _CURRENT.get() is not None:
        yield  # the outer block confirms
        return
    scope = Together()
    token = _CURRENT.set(scope)
    try:
        yield
    finally:
        _CURRENT.reset(token)  # what is published again at the end is confirmed, one by one
        scope.finish()


def confirm_groups(app: Any) -> None:
    """Confirm together, for a Celery ``app``, what each of its producer scopes publishes: a
    group's ``apply_async()`` (its tasks), a chord's header, ``chunks``, one call each; a single
    ``send_task`` or ``delay`` is its own scope and returns once stored, as before. Every
    publish of Celery's goes through ``app.producer_or_acquire``: the block is opened inside
    it, so it ends while the producer (and its channel) is still this thread's."""
    acquire = app.producer_or_acquire

    @contextlib.contextmanager
    def producer_or_acquire(producer: Any = None) -> Iterator[Any]:
        with acquire(producer) as held, confirm_together():
            yield held

    app.producer_or_acquire = producer_or_acquire
