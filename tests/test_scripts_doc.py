"""docs/scripts.md: current with the script headers, complete, and its worked example runs.

The worked example is replayed command by command with the real redis-cli against a
throwaway server, from the root of the checkout (the commands read lua/), and each
command's output must be exactly the `# ` lines the page shows under it.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

from celery_redis_lua import docgen, producer
from celery_redis_lua.scripts import load_scripts, read_manifest
from celery_redis_lua.servers import Server

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scripts.md"


def doc_text() -> str:
    assert DOC.exists(), "docs/scripts.md is missing: run make scripts-doc"
    return DOC.read_text()


def example_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for every redis-cli line of the worked example."""
    start, end = text.index(docgen.EXAMPLE_START), text.index(docgen.EXAMPLE_END)
    commands: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```sh\n(.*?)```", text[start:end], flags=re.S):
        for line in block.splitlines():
            if line.startswith("redis-cli "):
                commands.append((line, []))
            elif line.startswith("#"):
                assert commands, f"output line before any command: {line!r}"
                commands[-1][1].append(line[2:])
    return commands


def test_doc_is_what_the_generator_produces_now() -> None:
    assert doc_text() == docgen.generate(), "docs/scripts.md is stale: run make scripts-doc"


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
    consume = next(out for cmd, out in commands if "lua/consume.lua" in cmd)
    assert consume[:4] == ["-1", "1", "0000000000000002", "0"]  # priority 9, published second
    assert json.loads(consume[4])["properties"]["priority"] == 9








def test_the_worked_example_runs_as_printed(redis_cli: str, scratch_server: Server) -> None:
    commands = example_commands(doc_text())
    prefix = f"{shlex.quote(redis_cli)} -h 127.0.0.1 -p {scratch_server.port}"
    for command, expected in commands:
        done = subprocess.run(["bash", "-c", prefix + command.removeprefix("redis-cli")],
                              cwd=ROOT, capture_output=True, text=True, timeout=30)
        # redis-cli exits 0 on error replies too: the output comparison is what catches them.
        assert done.returncode == 0, (command, done.stderr)
        assert done.stdout.splitlines() == expected, command
    assert scratch_server.client().script_exists(read_manifest()["publish"]["sha1"]) == [True]
