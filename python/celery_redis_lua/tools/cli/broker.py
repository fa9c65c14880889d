"""Which broker a command asks: ``--url``, ``$CELERY_BROKER_URL``, the Celery app ``-A`` names,
or the local default; and the client of it, made as the transport makes its own."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import click
import redis
from redis.cluster import ClusterNode, RedisCluster

from _celery_redis_lua_alias import SCHEMES as OUR_SCHEMES

from ...protocol import cluster, sentinel
from ...protocol.keys import Keyspace, KeyspaceError
from ...protocol.library import ScriptLibrary
from .output import CliError, _asked, _secrets, mask, scrub

DEFAULT_URL = "redis://127.0.0.1:6379/0"


# URL schemes as redis-py knows them: redis-py's own, kombu's socket forms, and ours.
SCHEMES = {"redis": "redis", "rediss": "rediss", "unix": "unix", "redis+socket": "unix",
           "socket": "unix", **OUR_SCHEMES}


def redis_url(url: str) -> str:
    """A broker URL as redis-py's ``from_url`` takes it; :class:`CliError` if it is not one."""
    url = url.split(";")[0].strip()  # Celery's failover list: the first one
    scheme, sep, rest = url.partition("://")
    expected = "expected redis://, rediss://, redislua://, redisluas:// or unix:// (a Unix socket)"
    if not sep:  # not even a scheme: do not echo it, it may hold anything
        raise CliError(f"bad URL (no scheme): {expected}")
    if scheme.lower() not in SCHEMES:
        raise CliError(f"bad URL {mask(url)!r}: {expected}")
    mapped = SCHEMES[scheme.lower()]
    try:
        parts = urlsplit(url)
        if parts.password:
            _secrets.add(parts.password)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as error:
        raise CliError(f"bad URL {mask(url)!r}: {scrub(str(error))}") from None
    db = parts.path.strip("/")
    if mapped != "unix" and db and not db.isdigit():  # redis-py would quietly use db 0
        raise CliError(f"bad URL {mask(url)!r}: the database must be a number, got {db!r}")
    return f"{mapped}://{rest}"


CLUSTER_URL_SCHEMES = ("redislua+cluster://", "redisluas+cluster://")


def cluster_client(url: str) -> RedisCluster:
    """A cluster client from a seed node's ``redislua+cluster://`` URL (the rest are
    discovered); commands that cover queues go to every primary."""
    scheme, _, rest = url.partition("+cluster://")
    try:
        parsed = cluster.parse_cluster_host(f"cluster://{rest}")
    except cluster.ClusterConfigError as error:
        raise CliError(f"bad URL {mask(url)!r}: {scrub(str(error))}") from None
    if parsed.password:
        _secrets.add(parsed.password)
    client = RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in parsed.nodes],
                          username=parsed.username, password=parsed.password,
                          ssl=scheme.lower() == "redisluas", socket_connect_timeout=5, socket_timeout=30)
    try:
        client.ping()
    except (redis.RedisError, OSError) as error:
        raise CliError(f"cannot reach the cluster at {mask(url)}: {scrub(str(error))}") from None
    return client


def sentinel_client(url: str) -> redis.Redis:
    """A client of the primary the sentinels named in ``url`` (';'-joined) point to."""
    urls = [part.strip() for part in url.split(";") if part.strip()]
    for part in urls:
        with contextlib.suppress(ValueError):
            if urlsplit(part).password:
                _secrets.add(urlsplit(part).password or "")
    meta = click.get_current_context().meta
    if not meta.get("master_name"):
        raise CliError("--master-name is required with a sentinel URL")
    try:
        parsed = sentinel.parse_sentinel_urls(urls)
    except sentinel.SentinelConfigError as error:
        raise CliError(f"bad URL {mask(url)!r}: {scrub(str(error))}") from None
    password = meta.get("sentinel_password")
    if password:
        _secrets.add(password)
    params: dict[str, Any] = {"db": parsed.db, "username": parsed.username, "password": parsed.password,
                              "socket_connect_timeout": 5, "socket_timeout": 30}
    if parsed.tls:
        params["connection_class"] = redis.SSLConnection
    pool = sentinel.master_pool(parsed, meta["master_name"],
                                sentinel_kwargs={"password": password} if password else None, **params)
    client = redis.Redis(connection_pool=pool)
    try:
        client.ping()
    except redis.sentinel.MasterNotFoundError as error:
        raise CliError(scrub(str(sentinel.explain_master_not_found(pool, error)))) from None
    return client


def broker_of(url: str | None, prefix: str) -> tuple[str, str, str]:
    """(url, prefix, where the url came from) for a command: ``--url`` or $CELERY_BROKER_URL,
    else the Celery app's ``broker_url`` (``-A``, whose ``global_keyprefix`` and Sentinel
    ``master_name`` are the defaults too), else the local default; a newcomer's CLI asked a
    server they never meant without naming it."""
    ctx = click.get_current_context(silent=True)
    if url:
        given = ctx is not None and ctx.get_parameter_source("url") == click.core.ParameterSource.ENVIRONMENT
        return url, prefix, "$CELERY_BROKER_URL" if given else "--url"
    app_name = ctx.meta.get("app") if ctx is not None else None
    if not app_name:
        return DEFAULT_URL, prefix, "the default: no --url, $CELERY_BROKER_URL or -A APP given"
    app = celery_app(app_name)
    found = app.conf.broker_url or app.conf.broker_write_url
    if not found:
        raise CliError(f"the Celery app {app_name!r} names no broker_url")
    options = app.conf.broker_transport_options or {}
    if ctx is not None and not ctx.meta.get("master_name") and options.get("master_name"):
        ctx.meta["master_name"] = options["master_name"]
    return str(found), prefix or str(options.get("global_keyprefix") or ""), f"the Celery app {app_name}"


def celery_app(name: str) -> Any:
    """The Celery app ``-A`` names (``proj``, ``proj.celery``, ``proj.celery:app``), found as
    `celery -A` finds it, from the current directory."""
    from celery.app.utils import find_app

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return find_app(name)
    except Exception as error:  # an import error, or no app there: the user's module, not ours
        raise CliError(f"cannot load the Celery app -A {name!r}: {type(error).__name__}: {error}") from None


def connect(url: str | None, prefix: str, role: str = "broker") -> ScriptLibrary:
    """A :class:`ScriptLibrary` on a server that answered PING; stderr names the server and
    where its URL came from (stdout stays the command's answer)."""
    url, prefix, source = broker_of(url, prefix) if role == "broker" else (url or DEFAULT_URL, prefix, role)
    shown = (mask(url) if "://" in url else "at a URL without a scheme") + \
        (f", key prefix {prefix!r}" if prefix else "")  # a URL without one may hold anything
    _asked.append(f"{role} {shown} (from {source})")
    return _connect(url, prefix)


def _connect(url: str, prefix: str) -> ScriptLibrary:
    try:
        keyspace = Keyspace(prefix)
    except KeyspaceError as error:
        raise CliError(f"bad --prefix: {error}") from None
    if sentinel.is_sentinel_url(url.strip()):
        return ScriptLibrary(sentinel_client(url), keyspace)
    if url.strip().lower().startswith(CLUSTER_URL_SCHEMES):
        return ScriptLibrary(cluster_client(url.strip()), keyspace)
    mapped = redis_url(url)
    try:
        client = redis.Redis.from_url(mapped, socket_connect_timeout=5, socket_timeout=30)
    except ValueError as error:
        raise CliError(f"bad URL {mask(url)!r}: {scrub(str(error))}") from None
    try:
        client.ping()
    except redis.AuthenticationError as error:
        raise CliError(f"cannot log in to {mask(url)}: {scrub(str(error))}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
        raise CliError(f"cannot reach {mask(url)}: {scrub(str(error))}") from None
    return ScriptLibrary(client, keyspace)  # the transport's default policy


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    ctx.meta[param.name or ""] = value
    return value


def connection_options(command: Callable[..., Any]) -> Callable[..., Any]:
    command = click.option("--prefix", default="", help="Key prefix (global_keyprefix).")(command)
    command = click.option("--master-name", expose_value=False, callback=_remember,
                           envvar="CELERY_BROKER_MASTER_NAME", show_envvar=True,
                           help="With a sentinel URL: the name the sentinels monitor.")(command)
    command = click.option("--sentinel-password", expose_value=False, callback=_remember,
                           envvar="CELERY_SENTINEL_PASSWORD", show_envvar=True,
                           help="With a sentinel URL: the sentinels' own password.")(command)
    command = click.option("-A", "--app", expose_value=False, callback=_remember,
                           help="A Celery app (proj, proj.celery:app): its broker_url and "
                                "global_keyprefix, when --url is not given.")(command)
    return click.option(
        "--url", envvar="CELERY_BROKER_URL", default=None, show_envvar=True,
        help="redis://, rediss://, redislua://, redisluas://, unix:///path, sentinel:// URLs "
             f"joined by ';', or redislua+cluster://host:port (one node of a cluster). Default: "
             f"-A's broker_url, else {DEFAULT_URL}; stderr says which was asked.")(command)
