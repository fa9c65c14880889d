"""``dead list|replay|purge``: a queue's dead letters."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime

import click

from ...protocol.library import ScriptLibrary
from ...protocol.ops import DeadLetter
from ..envelope import task_of, with_expires
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
EXPIRED_REPLAY = ("note: an 'expired' dead letter keeps its task's expires time; replayed as it is, a "
                  "Celery worker discards it at once (\"Discarding revoked task\"). To run it: dead "
                  "replay QUEUE ENTRY --renew-expires SECONDS (or --clear-expires).")


@dead.command("replay")
@click.argument("queue")
@click.argument("entry_ids", nargs=-1)
@click.option("--count", type=click.IntRange(min=1), default=100, show_default=True,
              help="Oldest entries replayed when no entry ids are given (in calls of "
                   f"{REPLAY_BATCH}, with a progress bar on a terminal).")
@click.option("--clear-expires", is_flag=True,
              help="Replay each task without its Celery expires time (an 'expired' letter "
                   "replayed as it is is discarded by the worker at once).")
@click.option("--renew-expires", "renew_expires", type=click.FloatRange(min=0, min_open=True),
              metavar="SECONDS", help="Replay each task with its Celery expires time SECONDS "
                                      "from now (the broker's clock).")
@connection_options
def dead_replay(queue: str, entry_ids: tuple[str, ...], count: int, clear_expires: bool,
                renew_expires: float | None, url: str, prefix: str) -> None:
    """Put dead letters back into their queue as fresh messages; print the new message ids."""
    if clear_expires and renew_expires is not None:
        raise click.UsageError("--clear-expires and --renew-expires cannot be combined")
    lib = connect(url, prefix)
    require_queues(lib, [queue])
    if clear_expires or renew_expires is not None:
        ids = _replay_with_expires(lib, queue, entry_ids, count, _expires_at(lib, renew_expires))
    elif entry_ids:
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
    if len(ids) < len(set(entry_ids)):
        raise NotFound(f"{len(set(entry_ids)) - len(ids)} of the {len(set(entry_ids))} entry ids given "
                       f"are not dead letters of {queue!r} (see: celery-redis-lua dead list {queue})")


def _expires_at(lib: ScriptLibrary, renew: float | None) -> datetime | None:
    """``renew`` seconds from now by the broker's clock (the one its TTLs use); None: cleared."""
    if renew is None:
        return None
    seconds, micros = lib.client.time()
    return datetime.fromtimestamp(int(seconds) + int(micros) / 1e6 + renew, UTC)


def _replay_with_expires(lib: ScriptLibrary, queue: str, entry_ids: Sequence[str], count: int,
                         expires: datetime | None) -> list[str]:
    """The letters named (or the oldest ``count``), each a Celery task's envelope with its
    expires header rewritten (others as they are), replayed in calls of REPLAY_BATCH. A
    letter another replay took between the read and the call is skipped by dead_replay."""
    wanted = set(entry_ids)
    picked: list[DeadLetter] = []
    after = None
    while True:  # streams are capped by dead_letter_maxlen: a bounded number of pages
        page = lib.dead_list(queue, count=REPLAY_BATCH, after=after)
        picked += [d for d in page if d.entry_id in wanted] if wanted else page
        if len(page) < REPLAY_BATCH or (not wanted and len(picked) >= count) or \
                (wanted and len(picked) == len(wanted)):
            break
        after = page[-1].entry_id
    picked = picked if wanted else picked[:count]
    ids: list[str] = []
    for start in range(0, len(picked), REPLAY_BATCH):
        batch = picked[start:start + REPLAY_BATCH]
        payloads = {d.entry_id: with_expires(d.payload, expires) or d.payload for d in batch}
        ids += lib.dead_replay(queue, payloads=payloads)
    return ids


@dead.command("purge")
@click.argument("queue")
@connection_options
def dead_purge(queue: str, url: str, prefix: str) -> None:
    """Delete every dead letter of the queue."""
    lib = connect(url, prefix)
    require_queues(lib, [queue])
    click.echo(f"purged {lib.dead_purge(queue)} dead letters of {queue!r}")
