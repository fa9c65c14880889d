"""``dead list|replay|purge``: a queue's dead letters."""

from __future__ import annotations

import json

import click

from ..locate import task_of
from .broker import connect, connection_options, require_queues
from .output import JSON_OPTION, NotFound, progress, table
from .root import main

REPLAY_BATCH = 500  # dead letters per dead_replay call: a few ms of the server's time


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
    lib = connect(url, prefix)
    require_queues(lib, [queue])
    letters = lib.dead_list(queue, count=count, after=after)
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
    if any(d.reason == "expired" for d in letters):
        click.echo(EXPIRED_REPLAY, err=True)


# A task keeps its Celery 'expires' header through a replay: the worker discards it at once.
EXPIRED_REPLAY = ("note: an 'expired' dead letter keeps its task's expires time; replayed, a Celery "
                  "worker discards it at once (\"Discarding revoked task\"). Publish the task again "
                  "instead (celery-redis-lua publish, or the app) to run it.")


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
    require_queues(lib, [queue])
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
    if len(ids) < len(entry_ids):
        raise NotFound(f"{len(entry_ids) - len(ids)} of the {len(entry_ids)} entry ids given are not "
                       f"dead letters of {queue!r} (see: celery-redis-lua dead list {queue})")


@dead.command("purge")
@click.argument("queue")
@connection_options
def dead_purge(queue: str, url: str, prefix: str) -> None:
    """Delete every dead letter of the queue."""
    lib = connect(url, prefix)
    require_queues(lib, [queue])
    click.echo(f"purged {lib.dead_purge(queue)} dead letters of {queue!r}")
