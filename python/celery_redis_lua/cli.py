"""``celery-redis-lua``: inspect and load the scripts, publish a task, show queues, handle dead letters.

Every command takes ``--url`` (default: ``$CELERY_BROKER_URL``, else the broker of the
Celery app ``-A`` names, else redis://127.0.0.1:6379/0) and ``--prefix`` (the transport's
``global_keyprefix``; ``-A``'s by default); Sentinel URLs (``sentinel://h1:26379;...``
or ``redislua+sentinel://...``) take ``--master-name`` too. stderr names the server asked
and where its URL came from. Failures end with one line on stderr and a non-zero exit; a
password in a URL is never printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import takewhile
from typing import Any, NoReturn
from urllib.parse import urlsplit

import click
import redis
from redis.cluster import ClusterNode, RedisCluster

from _celery_redis_lua_alias import SCHEMES as OUR_SCHEMES

from . import cluster, sentinel
from .locate import cancel_task, locate_task, task_of
from .protocol import acl, producer
from .protocol.contract import load_scripts, read_manifest
from .protocol.keys import Keyspace, KeyspaceError
from .protocol.library import ScriptLibrary
from .protocol.ops import QueueMetrics
from .protocol.runner import ERROR_PREFIX, ScriptError

DEFAULT_URL = "redis://127.0.0.1:6379/0"
REPLAY_BATCH = 500  # dead letters per dead_replay call: a few ms of the server's time
PROG = "celery-redis-lua"
# URL schemes as redis-py knows them: redis-py's own, kombu's socket forms, and ours.
SCHEMES = {"redis": "redis", "rediss": "rediss", "unix": "unix", "redis+socket": "unix",
           "socket": "unix", **OUR_SCHEMES}
_secrets: set[str] = set()  # passwords seen in URLs; scrubbed from every message we print
# The servers a command asked, and where their URLs came from: told on stderr when it ends,
# in its one error line when it fails (a newcomer's CLI asked a server they never meant).
_asked: list[str] = []


class CliError(click.ClickException):
    """Ends the command with ``celery-redis-lua: error: <message>`` and exit status 1."""


def mask(url: str) -> str:
    """``url`` with its password (userinfo or ``?password=``) replaced by ``***``."""
    url = re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)


def scrub(text: str) -> str:
    for secret in _secrets:
        text = text.replace(secret, "***")
    return text


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


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in cells)


class OneLineGroup(click.Group):
    """Every failure (usage, URL, connection, script error) as one line on stderr."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> NoReturn:
        _asked.clear()  # one command's (tests run several in one process)
        try:
            status = super().main(args, prog_name or PROG, complete_var, standalone_mode=False, **extra)
        except click.ClickException as error:
            fail(error.format_message(), error.exit_code)
        except click.Abort:
            fail("aborted")
        except redis.RedisError as error:  # a script's own error reply reads "<script>: <problem>"
            fail(str(error).removeprefix(ERROR_PREFIX).strip())
        except KeyspaceError as error:  # a --queue that cannot be a queue's name
            fail(f"bad --queue value: {error}")
        for asked in _asked:
            click.echo(f"{PROG}: asked the {asked}", err=True)
        sys.exit(status if isinstance(status, int) else 0)


def fail(message: str, status: int = 1) -> NoReturn:
    asked = f" [asked the {'; the '.join(_asked)}]" if _asked else ""
    line = " ".join(scrub(message + asked).split())
    click.echo(f"{PROG}: error: {line}", err=True)
    sys.exit(status)


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


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Operator's tool for celery-redis-lua: scripts, publishing, queue status, pause and resume,
    limits, dead letters."""


@main.group()
def scripts() -> None:
    """The Lua scripts: list, load, verify, show."""


JSON_OPTION = click.option("--json", "as_json", is_flag=True,
                           help="The rows as JSON (see docs/operations.md).")


@scripts.command("list")
@JSON_OPTION
@connection_options
def scripts_list(as_json: bool, url: str, prefix: str) -> None:
    """Name, contract version, SHA1, and whether the server's script cache holds it."""
    lib = connect(url, prefix)
    files = load_scripts()
    loaded = lib.client.script_exists(*(s.sha1 for s in files.values()))
    rows = [(name, s.contract.version, s.sha1, bool(here))
            for (name, s), here in zip(files.items(), loaded, strict=True)]
    if as_json:
        click.echo(json.dumps([{"script": n, "version": v, "sha1": h, "loaded": i} for n, v, h, i in rows]))
        return
    click.echo(table(["script", "version", "sha1", "loaded"],
                     [(*row[:3], "yes" if row[3] else "no") for row in rows]))


@scripts.command("load")
@connection_options
def scripts_load(url: str, prefix: str) -> None:
    """SCRIPT LOAD every script; print name and SHA1."""
    lib = connect(url, prefix)
    files = load_scripts()
    for name, sha1 in lib.runner.load().items():
        if sha1 != files[name].sha1:
            raise CliError(f"the server hashed {name} to {sha1}, the file is {files[name].sha1}")
        click.echo(f"{name} {sha1}")


@scripts.command("verify")
@connection_options
def scripts_verify(url: str, prefix: str) -> None:
    """Exit 1 unless the server's cache holds every file's SHA1 (and the files match the manifest)."""
    lib = connect(url, prefix)
    files, manifest = load_scripts(), read_manifest()
    loaded = lib.client.script_exists(*(s.sha1 for s in files.values()))
    problems = 0
    for (name, script), here in zip(files.items(), loaded, strict=True):
        pinned = manifest.get(name, {}).get("sha1")
        status = "ok" if here else "not loaded"
        if pinned != script.sha1:
            status = f"file differs from lua/manifest.json ({pinned})"
        problems += status != "ok"
        click.echo(f"{name} {script.sha1} {status}")
    if problems:
        raise CliError(f"{problems} of {len(files)} scripts failed verification "
                       f"(load them with: {PROG} scripts load)")


@scripts.command("show")
@click.argument("name")
@connection_options
def scripts_show(name: str, url: str, prefix: str) -> None:
    """Print a script's header contract (reads the file only; no server is contacted)."""
    files = load_scripts()
    if name not in files:
        raise CliError(f"no script named {name!r}; scripts: {', '.join(files)}")
    lines = files[name].source.decode().splitlines()
    click.echo("\n".join([lines[0], *takewhile(lambda line: line.startswith("--"), lines[1:])]))


def _json_option(value: str, name: str, kind: type) -> Any:
    try:
        parsed = json.loads(value)
    except ValueError as error:
        raise CliError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(parsed, kind):
        raise CliError(f"{name} must be a JSON {'array' if kind is list else 'object'}, got {value!r}")
    return parsed


@main.command()
@click.argument("task_name")
@click.option("--args", "args_json", default="[]", help="Positional arguments, a JSON array.")
@click.option("--kwargs", "kwargs_json", default="{}", help="Keyword arguments, a JSON object.")
@click.option("--queue", default=producer.DEFAULT_QUEUE, show_default=True)
@click.option("--priority", type=int, default=0, show_default=True, help="0..255, higher first.")
@click.option("--countdown", type=float, default=0, help="Seconds to wait (server clock).")
@click.option("--task-id", default=None, help="Default: a new UUID.")
@click.option("--visibility-timeout", type=float, default=300, show_default=True,
              help="The workers' visibility_timeout, seconds.")
@connection_options
def publish(task_name: str, args_json: str, kwargs_json: str, queue: str, priority: int,
            countdown: float, task_id: str | None, visibility_timeout: float, url: str,
            prefix: str) -> None:
    """Publish a Celery (protocol v2) task message; print its task id."""
    args = _json_option(args_json, "--args", list)
    kwargs = _json_option(kwargs_json, "--kwargs", dict)
    if countdown < 0:
        raise CliError(f"--countdown must be >= 0, got {countdown}")
    if visibility_timeout <= 0:
        raise CliError(f"--visibility-timeout must be > 0, got {visibility_timeout}")
    lib = connect(url, prefix).with_policy(visibility_ms=int(visibility_timeout * 1000))
    eta_ms = None
    if countdown > 0:
        seconds, micros = lib.client.time()  # the server's clock, the one the scripts use
        eta_ms = seconds * 1000 + micros // 1000 + round(countdown * 1000)
    envelope = producer.build_envelope(task_name, args, kwargs, task_id=task_id, queue=queue,
                                       priority=priority, eta_ms=eta_ms)
    lib.publish(queue, producer.dumps(envelope), priority=priority, eta_ms=eta_ms,
                task_id=envelope["headers"]["id"])
    click.echo(envelope["headers"]["id"])


STATUS_COLUMNS = ["queue", "ready", "delayed", "in_flight", "dead", "paused", "limits"]


@main.command()
@click.option("--queue", "queues", multiple=True, help="Repeatable. Default: every queue (SCAN).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per run: {\"server_time_ms\", \"queues\": [...]} "
                   "(see docs/operations.md).")
@click.option("--watch", is_flag=True,
              help="A live table with rates, redrawn every --interval, until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.2), default=1.0, show_default=True,
              help="Seconds between redraws of --watch.")
@connection_options
def status(queues: tuple[str, ...], as_json: bool, watch: bool, interval: float, url: str,
           prefix: str) -> None:
    """Ready, delayed, in-flight and dead-lettered messages per queue, which are paused, and
    their limits (celery-redis-lua limit)."""
    lib = connect(url, prefix)
    if watch:
        from .watch import watch_status  # rich only when watching

        watch_status(lib, list(queues), interval)
        return
    names = list(queues) or lib.queue_names()
    found = lib.metrics(names) if names else []
    if as_json:
        click.echo(json.dumps(status_json(found)))
        return
    if not names:
        click.echo(f"no queues (no {lib.keys.meta('*')} keys)")
        return
    rows = [(m.queue, m.ready, m.delayed, m.in_flight, m.dead, _paused(m.paused), m.limits) for m in found]
    click.echo(table(STATUS_COLUMNS, rows))


def status_json(found: Sequence[QueueMetrics]) -> dict[str, Any]:
    """The --json shape of status (stable: fields are only ever added)."""
    return {"server_time_ms": found[0].now if found else None, "queues": [{
        "queue": m.queue, "ready": m.ready, "delayed": m.delayed, "retrying": m.retrying,
        "in_flight": m.in_flight, "dead": m.dead, "paused": m.paused,
        "limits": {"in_flight": m.limits.in_flight, "rate": m.limits.rate},
        "redelivered": m.redelivered, "dropped": m.dropped,
        "oldest_ready_age_ms": m.oldest_ready_age_ms, "next_eta_in_ms": m.next_eta_in_ms,
    } for m in found]}


def _paused(reason: str | None) -> str:
    return "no" if reason is None else f"yes: {reason}" if reason else "yes"


@main.command("pause")
@click.argument("queue")
@click.option("--reason", default="", help="Why, shown by status (at most 256 bytes).")
@connection_options
def pause_command(queue: str, reason: str, url: str, prefix: str) -> None:
    """Pause a queue for every consumer, held in the broker: it takes publishes and delivers
    nothing (due countdowns wait too) until resumed; messages in flight finish normally."""
    changed = connect(url, prefix).pause(queue, reason)
    click.echo(f"{queue!r} paused" if changed else f"{queue!r} was paused already (reason updated)")


@main.command("resume")
@click.argument("queue")
@connection_options
def resume_command(queue: str, url: str, prefix: str) -> None:
    """Resume a paused queue: its blocked consumers wake at once."""
    changed = connect(url, prefix).resume(queue)
    click.echo(f"{queue!r} resumed" if changed else f"{queue!r} was not paused")


@main.command("limit")
@click.argument("queue")
@click.option("--in-flight", "in_flight", metavar="N",
              help="At most N messages of the queue delivered and not yet acked, across all consumers.")
@click.option("--rate", metavar="N/s|N/m|N/h",
              help="At most N deliveries per second, minute or hour, across all consumers "
                   "(a burst of max(1, N/10)).")
@click.option("--clear", "clear_all", is_flag=True, help="Clear both limits.")
@click.option("--clear-in-flight", is_flag=True, help="Clear the in-flight limit.")
@click.option("--clear-rate", is_flag=True, help="Clear the rate.")
@connection_options
def limit_command(queue: str, in_flight: str | None, rate: str | None, clear_all: bool,
                  clear_in_flight: bool, clear_rate: bool, url: str, prefix: str) -> None:
    """Limit a queue for all its consumers together, held in the broker and enforced by the
    consume script: changeable at any time, shown by status. The script judges the values."""
    if clear_all and (in_flight is not None or rate is not None):
        raise click.UsageError("--clear clears both limits: give it alone, or use --clear-in-flight "
                               "or --clear-rate")
    if in_flight is None and rate is None and not (clear_all or clear_in_flight or clear_rate):
        raise click.UsageError("give --in-flight, --rate or a --clear option")
    try:
        limits = connect(url, prefix).limit(
            queue, in_flight=in_flight, rate=rate,  # as typed: the script judges them, naming a bad one
            clear_in_flight=clear_all or clear_in_flight, clear_rate=clear_all or clear_rate)
    except ScriptError as error:  # a value the script refused: named by the flag it came from
        problem = str(error).removeprefix(f"{ERROR_PREFIX} limit: ")
        for argument, flag in LIMIT_FLAGS.items():
            if problem.startswith(f"{argument} must "):
                raise click.UsageError(flag + problem.removeprefix(argument)) from None
        raise
    except ValueError as error:  # set and clear of one limit at once
        raise click.UsageError(str(error).removeprefix("celery-redis-lua: limit: ")) from None
    click.echo(f"{queue!r} limits: {limits}")
    if in_flight is not None:
        click.echo(IN_FLIGHT_COUNTS)


# The limit script's ARGV names, as the flags an operator typed them with.
LIMIT_FLAGS = {"in_flight": "--in-flight", "rate": "--rate"}
# What the in-flight cap counts (docs/operations.md says the same): an early-acked Celery
# task is acked when it starts, so the cap holds prefetched tasks back, not running ones.
IN_FLIGHT_COUNTS = ("The in-flight cap counts unacked deliveries: with Celery's default early ack it "
                    "limits prefetch, not running tasks; to cap running tasks, set task_acks_late=True.")


@main.group()
def dead() -> None:
    """Dead letters of a queue: list, replay, purge."""


@dead.command("list")
@click.argument("queue")
@click.option("--count", type=int, default=100, show_default=True)
@click.option("--after", default=None, help="Entry id to continue after.")
@JSON_OPTION
@connection_options
def dead_list(queue: str, count: int, after: str | None, as_json: bool, url: str, prefix: str) -> None:
    """Dead letters, oldest first: entry id, message id, reason, delivery count, task."""
    letters = connect(url, prefix).dead_list(queue, count=count, after=after)
    if as_json:
        click.echo(json.dumps([{"entry": d.entry_id, "message": d.id, "reason": d.reason,
                                "delivery_count": d.delivery_count, "priority": d.priority,
                                **dict(zip(("task", "task_id"), task_of(d.payload), strict=True))}
                               for d in letters]))
        return
    if not letters:
        click.echo(f"no dead letters in {queue!r}")
        return
    rows = [(d.entry_id, d.id, d.reason, d.delivery_count, *task_of(d.payload)) for d in letters]
    click.echo(table(["entry", "message", "reason", "count", "task", "task_id"], rows))


@dead.command("replay")
@click.argument("queue")
@click.argument("entry_ids", nargs=-1)
@click.option("--count", type=click.IntRange(min=1), default=100, show_default=True,
              help="Oldest entries replayed when no entry ids are given (in calls of "
                   f"{REPLAY_BATCH}, with a progress bar on a terminal).")
@connection_options
def dead_replay(queue: str, entry_ids: tuple[str, ...], count: int, url: str, prefix: str) -> None:
    """Put dead letters back into their queue as fresh messages; print the new message ids."""
    lib = connect(url, prefix)
    if entry_ids:
        ids = lib.dead_replay(queue, count=1, entry_ids=entry_ids)
    else:
        ids = []
        with progress(lambda: min(count, lib.stats([queue])[0].dead),
                      f"replaying dead letters of {queue!r}") as step:
            while len(ids) < count:  # one call at a time: each holds the server for its batch only
                batch = lib.dead_replay(queue, count=min(REPLAY_BATCH, count - len(ids)))
                ids += batch
                step(len(batch))
                if not batch:
                    break
    click.echo(f"replayed {len(ids)} dead letters into {queue!r}" + "".join(f"\n{i}" for i in ids))


# A progress bar is drawn for work of at least this many messages, on a terminal only.
PROGRESS_FROM = 1000


@contextlib.contextmanager
def progress(total_of: Callable[[], int], what: str) -> Iterator[Callable[[int], None]]:
    """``step(n)`` advances a progress bar on stderr, when stderr is a terminal and the work
    (``total_of()``, asked only then) is long; otherwise it does nothing (a pipe or a log gets
    the result lines only, and the total is never counted)."""
    total = total_of() if sys.stderr.isatty() else 0
    if total < PROGRESS_FROM:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


@dead.command("purge")
@click.argument("queue")
@connection_options
def dead_purge(queue: str, url: str, prefix: str) -> None:
    """Delete every dead letter of the queue."""
    click.echo(f"purged {connect(url, prefix).dead_purge(queue)} dead letters of {queue!r}")


def _task_id(value: str) -> str:
    if not value or len(value.encode()) > 256:
        raise CliError(f"TASK_ID must be 1 to 256 bytes, got {len(value.encode())}")
    return value


def _when(ms: int | None, now_ms: int) -> str:
    if ms is None or ms < 0:
        return "-"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(ms / 1000))} UTC ({(ms - now_ms) / 1000:+.1f} s)"


def task_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """TASK_ID, --queue and --json, as where and cancel take them."""
    command = connection_options(command)
    command = click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")(command)
    command = click.option("--queue", "queues", multiple=True,
                           help="Repeatable. Default: every queue (SCAN).")(command)
    return click.argument("task_id", callback=lambda ctx, param, value: _task_id(value))(command)


@main.command("where")
@task_options
def where_command(task_id: str, queues: tuple[str, ...], as_json: bool, url: str, prefix: str) -> None:
    """Where a task is: ready, delayed, waiting to retry, in flight, dead-lettered, or not in
    the broker."""
    lib = connect(url, prefix)
    found = locate_task(lib, task_id, queues)
    if as_json:
        click.echo(json.dumps(found.as_dict()))
        return
    seconds, micros = lib.client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    lines = {
        "ready": f"ready in {found.queue!r}: priority {found.priority}, about {found.ahead} message(s) ahead",
        "delayed": f"delayed in {found.queue!r}: due {_when(found.eta_ms, now)}",
        "retry": f"waiting to retry in {found.queue!r} until {_when(found.eta_ms, now)}: delivery "
                 f"{found.delivery_count} failed or was returned (x-delayed-retry-type)",
        "in_flight": f"in flight from {found.queue!r}: delivery {found.delivery_count}, taken back "
                     f"{_when(found.deadline_ms, now)} unless acked",
        "dead": f"dead-lettered in {found.queue!r}: reason {found.reason}, entry {found.dead_entry} "
                f"(replay: {PROG} dead replay {found.queue} {found.dead_entry})",
        "absent": "not in the broker: acked, expired, purged, never published, or published "
                  "without its task id",
    }
    click.echo(f"{task_id}: {lines[found.state]}")


@main.command("cancel")
@task_options
def cancel_command(task_id: str, queues: tuple[str, ...], as_json: bool, url: str, prefix: str) -> None:
    """Take a ready or delayed task out of its queue so it never runs (kept as a dead letter,
    reason 'cancelled'). A task in flight is left alone: exit 2; not found: exit 3."""
    done = cancel_task(connect(url, prefix), task_id, queues)
    if as_json:
        click.echo(json.dumps({"task_id": task_id, "outcome": done.outcome, "queue": done.queue or None,
                               "message_id": done.id, "was": done.was}))
    elif done.outcome == "cancelled":
        click.echo(f"{task_id}: cancelled ({done.was} in {done.queue!r}); kept as a dead letter, reason "
                   f"'cancelled'")
    elif done.outcome == "in_flight":
        click.echo(f"{task_id}: in flight from {done.queue!r}: left alone (revoke it in Celery)")
    else:
        click.echo(f"{task_id}: not ready or delayed in any queue: nothing cancelled")
    if done.outcome != "cancelled":
        sys.exit(2 if done.outcome == "in_flight" else 3)


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), default=9808, show_default=True,
              help="HTTP port of /metrics (celery-exporter's).")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface, e.g. in a container).")
@click.option("--queue", "queues", multiple=True,
              help="Repeatable. Default: every queue (meta keys and binding tables, rediscovered).")
@click.option("--discover-interval", type=click.FloatRange(min=1), default=30, show_default=True,
              help="Seconds between queue discoveries (SCAN).")
@connection_options
def exporter(port: int, address: str, queues: tuple[str, ...], discover_interval: float, url: str,
             prefix: str) -> None:
    """Serve Prometheus metrics of the queues (celery_queue_length and celery_redis_lua_*)."""
    from . import exporter as metrics_exporter  # prometheus_client only when serving

    lib = connect(url, prefix)
    # Before the first scrape can be answered: a SIGTERM that comes as soon as /metrics
    # answers must stop the exporter cleanly, not kill it (CI met that race once).
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        server, _ = metrics_exporter.serve(lib, port=port, address=address, queues=queues,
                                                discover_interval=discover_interval)
    except OSError as error:
        raise CliError(f"cannot listen on {address}:{port}: {error.strerror or error}") from None
    click.echo(f"serving metrics of the {_asked[-1]} on http://{address}:{port}/metrics", err=True)
    with contextlib.suppress(KeyboardInterrupt):
        while not stop.wait(3600):
            pass
    server.shutdown()


@main.command()
@click.option("--from", "source_url", required=True,
              help="kombu's stock Redis transport's broker URL (redis://, rediss://, unix://).")
@click.option("--from-prefix", default="", help="Stock kombu's global_keyprefix there.")
@click.option("--queue", "queues", multiple=True,
              help="Repeatable. Default: every queue in stock kombu's binding tables.")
@click.option("--dry-run", is_flag=True, help="Count what would move; change nothing.")
@JSON_OPTION
@connection_options
def migrate(source_url: str, from_prefix: str, queues: tuple[str, ...], dry_run: bool, as_json: bool,
            url: str, prefix: str) -> None:
    """Move the messages waiting in kombu's stock Redis transport into ours, exactly once and
    in their order (rerun it after an interruption). Stop the stock workers first."""
    from .migrate import Migration

    lib = connect(url, prefix)
    for queue in queues:
        lib.keys.queue(queue)  # a name that cannot be a queue's fails here, before anything moves
    source = connect(source_url, "", role="stock kombu broker").client
    wanted = list(queues) or None
    if dry_run:
        report = Migration(source, lib, source_prefix=from_prefix).run(wanted, dry_run=True)
    else:
        def planned() -> int:  # a dry run, only to size a progress bar on a terminal
            plan = Migration(source, lib, source_prefix=from_prefix).run(wanted, dry_run=True)
            return sum(plan.planned.values())

        with progress(planned, "migrating") as step:
            report = Migration(source, lib, source_prefix=from_prefix, after_take=lambda: step(1)).run(wanted)
    if dry_run:
        rows = sorted(report.planned.items())
        if as_json:
            click.echo(json.dumps({"planned": dict(rows)}))
            return
        click.echo(table(["queue", "messages"], rows) if rows else "nothing to migrate")
        return
    if as_json:
        click.echo(json.dumps({"moved": dict(sorted(report.moved.items())), "finished": report.finished,
                               "skipped": report.skipped, "total": report.total}))
        return
    for queue, count in sorted(report.moved.items()):
        click.echo(f"{queue}: {count} message(s) moved")
    if report.finished:
        click.echo(f"finished {report.finished} message(s) an interrupted run had taken")
    for line in report.skipped:
        click.echo(f"skipped: {line}", err=True)
    click.echo(f"moved {report.total} message(s)")


@main.command("acl")
@click.option("--role", type=click.Choice(acl.ROLES), required=True,
              help="worker: consumes (and publishes); producer: only publishes; exporter: reads metrics.")
@click.option("--user", default=None, help="ACL user name. Default: celery-<role>.")
@click.option("--prefix", required=True, help="The transport's global_keyprefix (required).")
@click.option("--durability", is_flag=True, help="Also WAIT and WAITAOF (the durability option).")
@click.option("--no-unblock", is_flag=True,
              help="Without CLIENT UNBLOCK (@admin): waits then end by closing their connection.")
def acl_command(role: str, user: str | None, prefix: str, durability: bool, no_unblock: bool) -> None:
    """Print the ACL SETUSER line of a least-privilege user (no server is contacted).

    Replace PASSWORD, and type it at the redis-cli prompt (in a shell, quote '>PASSWORD')."""
    try:
        line = acl.setuser(user or f"celery-{role}", role, prefix, durability=durability,
                           unblock=not no_unblock)
    except ValueError as error:
        raise CliError(f"bad --user or --prefix: {error}") from None
    click.echo(" ".join(line))


if __name__ == "__main__":
    main()
