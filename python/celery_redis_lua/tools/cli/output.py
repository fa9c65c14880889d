"""What a command prints: its answer on stdout; on stderr, the servers it asked and, when it
fails, one line that names them. Passwords seen in URLs are scrubbed from every line."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import click
import redis

from ...protocol.keys import KeyspaceError
from ...protocol.runner import ERROR_PREFIX

PROG = "celery-redis-lua"


_secrets: set[str] = set()  # passwords seen in URLs; scrubbed from every message we print
# The servers a command asked, and where their URLs came from: told on stderr when it ends,
# in its one error line when it fails (a newcomer's CLI asked a server they never meant).
_asked: list[str] = []


class CliError(click.ClickException):
    """Ends the command with ``celery-redis-lua: error: <message>`` and exit status 1."""


# The exit status of a command whose queue, dead letter or task is not in the broker (cancel
# and where's "not found" too): a script can tell a typo from a failure.
NOT_FOUND = 3


class NotFound(CliError):
    """What the command was asked about is not in the broker: exit status 3."""

    exit_code = NOT_FOUND


def no_queue(queue: str) -> NotFound:
    return NotFound(f"no queue {queue!r} (never declared, deleted, or expired)")


def mask(url: str) -> str:
    """``url`` with its password (userinfo or ``?password=``) replaced by ``***``."""
    url = re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)


def scrub(text: str) -> str:
    for secret in _secrets:
        text = text.replace(secret, "***")
    return text


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


JSON_OPTION = click.option("--json", "as_json", is_flag=True,
                           help="The rows as JSON (see docs/operations.md).")


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
