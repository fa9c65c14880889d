"""Giving up a connection whose peer stopped answering: a network partition, a host gone.

With no socket timeout (redis-py's default, and kombu's), a call whose request or reply is
lost in a partition waits for TCP's next retransmission after the heal, and TCP backs its
retransmissions off exponentially: a worker's first consume came 5-10 s after a 20-30 s cut
healed (docs/faults.md). A socket timeout gives such a call up, but it gives up just as well
on a call a slow server is still working on (an fsync, a fork, a long sweep), and a long
blocking wait needs one of its own. TCP keepalive with ``TCP_USER_TIMEOUT`` tells the two
apart: the server's kernel acknowledges a probe, and a request, while the server is busy or
even stopped, and nothing acknowledges across a partition. So the kernel closes a connection
that has had nothing acknowledged for ``partition_timeout`` seconds (the call raises a
connection error: kombu reconnects, as after any lost connection), and a connection to a
live server costs one probe and its acknowledgement, in the kernels only, every
``partition_timeout / 2`` seconds while idle.

Once the connection is given up, how soon the worker is back after the heal is its
reconnect's business: Celery's worker retries a lost connection after 2, 4, 6, 8 ... seconds
(kombu's ``ensure_connection`` defaults, which Celery has no setting for), so a partition
that healed during one of those sleeps was noticed only at its end (9.2 s after the heal in
chaos seed 1004). :func:`ride_out` tries the connect again every RETRY_SECONDS for up to
``reconnect_window`` seconds (an option, 10 by default; a warm shutdown asked meanwhile
waits that long) itself, for a broker this process has reached before (a first connect, a
CLI's, still fails at once), before the error goes to kombu's backoff. A producer's retries
ride it too (Celery's default publish retry policy waits about 40 s for a broker that is
down instead of under one): 0 turns it off.

On a cluster the connection outlives one primary: while a dead or cut-off primary's replica
is not yet promoted, its slots have no owner and the other nodes answer. kombu's retry then
reconnects at once and sends again at once, so a caller's retries (Celery's default publish
policy: 3) were spent in milliseconds and ``apply_async`` raised (chaos seed 1013).
:func:`ride_out_failover` sends such a call again every RETRY_SECONDS for up to the same
``reconnect_window``.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis

if TYPE_CHECKING:
    from .options import TransportOptions

# How often a reconnect to a broker reached before is tried again (for reconnect_window seconds).
RETRY_SECONDS = 0.25
# Errors of a broker that cannot be reached now; a refused login is not one of them, nor a
# server certificate that fails verification (no wait makes either succeed; redis-py reports
# the second as a ConnectionError caused by it).
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.RedisClusterException, OSError)
REFUSED = (redis.AuthenticationError, redis.exceptions.AuthorizationError, ssl.SSLCertVerificationError)
# Errors of a cluster call whose slot has no primary in reach (a failover under way).
UNOWNED = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
           redis.exceptions.SlotNotCoveredError)
T = TypeVar("T")
_reached: set[str] = set()  # the brokers (URLs) this process has connected to

# Linux's names; a platform without TCP_USER_TIMEOUT (macOS) keeps TCP's own timeouts.
_NAMES = ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT")


def keepalive_options(partition_timeout: float) -> dict[int, int] | None:
    """redis-py's ``socket_keepalive_options`` (IPPROTO_TCP options) that close a connection
    after ``partition_timeout`` seconds with nothing acknowledged; None where the platform
    lacks them. Probes start after half of it idle, one a second: at least one is out when it
    ends, which Linux requires before it closes an idle connection for its user timeout."""
    if not all(hasattr(socket, name) for name in _NAMES):
        return None
    seconds = max(2, round(partition_timeout))
    idle, interval, count, user_timeout = (getattr(socket, name) for name in _NAMES)
    return {idle: seconds // 2, interval: 1, count: seconds,
            user_timeout: max(1000, round(partition_timeout * 1000))}


def socket_params(settings: TransportOptions) -> dict[str, Any]:
    """The keepalive settings redis-py connects with: the user's own ``socket_keepalive`` and
    ``socket_keepalive_options`` when set (``socket_keepalive=False`` turns the detection
    off), else the partition detector of ``partition_timeout``."""
    keepalive, options = settings.socket_keepalive, settings.socket_keepalive_options
    partition_timeout = settings.partition_timeout
    if keepalive is False or options is not None or partition_timeout is None:
        return {"socket_keepalive": keepalive, "socket_keepalive_options": options}
    detector = keepalive_options(partition_timeout)
    if detector is None:
        return {"socket_keepalive": keepalive, "socket_keepalive_options": None}
    return {"socket_keepalive": True, "socket_keepalive_options": detector}


def refused(error: BaseException) -> bool:
    """A refused login or a certificate that fails verification: no wait makes it succeed.
    redis-py reports either as an error caused by it (a cluster client's RedisClusterException
    while it reads the slot map, a connection's ConnectionError)."""
    return isinstance(error, REFUSED) or isinstance(error.__cause__, REFUSED)


def ride_out(connect: Callable[[], T], broker: str, window: float) -> T:
    """``connect()``; where it cannot reach ``broker`` and this process has reached it before
    (a partition, a restart, a failover under way), it is tried again every RETRY_SECONDS for
    up to ``window`` seconds before the error is raised."""
    connected = _again_while(connect, UNREACHABLE, window if broker in _reached else 0.0)
    _reached.add(broker)
    return connected


def ride_out_failover(run: Callable[[], T], window: float) -> T:
    """``run()``, a call on a cluster; while its slot's primary cannot be reached or the
    cluster says it is down, sent again every RETRY_SECONDS for up to ``window`` seconds
    (0: raised at once). The cluster client finds the promoted replica by itself (it reads
    the slot map again after such an error). A lost connection may have lost only the reply:
    the caller passes a window only for a call that is safe to run twice (a publish with a
    task id, which the task index stores once, as confirm_together's resend requires)."""
    return _again_while(run, UNOWNED, window)


def _again_while(run: Callable[[], T], errors: tuple[type[BaseException], ...], window: float) -> T:
    """``run()``, run again every RETRY_SECONDS while it raises one of ``errors`` (a refused
    login excepted), for up to ``window`` seconds; then the error is raised."""
    deadline = time.monotonic() + window
    while True:
        try:
            return run()
        except errors as error:
            if refused(error) or time.monotonic() + RETRY_SECONDS > deadline:
                raise
            time.sleep(RETRY_SECONDS)  # a broker's return, a promotion: no event tells of it
