"""A blocking wait on its own connection: the one kind of command a consumer sends outside
redis-py's client (Lua cannot block), without waiting for the reply, so that an event loop
can watch its socket; a batch of calls can go out on it the same way (:meth:`BlockingRead.send_batch`).

``cancel()`` ends a wait at once with CLIENT UNBLOCK from another connection, so shutting
down never waits out ``blocking_timeout``; where that is refused (it is in ``@admin``; some
managed services lack it) the connection is closed instead: a BLPOP that had just popped
loses a wake token, never a message (the other consumers then wait out one
``blocking_timeout`` at most). It knows nothing of kombu: the kombu adapter's poller
(kombu/poller.py) runs the rounds made of these waits.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import redis

from .connections import bound_connection, bounded_client, dedicated_connection, read_replies
from .fence import RETRY_SECONDS, refusal
from .runner import REDIRECTED

logger = logging.getLogger(__name__)

# How long a wait CLIENT UNBLOCK did not find (it answered 0) may take to reply before it is closed.
UNBLOCK_GRACE_SECONDS = 0.5


class BlockingRead:
    """One dedicated connection for blocking waits, made with ``pool``'s settings but kept
    outside it: a wait holds its connection for up to ``blocking_timeout``, and counted in the
    pool, a few channels' waits would leave too few connections for the acks of many
    greenlets or threads."""

    def __init__(self, pool: redis.ConnectionPool | Callable[[], redis.ConnectionPool], *,
                 on_redirect: Callable[[], None] = lambda: None,
                 on_lost: Callable[[Any], None] = lambda batch: None) -> None:
        # On a cluster, the pool of the node that owns the wait's slot, asked again at every
        # reconnect (a failover or a slot migration moves it).
        self._pool_of = pool if callable(pool) else (lambda: pool)
        self._on_redirect = on_redirect  # the slot moved (MOVED, ASK...): refresh the slot map
        # A pending batch's replies will never be read: its owner settles what it carried.
        self._on_lost = on_lost
        self.connection: Any = None
        self.pending: tuple[Any, ...] | None = None  # the command waiting for its reply
        self.batch: Any = None  # what a pending batch (send_batch) stands for, its owner's
        self._replies = 0  # how many replies the pending batch has
        self.sent_at = 0.0
        self.timeout = 0.0
        # When the owner acts on its own while the block goes on (monotonic; None: at its
        # reply): the server checks a block's timeout only every 1/hz (100 ms by default),
        # too coarse for a rate's next token (:attr:`block_due`).
        self.due: float | None = None
        self._client_id: int | None = None
        self.can_unblock = True  # until the server refuses CLIENT ID or CLIENT UNBLOCK
        self._deadline: float | None = None  # a close's (monotonic): see bound()
        self.refused_until = -math.inf  # a fenced primary refused this slot: left alone until then

    def _connect(self) -> Any:
        if self.connection is None or self.connection._sock is None:
            self.connection = dedicated_connection(self._pool_of())
            self.connection.connect()
            self._client_id = None
        return self.connection

    def refuse(self, queues: list[str], error: Exception) -> None:
        """A fenced primary refused this wait's slot (its consume, its BLPOP, its sweep): the
        slot is left alone for RETRY_SECONDS, the fence's longest pause; logged when this
        starts a refusal (none in the RETRY_SECONDS before the last one ended)."""
        now = time.monotonic()
        if now > self.refused_until + RETRY_SECONDS:
            logger.warning("celery-redis-lua: the primary of %s refuses writes (%s); its queues are asked "
                           "again every %.0f s, the other primaries' go on", ", ".join(queues), error,
                           RETRY_SECONDS)
        self.refused_until = now + RETRY_SECONDS

    @property
    def refused(self) -> bool:
        return time.monotonic() < self.refused_until

    def fileno(self) -> int | None:
        sock = getattr(self.connection, "_sock", None)
        return sock.fileno() if sock is not None else None

    def send(self, *command: Any, timeout: float) -> None:
        """Send a blocking command whose server-side timeout is ``timeout`` seconds."""
        connection = self._connect()
        if self._client_id is None and self.can_unblock:
            connection.send_command("CLIENT", "ID")
            try:
                self._client_id = int(connection.read_response())
            except redis.ResponseError:  # not allowed (ACL): cancel() closes the connection
                self.can_unblock = False
        connection.send_command(*command)
        self.pending, self.due = command, None
        self.sent_at = time.monotonic()
        self.timeout = timeout

    @property
    def block_due(self) -> float | None:
        """``due`` while the block it was set for is pending (a reply or a batch ends it)."""
        return self.due if self.pending is not None and self.batch is None else None

    def send_batch(self, wire: Callable[[Any], bytes], replies: int, batch: Any, *, timeout: float) -> None:
        """Write the ``replies`` commands ``wire(connection)`` packs without waiting for their
        replies (:meth:`read_batch` reads them). ``batch`` is the owner's record of what was
        sent; a write that fails hands it to ``on_lost`` before the error is raised."""
        try:
            connection = self._connect()
            connection.send_packed_command([wire(connection)], check_health=False)
        except BaseException:
            self.batch = batch
            self.disconnect()
            raise
        self.pending, self.batch, self._replies = ("batch",), batch, replies
        self.sent_at = time.monotonic()
        self.timeout = timeout

    def read_batch(self) -> tuple[list[Any], Any]:
        """The pending batch's replies (an error reply in its place, :func:`read_replies`)
        and its record. A read that fails disconnects, which hands the record to ``on_lost``."""
        batch, replies = self.batch, self._replies
        try:
            return read_replies(self.connection, replies), batch
        except BaseException:
            self.disconnect()
            raise
        finally:
            self.pending, self.batch = None, None

    def overdue(self, grace: float) -> bool:
        """The server should have answered by now (a half-open socket never says so); a block
        without timeout (blocking_timeout 0) never is."""
        return (self.pending is not None and self.timeout > 0
                and time.monotonic() - self.sent_at > self.timeout + grace)

    def read(self, timeout: float | None = None) -> Any:
        """The reply of the pending command (None when it timed out on the server). A wait
        the server ended with an UNBLOCKED error (its role changed: a primary demoted by a
        failover) is a lost connection: kombu reconnects, and finds the new primary. A fenced
        primary's refusal of the BLPOP is raised as NoReplicasError (call.py)."""
        try:
            if timeout is not None:
                return self.connection.read_response(timeout=timeout)
            return self.connection.read_response()
        except REDIRECTED:
            # A node that no longer (or not yet) serves the slot: nothing was popped.
            self.disconnect()
            self._on_redirect()
            return None
        except redis.ResponseError as error:
            if not str(error).startswith("UNBLOCKED"):
                raise refusal(error) from None  # BLPOP may write: a fenced primary refuses it
            self.disconnect()
            raise redis.ConnectionError(f"the server ended a blocking wait: {error}") from None
        finally:
            self.pending = None

    def bound(self, deadline: float) -> None:
        """A close (the connection goes next): every socket operation of the wait, and of
        the CLIENT UNBLOCK that cancels it, gives up by ``deadline`` (monotonic), so a
        broker that hangs without a reset cannot hang the close."""
        self._deadline = deadline
        if self.connection is not None:
            bound_connection(self.connection, deadline - time.monotonic())

    def cancel(self) -> Any:
        """End a pending wait now; returns whatever the server had already popped (or None).
        CLIENT UNBLOCK goes to the wait's own server (on a cluster, the node of its slot).
        Without CLIENT UNBLOCK the connection is closed (see the module's docstring)."""
        if self.pending is None or self.batch is not None:  # a batch: its owner reads it
            return None
        if self._client_id is None or not self.can_unblock:
            self.disconnect()
            return None
        pool = self._pool_of()
        client = redis.Redis(connection_pool=pool) if self._deadline is None else \
            bounded_client(pool, self._deadline - time.monotonic())
        try:
            unblocked = client.execute_command("CLIENT", "UNBLOCK", self._client_id)
        except redis.ResponseError:  # NOPERM, or a service without it: close from now on
            self.can_unblock = False
            self.disconnect()
            return None
        except (redis.RedisError, OSError):
            self.disconnect()
            return None
        finally:
            if self._deadline is not None:  # its own pool: nobody else will close it
                client.connection_pool.disconnect()
        try:
            # 0: the wait had just ended (its reply is on the way), or the server does not
            # know the id (a proxy in front of several servers): do not wait out its block.
            return self.read(None if unblocked else UNBLOCK_GRACE_SECONDS)
        except (redis.RedisError, OSError):
            self.disconnect()
            return None

    def disconnect(self) -> None:
        self.pending = None
        lost, self.batch = self.batch, None
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.disconnect()
        if lost is not None:
            self._on_lost(lost)

    def close(self) -> None:
        if self.connection is not None:
            self.disconnect()
            self.connection = None
