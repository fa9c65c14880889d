"""A connection that holds one blocking command (BZMPOP or XREAD) at a time.

These waits are the only commands Python sends to Redis directly (Lua cannot
block). The command is sent without waiting for the reply, so an event loop can
watch the socket; ``read()`` takes the reply once the socket is readable.
``cancel()`` ends a pending wait at once with CLIENT UNBLOCK from another
connection, so shutting down never waits out ``blocking_timeout``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis


class BlockingRead:
    """One dedicated connection from ``pool`` for blocking waits."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self.connection: Any = None
        self.pending: tuple[Any, ...] | None = None  # the command waiting for its reply
        self.sent_at = 0.0
        self.timeout = 0.0
        self._client_id: int | None = None

    def _connect(self) -> Any:
        if self.connection is None:
            self.connection = self.pool.get_connection()
            self._client_id = None
        if self.connection._sock is None:
            self.connection.connect()
            self._client_id = None
        return self.connection

    def fileno(self) -> int | None:
        sock = getattr(self.connection, "_sock", None)
        return sock.fileno() if sock is not None else None

    def send(self, *command: Any, timeout: float) -> None:
        """Send a blocking command whose server-side timeout is ``timeout`` seconds."""
        connection = self._connect()
        if self._client_id is None:
            connection.send_command("CLIENT", "ID")
            self._client_id = int(connection.read_response())
        connection.send_command(*command)
        self.pending = command
        self.sent_at = time.monotonic()
        self.timeout = timeout

    def overdue(self, grace: float) -> bool:
        """The server should have answered by now (a half-open socket never says so).
        A block without timeout (blocking_timeout 0) is never overdue."""
        return (self.pending is not None and self.timeout > 0
                and time.monotonic() - self.sent_at > self.timeout + grace)

    def read(self) -> Any:
        """The reply of the pending command (None when it timed out on the server)."""
        try:
            return self.connection.read_response()
        finally:
            self.pending = None

    def cancel(self, client: redis.Redis) -> Any:
        """End a pending wait now; returns whatever the server had already popped (or None)."""
        if self.pending is None or self._client_id is None:
            return None
        try:
            client.execute_command("CLIENT", "UNBLOCK", self._client_id)
            return self.read()
        except (redis.RedisError, OSError):
            self.disconnect()
            return None

    def disconnect(self) -> None:
        self.pending = None
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.disconnect()

    def close(self) -> None:
        if self.connection is not None:
            self.disconnect()
            with contextlib.suppress(Exception):
                self.pool.release(self.connection)
            self.connection = None
