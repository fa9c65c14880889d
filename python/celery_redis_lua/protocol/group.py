"""Group commit of confirmed publishes (issue 41 §1): the publishes one process has in flight
at once to one server ride one script call per queue.

A database commits this way. The first caller leads: it sends its own publish at once, so
a lone producer waits for nothing more than it did. Whoever arrives while that round trip
is out waits; when it comes back, the leader hands the lead to the first of them, who sends
everything that gathered meanwhile: one ``publish`` call per queue (publish.lua takes a
batch, every message stored as a publish of its own would store it) and the calls of
different queues in one pipeline. Each caller gets its own reply or its own error, and
none returns before its message is stored (and, with ``durability``, its wait confirmed).

Who may ride together: threads and greenlets of one process whose libraries talk to the
same server (its address, database and user; a Sentinel service with its sentinels; one
cluster client) with the same keyspace and policy. Celery's producers each take a kombu
connection of their own from its pool, so the registry is per process, not per connection.

What one caller does not do to another: a message refused by the script (a bad argument
from another language's producer, say) refuses its batch, so that batch is sent again one
message per call and each gets its own answer; an argument the Python side refuses is that
caller's error alone (raised as it builds its message); a connection error reaches every
caller of the round, each of whom decides (kombu's retry, the fence's wait) as it would for
a publish of its own.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from .call import Call, ScriptError
from .ops import Outgoing, Published, StaleRoute, publish_many
from .ops.delivery import MAX_BATCH

__all__ = ["GroupCommit", "Pending", "group_for", "publish_confirmed", "send", "server_of"]


@dataclass(eq=False)
class Pending:
    """One caller's publish, and what became of it."""

    queue: str
    message: Outgoing
    done: threading.Event | None = None  # a follower's: set when answered, or handed the lead
    lead: bool = False  # handed the lead: the caller sends the next round itself
    result: Published | StaleRoute | BaseException | None = None

    def answer(self) -> Published:
        result = self.result
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        return result


class GroupCommit:
    """The publishes in flight to one server (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[Pending] = []
        self._leading = False
        self.rounds = 0  # calls sent (a round's pipeline counts once): for tests and the docs
        self.published = 0

    @property
    def waiting(self) -> int:
        """Callers waiting for the round being sent to come back."""
        with self._lock:
            return len(self._waiting)

    def publish(self, lib: Any, queue: str, message: Outgoing) -> Published:
        """Store ``message`` in ``queue`` through ``lib`` (a :class:`~.library.ScriptLibrary`),
        with whoever else is publishing now: what ``lib.publish`` would return; raises what it
        would raise (:class:`StaleRoute` too)."""
        mine = Pending(queue, message)
        self.publish_all(lib, [mine])
        return mine.answer()

    def publish_all(self, lib: Any, pendings: list[Pending]) -> None:
        """Store each of ``pendings`` (a confirm_together() block's round, together.py) with
        whoever else is publishing now; each gets its result (a connection error is raised
        too, as :meth:`publish` raises it). They join the round as one: the first of them
        waits for it, or leads."""
        first = pendings[0]
        with self._lock:
            self._waiting.extend(pendings)
            follow, self._leading = self._leading, True
            if follow:
                first.done = threading.Event()
        if first.done is not None:
            first.done.wait()
            if not first.lead:
                return
        self._lead(lib)

    def _lead(self, lib: Any) -> None:
        """Send every waiting publish, then hand the lead to the first caller who came
        meanwhile (or give it up): no caller sends rounds for others after its own is done."""
        with self._lock:
            batch, self._waiting = self._waiting, []
        try:
            send(lib, batch)
        finally:
            self.rounds += 1
            self.published += len(batch)
            for pending in batch:
                if pending.done is not None:
                    pending.done.set()
            with self._lock:
                if self._waiting:
                    self._waiting[0].lead = True
                    self._waiting[0].done.set()  # type: ignore[union-attr]  # a follower's
                else:
                    self._leading = False


def send(lib: Any, batch: list[Pending]) -> None:
    """One pipeline: a publish call per queue (a batch of up to MAX_BATCH messages, or the
    single layout for one); each pending gets its result. A script's refusal of a batch sends
    that batch's messages again one per call."""
    calls: list[tuple[Call[Any], list[Pending]]] = []
    by_queue: dict[str, list[Pending]] = {}
    for pending in batch:  # each message was checked when its publisher built it (Outgoing)
        by_queue.setdefault(pending.queue, []).append(pending)
    for queue, pendings in by_queue.items():
        for start in range(0, len(pendings), MAX_BATCH):
            chunk = pendings[start:start + MAX_BATCH]
            calls.append((publish_many(lib.keys, lib.policy, queue, [p.message for p in chunk]), chunk))
    if not calls:
        return
    try:
        results = _run(lib, [call for call, _ in calls])
    except BaseException as error:  # the connection, NotDurable: each caller's, as if alone
        # The leader's interrupt (a signal, a killed greenlet) is its own: to the others it is
        # a round trip whose outcome is unknown, as a lost connection's.
        theirs = error if isinstance(error, Exception) else RedisConnectionError(
            f"the publishing thread was interrupted ({type(error).__name__}): "
            "the publish may or may not be stored")
        for _, chunk in calls:
            for pending in chunk:
                pending.result = theirs
        raise
    again: list[tuple[Call[Any], Pending]] = []
    for (_, chunk), result in zip(calls, results, strict=True):
        if isinstance(result, ScriptError) and len(chunk) > 1:
            again += [(publish_many(lib.keys, lib.policy, p.queue, [p.message]), p) for p in chunk]
        elif isinstance(result, BaseException):
            for pending in chunk:
                pending.result = result
        else:
            for pending, outcome in zip(chunk, result, strict=True):
                pending.result = outcome
    if again:
        replies = _run(lib, [call for call, _ in again])
        for (_, pending), result in zip(again, replies, strict=True):
            pending.result = result if isinstance(result, BaseException) else result[0]


def _run(lib: Any, calls: list[Call[Any]]) -> list[Any]:
    """Each call's result, or the error reply in its place: one call alone on the library's
    own connection (what a lone producer's every publish is), several in one pipeline. A
    connection error (and a wait that fell short, with durability) raises."""
    if len(calls) == 1:
        try:
            return [lib.run(calls[0])]
        except ResponseError as error:
            return [error]
    results: list[Any] = lib.run_many(calls, raise_on_error=False)
    return results


def server_of(client: Any) -> Hashable:
    """Which server ``client`` talks to, as far as riding together goes: the address, database
    and user of a standalone server; a Sentinel service and its sentinels; a cluster client
    itself (its own threads ride together)."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return ("client", id(client))
    kwargs = pool.connection_kwargs
    identity = (kwargs.get("db", 0), kwargs.get("username"))
    manager = getattr(pool, "sentinel_manager", None)
    if manager is not None:
        addresses = (s.connection_pool.connection_kwargs for s in manager.sentinels)
        sentinels = tuple(sorted((a.get("host"), a.get("port")) for a in addresses))
        return ("sentinel", pool.service_name, sentinels, *identity)
    return ("server", kwargs.get("host"), kwargs.get("port"), kwargs.get("path"), *identity)


_GROUPS: dict[Hashable, GroupCommit] = {}
_GROUPS_LOCK = threading.Lock()
# Each library's group, found once: its key (the server, the keyspace and the policy, hashed
# field by field) is not worth working out again on every publish.
_OF_LIBRARY: weakref.WeakKeyDictionary[Any, GroupCommit] = weakref.WeakKeyDictionary()


def group_for(lib: Any) -> GroupCommit:
    """The process's group commit for ``lib``'s server, keyspace and policy."""
    group = _OF_LIBRARY.get(lib)
    if group is None:
        key = (server_of(lib.client), lib.keys, lib.policy)
        with _GROUPS_LOCK:
            group = _GROUPS.setdefault(key, GroupCommit())
        _OF_LIBRARY[lib] = group
    return group


def publish_confirmed(lib: Any, queue: str, message: Outgoing, *, grouped: bool = True) -> Published:
    """Store ``message`` in ``queue``: with the process's other publishes in flight to the
    same server (``grouped``), or in a call of its own."""
    if grouped:
        return group_for(lib).publish(lib, queue, message)
    published: Published = lib.run(message.call(lib.keys, lib.policy, queue))
    return published


def _forget_in_child() -> None:
    """A forked child (a prefork worker) starts with no group: a parent's leader, its lock
    and its waiting callers are not the child's."""
    global _GROUPS_LOCK
    _GROUPS.clear()
    _OF_LIBRARY.clear()
    _GROUPS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
