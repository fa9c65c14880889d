"""``migrate``: move the messages waiting in kombu's stock Redis transport into ours."""

from __future__ import annotations

import json

import click

from .broker import connect, connection_options
from .output import JSON_OPTION, progress, table
from .root import main


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
    from ..migrate import Migration

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
