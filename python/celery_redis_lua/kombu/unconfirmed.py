"""Unconfirmed publishes (the ``confirm_publish=False`` option): many per round trip.

By default a publish returns once the broker has stored the message (one round trip each).
With ``confirm_publish=False`` it returns once the message is in the channel's pipeline;
the pipeline goes to the server in one write when it holds ``publish_pipeline`` publishes,
when its oldest has waited ``publish_flush_delay`` seconds (a daemon thread sends it), before
the channel reads queue state or consumes, and when the channel closes.

A batch's replies are read when the next batch goes (on a standalone server or a Sentinel
primary without durability: the server stores one batch while the caller fills the next),
or ``publish_flush_delay`` after it went; elsewhere when it goes. NOSCRIPT is recovered
there (the runner loads the script and sends only the calls that met it: they never ran).
A publish the server refused (out of memory, a key of the wrong type, a script refusing
its input) is kept and raised as :class:`UnconfirmedPublishError` by the first publish on
the channel after its reply was read, by a call that reads queue state, or by the close:
never dropped silently. A publish refused because its cached route went stale (a
bind or unbind since) stored nothing and is published again, synchronously, with a fresh
lookup, by the next publish or the close (in the caller's thread, not the sender's).

What a crash can lose: the publishes still in the pipeline (at most ``publish_pipeline``,
or ``publish_flush_delay`` seconds' worth); a lost connection also loses those on the wire
whose replies were not read (at most two batches; they may or may not be stored: kombu
does not retry them).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..protocol.ops import StaleRoute
from ..protocol.runner import Call

logger = logging.getLogger(__name__)


class UnconfirmedPublishError(Exception):
    """Publishes that went out unconfirmed and that the server refused."""

    def __init__(self, errors: list[tuple[str, BaseException]]) -> None:
        queues = sorted({queue for queue, _ in errors})
        first = errors[0][1]
        super().__init__(f"{len(errors)} unconfirmed publish(es) to {', '.join(map(repr, queues))} were "
                         f"refused by the server; the first: {type(first).__name__}: {first}")
        self.errors = errors


@dataclass
class Send:
    """One basic_publish: what it needs to go again, and the queues that stored it."""

    message: dict[str, Any]
    exchange: str
    routing_key: str
    kwargs: dict[str, Any]
    stored: set[str] = field(default_factory=set)


class Pipeline:
    """A channel's unconfirmed publishes, gathered and sent in one write.

    On a standalone server (or a Sentinel primary) without durability, a batch's replies
    are read when the next batch is written (runner.BatchWriter, a connection of the
    pipeline's own), so the server stores one batch while the caller fills the next; the
    sender thread reads the last one's replies ``delay`` after it went. Elsewhere (a
    cluster routes every call by slot; durability ends each batch with a wait) each batch
    is one pipeline whose replies are read at once."""

    def __init__(self, lib: Any, size: int, delay: float) -> None:
        self.lib, self.size, self.delay = lib, size, delay
        self._lock = threading.Lock()  # the pending list and the results, between two threads
        self._wire = threading.Lock()  # one batch written at a time: in order, replies in order
        self._writer = lib.runner.batch_writer()
        self._calls: list[tuple[Send | None, str, Call[Any]]] = []
        self._on_wire: list[tuple[Send | None, str, Call[Any]]] = []  # written, replies unread
        self._oldest = 0.0
        self._written_at = 0.0
        self.refused: list[tuple[str, BaseException]] = []
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
        elif first:  # the sender wakes once per batch, not once per publish
            SENDER.watch(self)

    def due(self) -> float | None:
        """When the sender must act (monotonic): the oldest pending publish's deadline, or
        the deadline for the replies of the batch on the wire; None if neither."""
        with self._lock:
            if self._calls:
                return self._oldest + self.delay
        return self._written_at + self.delay if self._on_wire else None

    def push(self) -> None:
        """Write what is pending. With a batch writer, read the replies of the batch before
        it; else read its own. A lost connection is raised as it is: the calls whose replies
        were not read are lost with it (they may or may not be stored)."""
        with self._wire:
            with self._lock:
                calls, self._calls = self._calls, []
            if not calls:
                return
            if self._writer is None:
                self._settle(calls, lambda: self.lib.run_many([c for _, _, c in calls], raise_on_error=False))
                return
            previous, self._on_wire = self._on_wire, []
            self._written_at = time.monotonic()
            self._settle(previous + calls, lambda: self._writer.send([c for _, _, c in calls]),
                         settled=previous)
            self._on_wire = calls

    def flush(self) -> None:
        """Write what is pending and read every reply."""
        self.push()
        with self._wire:
            if self._on_wire:
                previous, self._on_wire = self._on_wire, []
                self._settle(previous, self._writer.finish)

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
                self.refused.extend((queue, error) for _, queue, _ in calls)
            raise
        with self._lock:
            for (send, queue, _), result in zip(calls if settled is None else settled, results, strict=True):
                if isinstance(result, StaleRoute) and send is not None:
                    if not self.stale or self.stale[-1] is not send:
                        self.stale.append(send)
                elif isinstance(result, BaseException):
                    self.refused.append((queue, result))
                elif send is not None:
                    send.stored.add(queue)

    def take_stale(self) -> list[Send]:
        with self._lock:
            stale, self.stale = self.stale, []
        return stale

    def check(self) -> None:
        """Raise what the server refused since the last check."""
        with self._lock:
            refused, self.refused = self.refused, []
        if refused:
            raise UnconfirmedPublishError(refused)


class Sender:
    """One daemon thread per process: sends every pipeline whose oldest publish is due."""

    def __init__(self) -> None:
        self._pipelines: weakref.WeakSet[Pipeline] = weakref.WeakSet()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, pipeline: Pipeline) -> None:
        with self._wake:
            self._pipelines.add(pipeline)
            if self._thread is None or not self._thread.is_alive():
                if self._thread is None:
                    atexit.register(self.flush_all)
                self._thread = threading.Thread(target=self._run, name="crl-unconfirmed", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                dues = [(due, p) for p in list(self._pipelines) if (due := p.due()) is not None]
                if not dues:
                    self._wake.wait()
                    continue
                due, pipeline = min(dues, key=lambda pair: pair[0])
                wait = due - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
            try:
                pipeline.flush()
            except Exception as error:  # a lost connection: the owner's next call meets it too
                logger.warning("celery-redis-lua: unconfirmed publishes could not be sent (%s)", error)

    def forked(self) -> None:
        """In a forked child: the parent's thread does not run here (watch starts one), and
        the parent's publishes are forgotten."""
        self._wake = threading.Condition()
        for pipeline in list(self._pipelines):
            pipeline.forked()

    def flush_all(self) -> None:
        """At exit: what is still pending goes (a process that never closed its channel)."""
        for pipeline in list(self._pipelines):
            try:
                pipeline.flush()
            except Exception as error:
                logger.warning("celery-redis-lua: unconfirmed publishes lost at exit (%s)", error)


SENDER = Sender()
os.register_at_fork(after_in_child=SENDER.forked)
