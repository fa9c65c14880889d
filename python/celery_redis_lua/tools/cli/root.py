"""The command group every command of the CLI hangs from."""

from __future__ import annotations

import click

from .output import OneLineGroup


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Operator's tool for celery-redis-lua: scripts, publishing, queue status, pause and resume,
    limits, dead letters."""
