"""Script files and their header contracts: what each Lua file promises, parsed from its
header so that it cannot drift from the code (docs, the CLI and contract tests read it).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class KeySpec:
    name: str
    type: str
    pattern: str
    description: str


@dataclass(frozen=True)
class ArgSpec:
    position: int
    name: str
    variadic: bool
    description: str


@dataclass(frozen=True)
class Contract:
    """What a script's header promises; parsed from the file, so it cannot drift."""

    name: str
    version: int
    summary: str
    flags: tuple[str, ...]
    keys: tuple[KeySpec, ...]
    keys_per_queue: bool
    argv: tuple[ArgSpec, ...]
    returns: str
    errors: tuple[str, ...]
    why: str

    @property
    def fixed_argc(self) -> int:
        return sum(1 for arg in self.argv if not arg.variadic)

    @property
    def variadic_argv(self) -> bool:
        return any(arg.variadic for arg in self.argv)


_HEADER_LINE = re.compile(r"^--(?: (?P<text>.*))?$")
_SECTION = re.compile(r"^(?P<key>[A-Za-z_]+):(?: (?P<value>.*))?$")
_ARG = re.compile(r"^(?P<pos>\d+)(?P<variadic>\.\.)?\s+(?P<name>\w+)\s+(?P<rest>.*)$")
_KEY = re.compile(r"^(?P<name>\w+)\s+(?P<type>[A-Z]+)\s+(?P<pattern>\S+(?: \S+)?)\s{2,}(?P<desc>.*)$")


class ContractError(ValueError):
    """A script header does not follow the contract format."""


def parse_contract(source: str) -> Contract:
    """Parse the header block of a script (the comment lines after the shebang)."""
    lines = source.splitlines()
    if not lines or not lines[0].startswith("#!lua"):
        raise ContractError("the first line must be a '#!lua' shebang")
    sections = _sections(lines[1:])

    def single(key: str) -> str:
        if key not in sections:
            raise ContractError(f"header has no '{key}:' line")
        return " ".join(part for part in sections[key] if part).strip()

    keys, keys_per_queue = _keys(sections)  # KEYS, then ARGV, are checked before the rest
    argv = _argv(sections)
    return Contract(
        name=single("name"),
        version=int(single("version")),
        summary=single("summary"),
        flags=_flags(lines[0]),
        keys=keys,
        keys_per_queue=keys_per_queue,
        argv=argv,
        returns=single("returns"),
        errors=tuple(e for e in sections.get("errors", []) if e.startswith("ERR")),
        why=single("why"),
    )


def _flags(shebang: str) -> tuple[str, ...]:
    """The shebang's ``flags=a,b`` (none: an empty tuple)."""
    match = re.search(r"flags=(\S+)", shebang)
    return tuple(match.group(1).split(",")) if match else ()


def _sections(lines: list[str]) -> dict[str, list[str]]:
    """The header's ``key: value`` sections, each a list of its lines (the first one's value,
    then the indented lines under it); the header ends at the first line that is no comment."""
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in lines:
        header = _HEADER_LINE.match(line)
        if not header:
            break
        text = header.group("text") or ""
        section = _SECTION.match(text)
        if section and not text.startswith(" "):
            current = section.group("key")
            sections[current] = [section.group("value") or ""]
        elif current is not None:
            sections[current].append(text.strip())
    return sections


def _keys(sections: dict[str, list[str]]) -> tuple[tuple[KeySpec, ...], bool]:
    """The KEYS described, checked against the count the section starts with, and whether
    that count is per queue."""
    keys_head = sections.get("KEYS", [""])[0]
    keys_match = re.match(r"^(\d+)( per queue)?", keys_head)
    if not keys_match:
        raise ContractError("'KEYS:' must start with a count, e.g. 'KEYS: 2' or 'KEYS: 3 per queue'")
    keys = []
    for text in sections["KEYS"][1:]:
        key = _KEY.match(text)
        if key:
            keys.append(KeySpec(key["name"], key["type"], key["pattern"], key["desc"]))
        elif keys and text:
            continue  # a continuation of the description
    if len(keys) != int(keys_match.group(1)):
        raise ContractError(f"'KEYS: {keys_match.group(1)}' but {len(keys)} keys are described")
    return tuple(keys), bool(keys_match.group(2))


def _argv(sections: dict[str, list[str]]) -> tuple[ArgSpec, ...]:
    """The ARGV described ('ARGV: none' for none), their positions checked to run 1, 2, ..."""
    argv: list[ArgSpec] = []
    if sections.get("ARGV", [""])[0].strip() != "none":
        for text in sections.get("ARGV", [])[1:]:
            arg = _ARG.match(text)
            if arg:
                argv.append(ArgSpec(int(arg["pos"]), arg["name"], bool(arg["variadic"]), arg["rest"]))
    for expected, spec in enumerate(argv, start=1):
        if spec.position != expected:
            raise ContractError(f"ARGV positions must run 1, 2, ...; got {spec.position} for {spec.name}")
    return tuple(argv)


@dataclass(frozen=True)
class Script:
    """One Lua file: its exact bytes, their SHA1 and its parsed contract."""

    name: str
    path: Path
    source: bytes
    sha1: str
    contract: Contract

    @classmethod
    def from_file(cls, path: Path) -> Script:
        source = path.read_bytes()
        contract = parse_contract(source.decode())
        if contract.name != path.stem:
            raise ContractError(f"{path.name}: header name {contract.name!r} != file name")
        return cls(contract.name, path, source, hashlib.sha1(source).hexdigest(), contract)


def lua_dir() -> Path:
    """The Lua files: inside the installed package, or at the top of a checkout."""
    packaged = Path(__file__).parents[1] / "lua"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[3] / "lua"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"no Lua scripts at {packaged} or {checkout}")


@cache
def load_scripts(directory: Path | None = None) -> dict[str, Script]:
    """Every ``*.lua`` file of ``directory`` (default: :func:`lua_dir`), by name."""
    directory = directory or lua_dir()
    return {path.stem: Script.from_file(path) for path in sorted(directory.glob("*.lua"))}


def read_manifest(directory: Path | None = None) -> dict[str, dict[str, Any]]:
    """``lua/manifest.json``: name -> {version, sha1}."""
    manifest: dict[str, dict[str, dict[str, Any]]] = json.loads(
        ((directory or lua_dir()) / "manifest.json").read_text())
    return manifest["scripts"]
