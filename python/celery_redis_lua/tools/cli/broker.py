"""Which broker a command asks: ``--url``, ``$CELERY_BROKER_URL``, the Celery app ``-A`` names,
or the local default; and the client of it, made as the transport makes its own."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import click
import redis
from kombu.connection import Connection
from redis.cluster import RedisCluster

from _celery_redis_lua_alias import SCHEMES as OUR_SCHEMES

from ...protocol import sentinel
from ...protocol.keys import Keyspace, KeyspaceError
from ...protocol.library import ScriptLibrary
from ...protocol.runner import ScriptError
from .output import CliError, _asked, _secrets, mask, no_queue, scrub

DEFAULT_URL = "redis://127.0.0.1:6379/0"


# The URL schemes a command takes, each as the transport's scheme that means the same: the
# transport makes the command's client, so a command reaches a broker exactly as a worker does.
SCHEMES = {"redis": "redislua", "rediss": "redisluas", "unix": "redislua+socket",
           "redis+socket": "redislua+socket", "socket": "redislua+socket",
           "sentinel": "redislua+sentinel", "sentinels": "redisluas+sentinel",
           **{ours: ours for ours in (*OUR_SCHEMES, "redislua+sentinel", "redisluas+sentinel",
                                      "redislua+cluster", "redisluas+cluster")}}
EXPECTED = ("expected redis://, rediss://, redislua://, redisluas://, unix:// (a Unix socket), "
            "sentinel:// or redislua+cluster://")
# Transport options the CLI sets from its own flags: an error naming one names the flag.
FLAGS = {"transport option 'master_name'": "--master-name",
         "transport option 'sentinel_kwargs'": "--sentinel-password"}
# The transport options of an app (-A) that say how to reach its broker; the others (a stock
# kombu app's among them) are the workers' business.
APP_CONNECTION_OPTIONS = ("sentinel_kwargs", "min_other_sentinels", "cluster", "cluster_nodes",
                          "credential_provider", "ssl", "socket_keepalive", "socket_keepalive_options",
                          "partition_timeout")
# A command's client waits less than a worker's for a server that does not answer.
CLI_TIMEOUTS = {"socket_connect_timeout": 5, "socket_timeout": 30}


def require_queues(lib: ScriptLibrary, queues: Sequence[str]) -> None:
    """NotFound for the first of ``queues`` that does not exist (no meta hash: never declared,
    deleted, or expired with its keys), so a mistyped name is not answered with zeros."""
    for m in lib.metrics(queues):
        if not m.exists:
            raise no_queue(m.queue)


@contextlib.contextmanager
def about_queue(queue: str) -> Iterator[None]:
    """A script's "no queue 'meta:{Q}'" (it names its key, for redis-cli) in the CLI's terms."""
    try:
        yield
    except ScriptError as error:
        if ": no queue '" in str(error):
            raise no_queue(queue) from None
        raise


def transport_url(url: str) -> str:
    """``url`` (';'-joined for sentinels; else Celery's failover list, whose first one is
    asked) in the transport's schemes; :class:`CliError` if it is not a broker URL."""
    parts = [part.strip() for part in url.split(";") if part.strip()] or [url]
    if not sentinel.is_sentinel_url(parts[0]):
        parts = parts[:1]
    mapped = []
    for part in parts:
        scheme, sep, rest = part.partition("://")
        if not sep:  # not even a scheme: do not echo it, it may hold anything
            raise CliError(f"bad URL (no scheme): {EXPECTED}")
        if scheme.lower() not in SCHEMES:
            raise CliError(f"bad URL {mask(part)!r}: {EXPECTED}")
        try:
            split = urlsplit(part)
        except ValueError as error:
            raise CliError(f"bad URL {mask(part)!r}: {scrub(str(error))}") from None
        if split.password:
            _secrets.add(split.password)
        if "password=" in split.query:  # kombu's parse_url fails on it with a TypeError
            _secrets.update(value for key, _, value in (q.partition("=") for q in split.query.split("&"))
                            if key == "password")
            raise CliError(f"bad URL {mask(part)!r}: a password goes in the URL's userinfo "
                           "(redis://:PASSWORD@host), as kombu reads it, not in ?password=")
        mapped.append(f"{SCHEMES[scheme.lower()]}://{rest}")
    return ";".join(mapped)


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
    if ctx is not None:  # the app's way to its broker is the command's too
        if not ctx.meta.get("master_name") and options.get("master_name"):
            ctx.meta["master_name"] = options["master_name"]
        ctx.meta["transport_options"] = {k: v for k, v in options.items() if k in APP_CONNECTION_OPTIONS}
        ctx.meta["ssl"] = app.conf.broker_use_ssl
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
    return ScriptLibrary(client_of(url), keyspace)  # the transport's default policy


def client_of(url: str) -> redis.Redis | RedisCluster:
    """A client of the broker ``url`` names that answered PING, made by the transport itself
    (URL schemes, Sentinel, cluster, TLS and sockets are the transport's, in one place)."""
    target = transport_url(url)
    meta = click.get_current_context().meta
    options: dict[str, Any] = {**meta.get("transport_options", {}), **CLI_TIMEOUTS}
    if sentinel.is_sentinel_url(target):
        if not meta.get("master_name"):
            raise CliError("--master-name is required with a sentinel URL")
        options["master_name"] = meta["master_name"]
        if meta.get("sentinel_password"):
            _secrets.add(meta["sentinel_password"])
            options["sentinel_kwargs"] = {"password": meta["sentinel_password"]}
    # rediss:// verifies the server's certificate, as redis-py does, unless the app says how.
    secure = target.lower().startswith(("redisluas", "rediss"))
    ssl = meta.get("ssl") or ({"ssl_cert_reqs": "required"} if secure else None)
    try:
        with warnings.catch_warnings():  # an app's options for another broker kind: not ours to warn
            warnings.simplefilter("ignore", RuntimeWarning)
            transport = Connection(target, ssl=ssl or False, transport_options=options).transport
        client: redis.Redis | RedisCluster = transport.new_client()
        transport.check_server(client, eviction_warning=False)  # status says it, once
    except redis.AuthenticationError as error:
        raise CliError(f"cannot log in to {mask(url)}: {scrub(str(error))}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError,
            redis.exceptions.RedisClusterException) as error:
        raise CliError(f"cannot reach {mask(url)}: {_in_flags(error)}") from None
    except sentinel.SentinelConfigError as error:  # a master name no sentinel monitors
        raise CliError(_in_flags(error)) from None
    except (ValueError, TypeError) as error:  # a bad URL or option, told as the transport tells it
        raise CliError(f"bad URL {mask(url)!r}: {_in_flags(error)}") from None
    return client


def _in_flags(error: BaseException) -> str:
    text = scrub(str(error))
    for option, flag in FLAGS.items():
        text = text.replace(option, flag)
    return text


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
