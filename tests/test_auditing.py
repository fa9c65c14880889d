"""docs/auditing.md cannot go stale: its redis-cli sessions are replayed, its line references checked.

Sessions are the ```console blocks. In a block, a line starting with `$ ` is a command
(a trailing backslash continues it on the next line), `# wait-ms N` waits until the
server's clock has moved N ms on, other `# ` lines are comments, and every other line is
expected output of the command above it, compared exactly, line by line, where `<ms>`
stands for an integer, `<id>` for a 16-hex-digit message id and `<stream-id>` for a
stream entry id. Each block runs in one bash, from the repository root, on a fresh
server of each kind, with `redis-cli` being the one on PATH pointed at that server
(exactly the shell function the page tells a reader to define).

References are written `lua/<file>.lua:L<a>-L<b>` followed by a keyword in a code span
in parentheses; the keyword must appear in those lines of that script.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import require_kind
from helpers import Shell, matches, server_now_ms, wait_for_server_time
from scripts.servers import Server

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "auditing.md"
GUARANTEES = ("SIGKILL", "delivery limit", "Priority order", "Delayed delivery")
REFERENCE = re.compile(r"`lua/(\w+\.lua):L(\d+)-L(\d+)` \(`([^`]+)`\)")
ANY_REFERENCE = re.compile(r"lua/\w+\.lua:L\d+")
MAX_RANGE = 40  # a reference names a few lines, not a whole script


@dataclass
class Step:
    command: str = ""
    wait_ms: int = 0
    expected: list[str] = field(default_factory=list)


@dataclass
class Session:
    line: int  # where the block starts in the doc, for messages
    steps: list[Step]


def sessions(text: str) -> list[Session]:
    found: list[Session] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```console":
            i += 1
            continue
        start, steps, i = i + 1, [], i + 1
        while lines[i].strip() != "```":
            line = lines[i]
            if line.startswith("$ "):
                command = line[2:]
                while command.endswith("\\"):
                    i += 1
                    command = command + "\n" + lines[i]  # bash joins the lines
                steps.append(Step(command=command))
            elif match := re.fullmatch(r"# wait-ms (\d+)", line):
                steps.append(Step(wait_ms=int(match[1])))
            elif line.startswith("# "):
                pass
            else:
                assert steps and steps[-1].command, f"docs/auditing.md:{i + 1}: output before any command"
                steps[-1].expected.append(line)
            i += 1
        found.append(Session(start, steps))
        i += 1
    return found


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


@pytest.fixture(params=["valkey", "redis"])
def scratch_kind(request: pytest.FixtureRequest, redis_cli: str) -> str:
    require_kind(request.param)
    return request.param


def session_ids() -> Iterator[str]:
    for session in sessions(DOC.read_text()):
        yield f"line{session.line}"


@pytest.mark.parametrize("number", range(len(sessions(DOC.read_text()))),
                         ids=list(session_ids()))
def test_session_replays_with_the_documented_output(doc: str, scratch_kind: str, number: int) -> None:
    session = sessions(doc)[number]
    with Server(scratch_kind) as server:
        client = server.client()
        shell = Shell(server.port)
        try:
            for step in session.steps:
                if step.wait_ms:
                    wait_for_server_time(client, server_now_ms(client) + step.wait_ms)
                    continue
                actual, status = shell.run(step.command)
                where = f"docs/auditing.md block at line {session.line}, command {step.command!r}"
                assert status == 0, f"{where}: exit status {status}, output {actual}"
                same = len(actual) == len(step.expected) and all(
                    matches(want, got) for want, got in zip(step.expected, actual, strict=True))
                assert same, f"{where}:\nexpected {step.expected}\nactual   {actual}"
        finally:
            shell.close()


def test_every_line_reference_points_at_its_keyword(doc: str) -> None:
    references = REFERENCE.findall(doc)
    assert len(references) == len(ANY_REFERENCE.findall(doc)), \
        "every lua/<file>.lua:L<a>-L<b> reference must be followed by (`keyword`)"
    assert len(references) >= 8
    for name, first, last, keyword in references:
        lines = (ROOT / "lua" / name).read_text().splitlines()
        a, b = int(first), int(last)
        where = f"lua/{name}:L{a}-L{b} ({keyword!r})"
        assert 1 <= a <= b <= len(lines), f"{where}: outside the file ({len(lines)} lines)"
        assert b - a < MAX_RANGE, f"{where}: name fewer lines"
        assert keyword in "\n".join(lines[a - 1:b]), \
            f"{where}: the keyword is not in those lines any more; update docs/auditing.md"


def test_each_guarantee_has_references_and_a_session(doc: str) -> None:
    sections = re.split(r"^## ", doc, flags=re.M)[1:]
    for guarantee in GUARANTEES:
        section = next((s for s in sections if guarantee.lower() in s.splitlines()[0].lower()), None)
        assert section is not None, f"docs/auditing.md has no section on {guarantee!r}"
        assert REFERENCE.search(section), f"section {guarantee!r} names no script lines"
        assert "```console" in section, f"section {guarantee!r} has no redis-cli session"
