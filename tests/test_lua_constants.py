"""The scripts repeat the score constants and bounds (each file runs on its own, no includes): every
script that needs one defines it by name, with the same definition everywhere, and no
script writes its value as a bare literal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_redis_lua.protocol import bounds

LUA = Path(__file__).resolve().parents[1] / "lua"
SCRIPTS = sorted(LUA.glob("*.lua"))
# The one definition of each constant (its text, comment included).
CONSTANTS = {
    "PRIORITY_FACTOR": "local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)",
    # protocol/bounds.py's MAX_DURATION_MS: the longest duration a script takes or reads back.
    "MAX_DURATION_MS": ("local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration "
                        "taken or read back (bounds.py)"),
}
# The values, which must appear nowhere else in code (comments may explain them). The wake
# marker's ('~wake', scored 256 * 10^13 in the ready ZSET) must not come back: the wake
# token lives in a list of its own since script contract 2's eight keys.
LITERALS = ("10000000000000", "~wake", "2560000000000000", "256 *", "315360000000")


def code_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.lstrip().startswith("--")]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_a_script_defines_the_constants_it_uses_the_one_way(path: Path) -> None:
    lines = code_lines(path)
    for name, definition in CONSTANTS.items():
        uses = [line for line in lines if re.search(rf"\b{name}\b", line)]
        if not uses:
            continue
        definitions = [line for line in lines if line.startswith(f"local {name} =")]
        assert definitions == [definition], f"{path.name}: {name} must be defined as {definition!r}"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_no_script_writes_a_score_constant_as_a_bare_literal(path: Path) -> None:
    definitions = set(CONSTANTS.values())
    for line in code_lines(path):
        if line in definitions:
            continue
        code = line.split(" -- ")[0]
        assert not any(literal in code for literal in LITERALS), f"{path.name}: {line.strip()!r}"



# Helpers several scripts need, repeated for the same reason: each must read the same in
# every script that has it (an id scheme or a state format that drifted between scripts
# would break messages moving between them).
SHARED_FUNCTIONS = {"parse_state": 8, "next_id": 2, "count_in_meta": 4, "state_line": 4,  # name -> scripts
                    "forget_task": 6, "arm_wake": 9, "drop_idle_wake": 5, "wake_freed_slot": 3,
                    "retry_policy": 2, "retry_delay": 2, "stored_ms": 8,
                    "fenced_ids": 2, "expire_with_meta": 3}


def functions(path: Path) -> dict[str, str]:
    """Each top-level ``local function NAME(...)`` of a script, through its closing ``end``."""
    found, lines = {}, path.read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"local function (\w+)\(", line)
        if match:
            end = lines.index("end", i)
            found[match.group(1)] = "\n".join(lines[i:end + 1])
    return found


@pytest.mark.parametrize("name", sorted(SHARED_FUNCTIONS))
def test_a_helper_repeated_in_several_scripts_reads_the_same_in_each(name: str) -> None:
    texts = {path.name: text for path in SCRIPTS if (text := functions(path).get(name))}
    assert len(texts) == SHARED_FUNCTIONS[name], f"{name} is defined in {sorted(texts)}"
    assert len(set(texts.values())) == 1, f"{name} differs between {sorted(texts)}"


def test_the_scripts_bounds_are_python_s() -> None:
    """One bound per kind, in Python (protocol/bounds.py) and in each script that needs it."""
    assert CONSTANTS["MAX_DURATION_MS"].startswith(f"local MAX_DURATION_MS = {bounds.MAX_DURATION_MS} ")
    assert f"local MAX = {bounds.MAX_LIMIT}\n" in (LUA / "limit.lua").read_text()
    assert int(CONSTANTS["PRIORITY_FACTOR"].split()[3]) - 1 == bounds.MAX_ETA_MS  # publish.lua's
