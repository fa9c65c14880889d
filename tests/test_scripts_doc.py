"""docs/scripts.md: current with the script headers, complete, and its worked example runs.

The worked example is replayed command by command with the real redis-cli against a
throwaway server, in one bash (ids are kept in shell variables) from the root of the
checkout (the commands read lua/), and each command's output must be the `# ` lines the
page shows under it, `<id>` standing for a message id (ids follow the server's clock).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from celery_redis_lua.protocol import producer
from celery_redis_lua.protocol.contract import load_scripts, read_manifest
from helpers import Shell, matches
from scripts import docgen
from scripts.servers import Server

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scripts.md"


def doc_text() -> str:
    assert DOC.exists(), "docs/scripts.md is missing: run make docs"
    return DOC.read_text()


def example_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for every command of the worked example, in order."""
    start, end = text.index(docgen.EXAMPLE_START), text.index(docgen.EXAMPLE_END)
    commands: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```sh\n(.*?)```", text[start:end], flags=re.S):
        for line in block.splitlines():
            if line.startswith("# "):
                assert commands, f"output line before any command: {line!r}"
                commands[-1][1].append(line[2:])
            else:
                assert "redis-cli " in line, f"not a redis-cli command: {line!r}"
                commands.append((line, []))
    return commands


def delivered(consume_output: list[str]) -> list[list[str]]:
    """consume's reply without wake_in_ms and expired: [queue position, id, count, payload] each."""
    items = consume_output[2:]
    assert len(items) % 4 == 0, consume_output
    return [items[i:i + 4] for i in range(0, len(items), 4)]


def test_doc_is_what_the_generator_produces_now() -> None:
    assert doc_text() == docgen.generate(), "docs/scripts.md is stale: run make docs"


def test_every_script_is_documented_with_its_whole_contract() -> None:
    text = doc_text()
    manifest = read_manifest()
    for name, script in load_scripts().items():
        section = text.split(f"\n### {name}\n", 1)[1].split("\n### ", 1)[0]
        c = script.contract
        assert c.summary in section
        assert f"contract version: {c.version}" in section and c.version == manifest[name]["version"]
        assert f"SHA1: `{script.sha1}`" in section and script.sha1 == manifest[name]["sha1"]
        for flag in c.flags:
            assert f"`{flag}`" in section, (name, flag)
        keys_part, argv_part = section.split("**ARGV**", 1)
        key_rows = re.findall(r"^\| \S+ \| (\w+) \| (\w+) \| `([^`]+)` \|", keys_part, flags=re.M)
        assert key_rows == [(k.name, k.type, k.pattern) for k in c.keys], name
        arg_names = re.findall(r"^\| \d+(?:\.\.)? \| (\w+) \|", argv_part, flags=re.M)
        assert arg_names == [a.name for a in c.argv], name
        assert f"**Reply**: {c.returns}" in section
        assert c.errors and all(f"- `{error}`" in section for error in c.errors), name
        assert f"**Why**: {c.why}" in section


def test_the_page_documents_the_envelope_and_the_conventions() -> None:
    text = doc_text()
    for needed in ("headers.task", "headers.id", "properties.delivery_info", "properties.body_encoding",
                   "content-type", "higher first", "server's", "NOSCRIPT", "publish_v2",
                   "lua/manifest.json"):
        assert needed in text, needed
    shown = json.loads(re.search(r"```json\n(.*?)```", text, flags=re.S).group(1))
    assert shown["headers"]["task"] == "tasks.add"
    assert producer.decode_body(shown)[:2] == [[2, 3], {}]


def test_the_example_pins_the_manifest_sha1_and_shows_priority_order() -> None:
    commands = example_commands(doc_text())
    assert len(commands) >= 9
    load, expected = commands[0]
    assert "SCRIPT LOAD" in load and expected == [read_manifest()["publish"]["sha1"]]
    publishes = [cmd for cmd, _ in commands if "EVALSHA" in cmd]
    assert [cmd.split("=", 1)[0] for cmd in publishes] == ["low", "high", "later"]  # ids kept in order
    consume = next(out for cmd, out in commands if "lua/consume.lua" in cmd)
    assert consume[:2] == ["-1", "0"]  # nothing delayed, nothing expired
    messages = delivered(consume)
    assert [m[:3] for m in messages] == [["1", "<id>", "0"]] * 2
    # priority 9 first, although it was published second
    assert [json.loads(m[3])["properties"]["priority"] for m in messages] == [9, 0]
    ack = next(cmd for cmd, _ in commands if "lua/ack.lua" in cmd)
    assert ack.endswith(' , "$high" "$low"')


def test_the_worked_example_runs_as_printed(redis_cli: str, scratch_server: Server) -> None:
    commands = example_commands(doc_text())
    outputs: list[list[str]] = []
    with Shell(scratch_server.port) as shell:
        for command, expected in commands:
            actual, status = shell.run(command)
            # redis-cli exits 0 on error replies too: the output comparison is what catches them.
            assert status == 0, (command, actual)
            same = len(actual) == len(expected) and all(
                matches(want, got) for want, got in zip(expected, actual, strict=True))
            assert same, f"{command}:\nexpected {expected}\nactual   {actual}"
            outputs.append(actual)
    assert scratch_server.client().script_exists(read_manifest()["publish"]["sha1"]) == [True]
    # The ids the publishes printed grow in publish order, and consume delivered the second
    # one (priority 9) first.
    low, high, later = (out[0] for (cmd, _), out in zip(commands, outputs, strict=True) if "EVALSHA" in cmd)
    assert low < high < later
    consume = next(out for (cmd, _), out in zip(commands, outputs, strict=True) if "lua/consume.lua" in cmd)
    assert [m[1] for m in delivered(consume)] == [high, low]
