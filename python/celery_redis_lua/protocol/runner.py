"""Running scripts: EVALSHA with NOSCRIPT recovery, alone or in pipelines.

Scripts are a cache on the server, not state: a restart, a failover or SCRIPT FLUSH
empties it. Every path that runs a script (single call or pipeline, standalone or
cluster) loads the script and retries once when the server answers NOSCRIPT; a call that
met NOSCRIPT never ran, so nothing takes effect twice.

With a :class:`~.durability.Durability`, a call of a script whose writes must survive a
failover (publish, ack, ...) goes in a pipeline followed by the wait command, on one
connection, and :class:`~.durability.NotDurable` is raised when the wait falls short.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)

from .call import ERROR_PREFIX, Call, ScriptError, decode_replies, to_script_error
from .connections import (
    HeldConnection,
    bound_connection,
    bounded_client,
    dedicated_connection,
    packed,
    read_replies,
)
from .contract import Script, load_scripts
from .durability import CONFIRMED_SCRIPTS, RAISE_WHEN_SHORT, Durability

# A durable call on a cluster that met a slot move (MOVED, ASK, TRYAGAIN: it never ran) is
# sent again after the slot map is refreshed, this many times, this far apart.
REDIRECT_ATTEMPTS = 20
REDIRECT_PAUSE_SECONDS = 0.05
REDIRECTED = (MovedError, AskError, TryAgainError, ClusterDownError)
logger = logging.getLogger(__name__)
T = TypeVar("T")
# Call, ScriptError and ERROR_PREFIX are defined in call.py; the kombu adapter and the CLI
# import them from here.
__all__ = ["ERROR_PREFIX", "REDIRECTED", "BatchWriter", "Call", "ScriptError", "ScriptRunner"]


class BatchWriter:
    """Batches of calls written on a connection of their own, each batch's replies read once
    the next batch is on the wire (or at :meth:`finish`): the server runs one batch while
    the client prepares the next, instead of the client waiting on every batch's replies.
    For one thread at a time (the caller locks); standalone servers and Sentinel primaries.

    A reply is never read as another call's: a lost connection, a timeout or a signal while
    replies are pending disconnects it, and raises; the calls of both batches then may or
    may not have run (nothing is sent again). A forked child never reads its parent's."""

    def __init__(self, runner: ScriptRunner) -> None:
        self.runner = runner
        self._connection: Any = None
        self._pending: Sequence[Call[Any]] = ()  # written, replies unread
        self._pid = os.getpid()

    def send(self, calls: Sequence[Call[Any]], timeout: float | None = None) -> list[Any]:
        """Write ``calls``; return the results of the batch written before them (see
        :meth:`ScriptRunner.run_many` with ``raise_on_error=False``), or [] if none. With a
        ``timeout`` see :meth:`_ready`."""
        connection = self._ready(timeout)
        previous, self._pending = self._pending, calls
        try:
            # No health check: its PING would read a reply of the batch on the wire as PONG.
            connection.send_packed_command([self.runner.wire(connection, calls)], check_health=False)
            return self._results(previous)
        except BaseException:
            self._lose()
            raise

    def finish(self, timeout: float | None = None) -> list[Any]:
        """The results of the batch on the wire ([] if none). With a ``timeout`` see :meth:`_ready`."""
        self._ready(timeout)
        previous, self._pending = self._pending, ()
        try:
            return self._results(previous)
        except BaseException:
            self._lose()
            raise

    def close(self) -> None:
        if self._connection is not None and self._pid == os.getpid():
            self._connection.disconnect()
        self._connection, self._pending = None, ()

    def _ready(self, timeout: float | None = None) -> Any:
        """The connection, connected; with a ``timeout`` (what is left of a close's or the
        exit's budget) bounded from now on (:func:`bound_connection`; the writer is closed
        next, nothing restores the connection's own setting)."""
        if self._pid != os.getpid():  # forked: the parent's socket and replies are not ours
            self._connection, self._pending, self._pid = None, (), os.getpid()
        if self._connection is None:
            self._connection = dedicated_connection(self.runner.client.connection_pool)
        if timeout is not None:
            bound_connection(self._connection, timeout)
        self._connection.connect()  # as HeldConnection: Sentinel finds the primary here
        return self._connection

    def _lose(self) -> None:
        """Whatever interrupted a write or a read (anything at all, between any two steps):
        the replies still due are not read from this connection by anyone."""
        self._connection.disconnect()
        self._pending = ()

    def _results(self, calls: Sequence[Call[Any]]) -> list[Any]:
        replies = read_replies(self._connection, len(calls))
        return self.runner.rerun_noscript(calls, replies, raise_on_error=False) if calls else []


class ScriptRunner:
    """Runs :class:`Call` objects on a redis-py client (standalone or cluster). With
    ``hold_connection`` (a standalone or Sentinel client), single calls go over a
    :class:`HeldConnection`; pipelines and transactions through the client's pool."""

    def __init__(self, client: Any, scripts: dict[str, Script] | None = None, *,
                 durability: Durability | None = None, hold_connection: bool = False) -> None:
        self.client = client
        self.scripts = scripts if scripts is not None else load_scripts()
        self.durability = durability
        pool = getattr(client, "connection_pool", None)
        self.held = HeldConnection(pool) if hold_connection and pool is not None else None

    @property
    def batches_in_one_write(self) -> bool:
        """Whether a batch of calls goes as one write on one connection with nothing to wait
        for: a standalone server or a Sentinel primary without durability (a cluster routes
        each call to its slot's node, a durability wait must end each batch)."""
        return getattr(self.client, "connection_pool", None) is not None and self.durability is None

    def batch_writer(self) -> BatchWriter | None:
        """A writer whose batches' replies are read one batch later (see
        :attr:`batches_in_one_write`); None where batches are not one write."""
        return BatchWriter(self) if self.batches_in_one_write else None

    def close(self) -> None:
        """Disconnect the held connection (the client and its pool are the caller's)."""
        if self.held is not None:
            self.held.close()

    def load(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """SCRIPT LOAD the named scripts (default: all); returns name -> SHA1."""
        loaded = {}
        for name in names if names is not None else sorted(self.scripts):
            loaded[name] = self.client.script_load(self.scripts[name].source)
        return loaded

    def run(self, call: Call[T]) -> T:
        if self.durability is not None and call.script in CONFIRMED_SCRIPTS:
            result: T = self.run_many([call])[0]  # the call and its wait share one connection
            return result
        script = self.scripts[call.script]
        try:
            reply = self._execute_one(*self._evalsha_command(call))
        except NoScriptError:
            self._execute_one("SCRIPT", "LOAD", script.source)
            try:
                reply = self._execute_one(*self._evalsha_command(call))
            except ResponseError as error:
                raise to_script_error(call.script, error) from None
        except ResponseError as error:
            raise to_script_error(call.script, error) from None
        return call.decode(reply)

    def run_many(self, calls: Sequence[Call[Any]], *, raise_on_error: bool = True,
                 timeout: float | None = None) -> list[Any]:
        """Run ``calls`` in one pipeline; calls that met NOSCRIPT are loaded and re-run.

        Only the calls that failed with NOSCRIPT run again (the server did not run
        them), so no call takes effect twice. With ``raise_on_error=False`` the
        result list holds the exception in place of a failed call's reply (an error reply,
        or what its ``decode`` raised: publish's StaleRoute). With a
        durability setting and a confirmed script among ``calls``, the pipeline ends with
        one wait; a wait that falls short raises NotDurable (its ``results`` attribute holds
        what the calls returned) when a publish is among them, else it is logged. With a
        ``timeout`` (seconds) they go over connections of their own (:func:`bounded_client`)
        and every socket operation gives up after that long.
        """
        if not calls:
            return []
        if timeout is not None:
            return self._run_bounded(calls, raise_on_error, timeout)
        wait = self._wait_for(calls)
        replies, waited = self._pipeline(calls, wait)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            self.load(sorted({calls[i].script for i in missing}))
            again, waited_again = self._pipeline([calls[i] for i in missing], self._wait_for(
                [calls[i] for i in missing]))
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
            waited = waited_again if waited_again is not None else waited
        results = decode_replies(calls, replies, raise_on_error)
        if wait is not None:
            self._check_wait(calls, waited, results)
        return results

    def _run_bounded(self, calls: Sequence[Call[Any]], raise_on_error: bool, timeout: float) -> list[Any]:
        """``run_many`` on bounded clients: one, or on a cluster one per node owning the calls'
        slots (each given what is left of ``timeout``); NOSCRIPT and durability as usual."""
        if not hasattr(self.client, "get_node_from_key"):
            groups = {None: list(range(len(calls)))}
        else:
            groups = {}
            for i, call in enumerate(calls):
                groups.setdefault(self.client.get_node_from_key(call.keys[0]).name, []).append(i)
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * len(calls)
        for name, indexes in groups.items():
            node = self.client if name is None else self.client.get_redis_connection(
                self.client.get_node(node_name=name))
            client = bounded_client(node.connection_pool, deadline - time.monotonic())
            try:
                runner = ScriptRunner(client, self.scripts, durability=self.durability)
                got = runner.run_many([calls[i] for i in indexes], raise_on_error=raise_on_error)
            finally:
                client.connection_pool.disconnect()
            for i, result in zip(indexes, got, strict=True):
                results[i] = result
        return results

    def rerun_noscript(self, calls: Sequence[Call[Any]], replies: list[Any], *,
                       raise_on_error: bool) -> list[Any]:
        """The results of ``calls`` from replies read elsewhere (BatchWriter): the calls that
        met NOSCRIPT (they never ran) are loaded and run again, in one pipeline."""
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        again = dict(zip(missing, self.run_many([calls[i] for i in missing], raise_on_error=raise_on_error),
                         strict=True)) if missing else {}
        return [again[i] if i in again else decode_replies([call], [reply], raise_on_error)[0]
                for i, (call, reply) in enumerate(zip(calls, replies, strict=True))]

    def run_transaction(self, calls: Sequence[Call[Any]]) -> list[Any]:
        """Run ``calls`` in one MULTI (their keys in one slot): another client sees all of them
        or none. The scripts are loaded first; a call the server refuses (NOSCRIPT after a
        failover, a bad argument, out of memory) does not undo the others, so its place in
        the result list holds the error and the caller compensates. No durability wait.
        """
        self.load(sorted({call.script for call in calls}))
        pipe = self.client.pipeline(transaction=True)
        for call in calls:
            self._evalsha(pipe, call)
        return decode_replies(calls, list(pipe.execute(raise_on_error=False)), raise_on_error=False)

    def _wait_for(self, calls: Sequence[Call[Any]]) -> Durability | None:
        if self.durability is not None and any(c.script in CONFIRMED_SCRIPTS for c in calls):
            return self.durability
        return None

    def _check_wait(self, calls: Sequence[Call[Any]], reply: Any, results: list[Any]) -> None:
        assert self.durability is not None
        if isinstance(reply, Exception):
            raise reply
        if self.durability.confirmed(reply):
            return
        error = self.durability.not_durable(
            [c.script for c in calls if c.script in CONFIRMED_SCRIPTS], reply, results)
        if any(c.script in RAISE_WHEN_SHORT for c in calls):
            raise error
        logger.warning("celery-redis-lua: %s", error)


    def _pipeline(self, calls: Sequence[Call[Any]],
                  wait: Durability | None = None) -> tuple[list[Any], Any]:
        """The replies of ``calls`` in one pipeline, and of the wait that ends it (or None)."""
        if wait is not None and hasattr(self.client, "get_node_from_key"):
            return self._pipeline_per_node(calls, wait)
        if self.held is not None:
            commands = [self._evalsha_command(call) for call in calls]
            replies = self.held.execute_many(self.client, [*commands, wait.command()] if wait else commands)
        else:
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                self._evalsha(pipe, call)
            if wait is not None:
                pipe.execute_command(*wait.command())
            replies = list(pipe.execute(raise_on_error=False))
        return (replies[:-1], replies[-1]) if wait is not None else (replies, None)

    def _pipeline_per_node(self, calls: Sequence[Call[Any]], wait: Durability) -> tuple[list[Any], Any]:
        """On a cluster, a wait counts the replicas of the node it runs on: the calls go in
        one pipeline per primary owning their slots, each ended by the wait, on that node's
        own connection. The reply that stands for the wait is the least durable one. A call
        the node redirected (the slot moved or is moving: it never ran) goes again once the
        slot map is refreshed; still redirected after REDIRECT_ATTEMPTS, it fails as a
        cluster error, which the transport treats as a lost connection (kombu retries it)."""
        replies: list[Any] = [None] * len(calls)
        waits: list[Any] = []
        todo = list(range(len(calls)))
        for _ in range(REDIRECT_ATTEMPTS):
            by_node: dict[str, list[int]] = {}
            for i in todo:
                by_node.setdefault(self.client.get_node_from_key(calls[i].keys[0]).name, []).append(i)
            todo = []
            for name, indexes in by_node.items():
                node = self.client.get_node(node_name=name)
                pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
                for i in indexes:
                    self._evalsha(pipe, calls[i])
                pipe.execute_command(*wait.command())
                *got, waited = pipe.execute(raise_on_error=False)
                ran = False
                for i, reply in zip(indexes, got, strict=True):
                    if isinstance(reply, REDIRECTED):
                        todo.append(i)
                    else:
                        replies[i], ran = reply, True
                if ran:
                    waits.append(waited)
            if not todo:
                return replies, wait.least(waits)
            self.client.nodes_manager.initialize()
            time.sleep(REDIRECT_PAUSE_SECONDS)  # a slot migration or a failover under way
        raise ClusterError(f"{sorted({calls[i].script for i in todo})}: the slot kept moving "
                           f"({REDIRECT_ATTEMPTS} redirections); nothing ran")

    def wire(self, connection: Any, calls: Sequence[Call[Any]]) -> bytes:
        """``calls`` as EVALSHAs in one write on ``connection``, for a caller that reads the
        replies itself (:func:`read_replies`) and gives them to :meth:`rerun_noscript`."""
        return b"".join(packed(connection, self._evalsha_command(call)) for call in calls)

    def _evalsha_command(self, call: Call[Any]) -> tuple[Any, ...]:
        return ("EVALSHA", self.scripts[call.script].sha1, len(call.keys), *call.keys, *call.args)

    def _execute_one(self, *command: Any) -> Any:
        """A single command of ``run``: over the held connection when there is one."""
        if self.held is None:
            return self.client.execute_command(*command)
        return self.held.execute(self.client, *command)

    def _evalsha(self, target: Any, call: Call[Any]) -> Any:
        # execute_command, not .evalsha(): redis-py's ClusterPipeline blocks the
        # evalsha method, while the raw command is routed by its first key.
        return target.execute_command(*self._evalsha_command(call))
