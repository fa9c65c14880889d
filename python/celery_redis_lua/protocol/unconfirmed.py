"""Unconfirmed publishes (the transport's ``confirm_publish=False``): many per round trip.

Plain script calls on the runner, no kombu: a publish returns once its call is in the
pipeline, which goes in one write when it holds ``size`` calls or when its owner says (the
kombu channel's outbox, protocol/outbox.py: when the oldest has waited ``delay``, before the
channel reads queue state or consumes, at close and at exit). With a batch writer
(runner.BatchWriter: a standalone server or a Sentinel primary without durability) a
batch's replies are read when the next batch goes (the server stores one while the caller
fills the next) or ``delay`` after it went; elsewhere at once. NOSCRIPT is recovered there
(only the calls that met it are sent again).

A publish the server refused (out of memory, a wrong type, a script refusing its input) is
kept and raised as :class:`UnconfirmedPublishError` by :meth:`Pipeline.check` (the kombu
channel's next publish after its reply was read, a call that reads queue state, or the
close); one still unraised at exit is logged at ERROR with its queue, count and task ids
(:meth:`Pipeline.unsent`): never dropped silently. One refused for a stale cached route
stored nothing and goes again, with a fresh lookup (:meth:`Pipeline.take_stale`). A crash
loses what is still in the pipeline (``size`` calls or ``delay``'s worth); a lost
connection also the batches on the wire whose replies were unread (stored or not: kombu
does not retry them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .call import Call
from .ops import StaleRoute


class UnconfirmedPublishError(Exception):
    """Publishes that went out unconfirmed and that the server refused (or whose outcome a lost
    connection left unknown). ``errors``: (queue, error) of each; ``task_ids``: their task ids
    in the same order (None for a message without one)."""

    def __init__(self, errors: list[tuple[str, BaseException]],
                 task_ids: list[str | None] | None = None) -> None:
        queues = sorted({queue for queue, _ in errors})
        first = errors[0][1]
        super().__init__(f"{len(errors)} unconfirmed publish(es) to {', '.join(map(repr, queues))} were "
                         f"refused by the server; the first: {type(first).__name__}: {first}")
        self.errors = errors
        self.task_ids = task_ids if task_ids is not None else [None] * len(errors)


@dataclass
class Send:
    """One basic_publish: what it needs to go again, and the queues that stored it."""

    message: dict[str, Any]
    exchange: str
    routing_key: str
    kwargs: dict[str, Any]
    stored: set[str] = field(default_factory=set)


class Pipeline:
    """A channel's unconfirmed publishes, gathered and sent in one write (the module's
    docstring says when; a batch writer, runner.BatchWriter, is a connection of its own)."""

    def __init__(self, lib: Any, size: int, delay: float, on_due: Callable[[], None]) -> None:
        self.lib, self.size, self.delay = lib, size, delay
        self._on_due = on_due  # the outbox's: tell the keeper when a batch starts
        self._lock = threading.Lock()  # the pending list and the results, between two threads
        self._wire = threading.Lock()  # one batch written at a time: in order, replies in order
        self._writer = lib.runner.batch_writer()
        self._calls: list[tuple[Send | None, str, Call[Any]]] = []
        self._on_wire: list[tuple[Send | None, str, Call[Any]]] = []  # written, replies unread
        self._oldest = 0.0
        self._written_at = 0.0
        self.refused: list[tuple[str, BaseException, str | None]] = []  # queue, error, task id
        self.stale: list[Send] = []

    def forked(self) -> None:
        """In a forked child: the parent's pending and on-the-wire publishes are the parent's
        to send and read (a child that sent them would store them twice)."""
        self._lock, self._wire = threading.Lock(), threading.Lock()
        self._calls, self._on_wire = [], []

    def add(self, send: Send | None, queue: str, call: Call[Any]) -> None:
        with self._lock:
            first = not self._calls
            if first:
                self._oldest = time.monotonic()
            self._calls.append((send, queue, call))
            full = len(self._calls) >= self.size
        if full:
            self.push()
        if first or full:  # the keeper wakes once per batch (to send it, or read its replies)
            self._on_due()

    def due(self) -> float | None:
        """When the keeper must send (the oldest pending publish's deadline) or read (the
        replies of the batch on the wire): monotonic, or None."""
        with self._lock:
            if self._calls:
                return self._oldest + self.delay
        return self._written_at + self.delay if self._on_wire else None

    def push(self, timeout: float | None = None) -> None:
        """Write what is pending. With a batch writer, read the replies of the batch before
        it; else read its own. A lost connection is raised as it is: the calls whose replies
        were not read are lost with it (they may or may not be stored). With a ``timeout``
        (a close's or the exit's budget) every socket operation gives up after that long."""
        with self._wire:
            with self._lock:
                calls, self._calls = self._calls, []
            if not calls:
                return
            if self._writer is None:
                self._settle(calls, lambda: self.lib.run_many([c for _, _, c in calls], raise_on_error=False,
                                                              timeout=timeout))
                return
            previous, self._on_wire = self._on_wire, []
            self._written_at = time.monotonic()
            self._settle(previous + calls, lambda: self._writer.send([c for _, _, c in calls], timeout),
                         settled=previous)
            self._on_wire = calls

    def flush(self, timeout: float | None = None) -> None:
        """Write what is pending and read every reply (``timeout``: see :meth:`push`)."""
        self.push(timeout)
        with self._wire:
            if self._on_wire:
                previous, self._on_wire = self._on_wire, []
                self._settle(previous, lambda: self._writer.finish(timeout))

    def close(self) -> None:
        """The batch writer's connection goes (after a flush)."""
        if self._writer is not None:
            with self._wire:
                self._writer.close()

    def _settle(self, calls: list[tuple[Send | None, str, Call[Any]]], read: Any,
                settled: list[tuple[Send | None, str, Call[Any]]] | None = None) -> None:
        """Record the results ``read()`` returns, for ``settled`` (default: ``calls``); when it
        raises (a lost connection), every one of ``calls`` is refused with that error."""
        try:
            results = read()
        except Exception as error:  # a lost connection: these may or may not be stored
            with self._lock:
                for send, queue, _ in calls:
                    self._refuse(send, queue, error)
            raise
        with self._lock:
            for (send, queue, _), result in zip(calls if settled is None else settled, results, strict=True):
                if isinstance(result, StaleRoute) and send is not None:
                    if not self.stale or self.stale[-1] is not send:
                        self.stale.append(send)
                elif isinstance(result, BaseException):
                    self._refuse(send, queue, result)
                elif send is not None:
                    send.stored.add(queue)

    def take_stale(self) -> list[Send]:
        with self._lock:
            stale, self.stale = self.stale, []
        return stale

    def _refuse(self, send: Send | None, queue: str, error: BaseException) -> None:
        headers = send.message.get("headers") if send is not None else None  # (lock held)
        self.refused.append((queue, error, headers.get("id") if isinstance(headers, dict) else None))

    def check(self) -> None:
        """Raise what the server refused since the last check."""
        with self._lock:
            refused, self.refused = self.refused, []
        if refused:
            raise UnconfirmedPublishError([(queue, error) for queue, error, _ in refused],
                                          [task_id for _, _, task_id in refused])

    def unsent(self) -> list[str]:
        """What was refused and never raised, or never sent, by queue (the exit's report)."""
        with self._lock:
            refused, pending = list(self.refused), [queue for _, queue, _ in self._calls]
        lines = []
        for queue in dict.fromkeys(q for q, _, _ in refused):
            mine = [(error, task_id or "-") for q, error, task_id in refused if q == queue]
            first = mine[0][0]
            lines.append(f"{len(mine)} unconfirmed publish(es) to {queue!r} refused by the server or lost "
                         f"({type(first).__name__}: {first}); task ids: {', '.join(i for _, i in mine)}")
        return lines + [f"{pending.count(q)} unconfirmed publish(es) to {q!r} never sent"
                        for q in dict.fromkeys(pending)]
