"""The scripts repeat the score constants (each file runs on its own, no includes): every
script that needs one defines it by name, with the same definition everywhere, and no
script writes its value as a bare literal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

LUA = Path(__file__).resolve().parents[1] / "lua"
SCRIPTS = sorted(LUA.glob("*.lua"))
# The one definition of each constant (its text, comment included).
CONSTANTS = {
    "PRIORITY_FACTOR": "local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)",
    "WAKE_MEMBER": ("local WAKE_MEMBER = '~wake' -- wakes a consumer blocked on BZMPOP "
                    "when something is delayed"),
    "WAKE_SCORE": "local WAKE_SCORE = 256 * PRIORITY_FACTOR -- above every ready score",
    "READY_MAX": ("local READY_MAX = '(' .. string.format('%d', WAKE_SCORE) -- every ready score, "
                  "not the wake marker"),
}
# The values, which must appear nowhere else in code (comments may explain them).
LITERALS = ("10000000000000", "~wake", "2560000000000000", "256 *")


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

