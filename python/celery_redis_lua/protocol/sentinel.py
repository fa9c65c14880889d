"""Redis Sentinel: the sentinels named by broker URLs, and a connection pool that follows the
primary through a failover (redis-py's Sentinel support does the discovery).

kombu's convention for several sentinels is one URL each, joined by ``;``, with the
database on any of them: ``sentinel://h1:26379;sentinel://h2:26379/0`` (or our scheme,
``redislua+sentinel://...``). The user and password in the URLs are the primary's; the
sentinels' own password and TLS go in ``sentinel_kwargs``, as with kombu's stock Sentinel
transport. The transport and the CLI both build their pools here (no kombu import).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool

from .liveness import refused

DEFAULT_SENTINEL_PORT = 26379
# A sentinel that does not answer within this long is skipped for the next one (redis-py
# would wait forever without a socket timeout, and discovery would stall a failover).
SENTINEL_SOCKET_TIMEOUT = 5.0
SENTINEL_SCHEMES = ("sentinel", "redislua+sentinel", "sentinels", "redisluas+sentinel")


class SentinelConfigError(ValueError):
    """Sentinel URLs or options that can never work (a bad URL, an unknown master name)."""


class SentinelsRefusedLogin(MasterNotFoundError, redis.AuthenticationError):
    """Every sentinel refused us (a wrong or missing sentinel password, or a certificate that
    fails verification): no wait makes it succeed, so it is an AuthenticationError too, which
    a reconnect does not ride out."""


@dataclass(frozen=True)
class SentinelUrls:
    """What a list of sentinel URLs says: where the sentinels are, and the primary's db and
    credentials."""

    sentinels: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None
    tls: bool


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES and "://" in url


def parse_sentinel_urls(urls: Sequence[str]) -> SentinelUrls:
    """``sentinel://[user:password@]host[:port][/db]`` URLs (``redislua+sentinel://`` too);
    each names one sentinel, the database and credentials may stand on any one of them."""
    sentinels: list[tuple[str, int]] = []
    dbs, users, passwords, tls = set(), set(), set(), set()
    for url in urls:
        scheme = url.split("://", 1)[0].lower()
        if not is_sentinel_url(url):
            raise SentinelConfigError(f"expected sentinel:// or redislua+sentinel:// URLs, got one "
                                      f"with scheme {scheme!r}")
        try:
            parts = urlsplit("sentinel://" + url.split("://", 1)[1])
            port = parts.port or DEFAULT_SENTINEL_PORT
        except ValueError as error:
            raise SentinelConfigError(f"bad sentinel URL: {error}") from None
        if not parts.hostname:
            raise SentinelConfigError("a sentinel URL has no host")
        sentinels.append((parts.hostname, port))
        db = parts.path.strip("/")
        if db:
            if not db.isdigit():
                raise SentinelConfigError(f"the database of a sentinel URL must be a number, got {db!r}")
            dbs.add(int(db))
        if parts.username:
            users.add(unquote(parts.username))
        if parts.password:
            passwords.add(unquote(parts.password))
        tls.add(scheme.endswith("s+sentinel") or scheme == "sentinels")
    if not sentinels:
        raise SentinelConfigError("no sentinel URL given")
    for what, values in (("database", dbs), ("user", users), ("password", passwords)):
        if len(values) > 1:
            raise SentinelConfigError(f"the sentinel URLs disagree on the {what}")
    if len(tls) > 1:
        raise SentinelConfigError("the sentinel URLs mix TLS and plain schemes")
    return SentinelUrls(tuple(dict.fromkeys(sentinels)), dbs.pop() if dbs else 0,
                        users.pop() if users else None, passwords.pop() if passwords else None,
                        tls.pop())


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool (connections ask the sentinels for the primary when they
    connect, and a READONLY reply from a demoted primary becomes a ConnectionError) with
    the waiting behaviour of the transport's standalone pool: a caller waits for a free
    connection instead of failing with 'Too many connections'."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        # redis-py leaves SentinelConnectionPool.__init__ unannotated (and mypy does not apply
        # untyped_calls_exclude to super() calls).
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]


def master_pool(urls: SentinelUrls, master_name: str, *, sentinel_kwargs: dict[str, Any] | None,
                min_other_sentinels: int = 0, **connection_kwargs: Any) -> BlockingSentinelPool:
    """A pool of connections to ``master_name``'s current primary."""
    for key in ("host", "port", "path"):
        connection_kwargs.pop(key, None)
    connection_class = connection_kwargs.pop("connection_class", None)
    if connection_class is not None and issubclass(connection_class, redis.SSLConnection):
        connection_kwargs["ssl"] = True  # redis-py picks its Sentinel-managed TLS connection
    if sentinel_kwargs is None:  # as redis-py does: the primary's socket options
        sentinel_kwargs = {k: v for k, v in connection_kwargs.items()
                           if k.startswith("socket_") and v is not None}
    # No retries inside one sentinel query (redis-py's clients default to ten, with backoff):
    # discovery goes on to the next sentinel at once, and kombu retries the connect.
    sentinel_kwargs = {"socket_timeout": SENTINEL_SOCKET_TIMEOUT,
                       "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT,
                       "retry": Retry(NoBackoff(), 0), **sentinel_kwargs}
    sentinel = Sentinel(list(urls.sentinels), min_other_sentinels=min_other_sentinels,
                        sentinel_kwargs=sentinel_kwargs)
    return BlockingSentinelPool(master_name, sentinel, is_master=True, **connection_kwargs)


def explain_master_not_found(pool: BlockingSentinelPool, error: MasterNotFoundError) -> Exception:
    """Tell a master name no sentinel knows (a configuration error, not worth retrying) from
    sentinels that are unreachable or agree that the primary is down (worth retrying)."""
    name = pool.service_name
    known: set[str] = set()
    refusals: list[str] = []
    logins_refused = 0
    for sentinel in pool.sentinel_manager.sentinels:
        where = "{host}:{port}".format_map(sentinel.connection_pool.connection_kwargs)
        try:
            known.update(sentinel.sentinel_masters())
        except (redis.RedisError, OSError) as error:
            refusals.append(f"{where} ({type(error).__name__}: {error})")
            logins_refused += refused(error)
    if len(refusals) < len(pool.sentinel_manager.sentinels) and name not in known:
        monitored = ", ".join(sorted(known)) or "none"
        return SentinelConfigError(f"transport option 'master_name': no sentinel monitors a master "
                                   f"named {name!r} (monitored: {monitored})")
    if refusals and not known:
        kind = SentinelsRefusedLogin if logins_refused == len(refusals) else MasterNotFoundError
        return kind(f"no sentinel answered for master {name!r}: {'; '.join(refusals)}")
    return error
