"""``status``, ``pause``, ``resume`` and ``limit``: the queues, for every consumer at once."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from ...protocol import logical
from ...protocol.eviction import Eviction, read_eviction
from ...protocol.ops import QueueMetrics
from ...protocol.runner import ERROR_PREFIX, ScriptError
from .broker import about_queue, connect, connection_options, require_queues
from .output import PROG, table
from .root import main

# retrying: of the delayed, those waiting for a delayed retry (as --json and --watch show it).
STATUS_COLUMNS = ["queue", "ready", "delayed", "retrying", "in_flight", "dead", "paused", "limits"]


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
    """Ready, delayed (retrying: of them, those waiting for a delayed retry), in-flight and
    dead-lettered messages per queue, which are paused, and
    their limits (celery-redis-lua limit)."""
    lib = connect(url, prefix)
    if watch:
        from ..watch import watch_status  # rich only when watching

        watch_status(lib, list(queues), interval)
        return
    if queues:
        require_queues(lib, queues)
    # A sharded queue's row adds up its shards', whose rows follow it (protocol/logical.py).
    names = [m for q in queues for m in logical.members_of(lib, q)] or lib.queue_names()
    found = flat(logical.fold(lib.metrics(names))) if names else []
    eviction = read_eviction(lib.client)
    if as_json:
        click.echo(json.dumps({**status_json(found), "maxmemory_policy": eviction.policy,
                               "eviction_warning": eviction.warning("the broker")}))
        return
    warn_of_eviction(eviction)
    if not names:
        click.echo(f"no queues (no {lib.keys.meta('*')} keys)")
        return
    rows = [(m.queue, m.ready, m.delayed, m.retrying, m.in_flight, m.dead, _paused(m.paused), m.limits)
            for m in found]
    click.echo(table(STATUS_COLUMNS, rows))


def warn_of_eviction(eviction: Eviction) -> None:
    """On stderr, so that stdout stays the table a script may parse."""
    warning = eviction.warning("the broker")
    if warning:
        click.echo(f"{PROG}: warning: {warning}", err=True)


def flat(folded: list[tuple[QueueMetrics, list[QueueMetrics]]]) -> list[QueueMetrics]:
    """Each logical queue, then its shards."""
    return [m for queue, shards in folded for m in (queue, *shards)]


def status_json(found: Sequence[QueueMetrics]) -> dict[str, Any]:
    """The --json shape of status (stable: fields are only ever added): a sharded queue's
    entry adds up its shards' and names them ("shards"); each shard's names it ("shard_of")."""
    shard_of = {s.queue: q.queue for q, shards in logical.fold(found) for s in shards}
    shards = {q: [s for s, of in shard_of.items() if of == q] for q in set(shard_of.values())}
    return {"server_time_ms": found[0].now if found else None, "queues": [{
        "queue": m.queue, "ready": m.ready, "delayed": m.delayed, "retrying": m.retrying,
        "in_flight": m.in_flight, "dead": m.dead, "paused": m.paused,
        "limits": {"in_flight": m.limits.in_flight, "rate": m.limits.rate},
        "redelivered": m.redelivered, "dropped": m.dropped,
        "oldest_ready_age_ms": m.oldest_ready_age_ms, "next_eta_in_ms": m.next_eta_in_ms,
        **({"shards": shards[m.queue]} if m.queue in shards else {}),
        **({"shard_of": shard_of[m.queue]} if m.queue in shard_of else {}),
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
    with about_queue(queue):
        changed = logical.pause(connect(url, prefix), queue, reason)
    click.echo(f"{queue!r} paused" if changed else f"{queue!r} was paused already (reason updated)")


@main.command("resume")
@click.argument("queue")
@connection_options
def resume_command(queue: str, url: str, prefix: str) -> None:
    """Resume a paused queue: its blocked consumers wake at once."""
    with about_queue(queue):
        changed = logical.resume(connect(url, prefix), queue)
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
        with about_queue(queue):
            limits = logical.limit(  # the values as typed: the script judges them, naming a bad one
                connect(url, prefix), queue, in_flight=in_flight, rate=rate,
                clear_in_flight=clear_all or clear_in_flight, clear_rate=clear_all or clear_rate)
    except ScriptError as error:  # a value the script refused: named by the flag it came from
        problem = str(error).removeprefix(f"{ERROR_PREFIX} limit: ")
        for argument, flag in LIMIT_FLAGS.items():
            if problem.startswith(f"{argument} must "):  # the script's 'clear' is a flag here
                problem = problem.replace(", 'clear' or ''", f" (or {flag.replace('--', '--clear-')})")
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
