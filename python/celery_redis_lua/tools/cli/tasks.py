"""``publish``, ``where`` and ``cancel``: one task, by its name or its id."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from ...protocol import dedup, fairness, producer
from ...protocol.library import ScriptLibrary
from ..locate import Whereabouts, cancel_task, locate_task
from .broker import connect, connection_options
from .output import NOT_FOUND, PROG, CliError
from .root import main


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
@click.option("--dedup", "dedup_mode", type=click.Choice(dedup.MODES), default=None,
              help="Deduplicate by a dedup id: simple (while the first waits or runs), throttle (for "
                   "--dedup-ttl after the first), debounce (the newest replaces the one waiting).")
@click.option("--dedup-id", default=None, help="The dedup id (default: the task name and its arguments).")
@click.option("--dedup-key", type=click.Choice(dedup.KEYS), default=None,
              help="Build the dedup id from the task id or from the task name and arguments.")
@click.option("--dedup-ttl", type=float, default=None, help="Seconds a hold lasts at most (throttle: "
              "required).")
@click.option("--fairness-key", default=None, help="The tenant: the queue takes turns over the keys with "
              "something ready, within a priority (1..256 bytes).")
@connection_options
def publish(task_name: str, args_json: str, kwargs_json: str, queue: str, priority: int,
            countdown: float, task_id: str | None, visibility_timeout: float, dedup_mode: str | None,
            dedup_id: str | None, dedup_key: str | None, dedup_ttl: float | None,
            fairness_key: str | None, url: str, prefix: str) -> None:
    """Publish a Celery (protocol v2) task message; print its task id. With --dedup, a message
    of a dedup id held in the queue is not stored (or replaces the one waiting): said on
    stderr, with the id of the message that holds it."""
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
    option = {name: value for name, value in (("mode", dedup_mode), ("id", dedup_id), ("key", dedup_key),
                                               ("ttl", dedup_ttl)) if value is not None}
    if option:  # the task option Celery would carry, read back the one way the transport does
        envelope["properties"][dedup.OPTION] = {"mode": "simple", **option}
    try:
        settings = dedup.from_envelope(envelope)
    except dedup.BadDedup as error:
        raise CliError(f"--dedup: {error}") from None
    if fairness_key is not None:
        try:
            envelope["properties"][fairness.OPTION] = fairness.checked(fairness_key, "--fairness-key")
        except fairness.BadFairnessKey as error:
            raise CliError(str(error)) from None
    published = lib.publish(queue, producer.dumps(envelope), priority=priority, eta_ms=eta_ms,
                            task_id=envelope["headers"]["id"], dedup=settings, fairness_key=fairness_key)
    click.echo(envelope["headers"]["id"])
    if published.deduplicated:
        click.echo(f"{PROG} publish: not stored: message {published} holds dedup id "
                   f"{settings.id if settings else ''!r}", err=True)
    elif published.replaced:
        click.echo(f"{PROG} publish: replaced message {published.replaced} (debounce)", err=True)


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
    click.echo(f"{task_id}: {describe(lib, found)}")


def describe(lib: ScriptLibrary, found: Whereabouts) -> str:
    """Where ``found`` is, in the words of ``where`` (cancel says the same of what it cannot
    cancel)."""
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
    return lines[found.state]


@main.command("cancel")
@task_options
def cancel_command(task_id: str, queues: tuple[str, ...], as_json: bool, url: str, prefix: str) -> None:
    """Take a ready or delayed task out of its queue so it never runs (kept as a dead letter,
    reason 'cancelled'). A task in flight is left alone: exit 2; not found: exit 3."""
    lib = connect(url, prefix)
    done = cancel_task(lib, task_id, queues)
    if as_json:
        click.echo(json.dumps({"task_id": task_id, "outcome": done.outcome, "queue": done.queue or None,
                               "message_id": done.id, "was": done.was}))
    elif done.outcome == "cancelled":
        click.echo(f"{task_id}: cancelled ({done.was} in {done.queue!r}); kept as a dead letter, reason "
                   f"'cancelled'")
    elif done.outcome == "in_flight":
        click.echo(f"{task_id}: in flight from {done.queue!r}: left alone (revoke it in Celery)")
    else:  # say where it is, as where would: dead-lettered (cancelled already?), or not at all
        click.echo(f"{task_id}: {describe(lib, locate_task(lib, task_id, queues))}: nothing cancelled")
    if done.outcome != "cancelled":
        sys.exit(2 if done.outcome == "in_flight" else NOT_FOUND)
