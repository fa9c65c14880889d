"""lua/manifest.json matches the scripts byte for byte, and gen_manifest.py guards versions.

A script whose bytes change must carry a new contract version, so that anyone
calling it by SHA1 or version (from another language, or redis-cli) knows it
changed. The manifest is the record of that.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from celery_redis_lua.protocol.contract import lua_dir, parse_contract, read_manifest

ROOT = Path(__file__).resolve().parents[1]
LUA = ROOT / "lua"
FIX = "bump '-- version:' in the script's header and run `make manifest`"


def test_manifest_lists_every_script_with_its_sha1_and_version() -> None:
    manifest = json.loads((LUA / "manifest.json").read_text())["scripts"]
    files = sorted(LUA.glob("*.lua"))
    assert files, "no lua/*.lua found"
    problems = []
    for path in files:
        source = path.read_bytes()
        entry = manifest.get(path.stem)
        if entry is None:
            problems.append(f"{path.name} is not in lua/manifest.json")
            continue
        version = parse_contract(source.decode()).version
        if entry["sha1"] != hashlib.sha1(source).hexdigest():
            problems.append(f"{path.name} changed (SHA1 differs from the manifest)")
        if entry["version"] != version:
            problems.append(f"{path.name} is version {version}, the manifest says {entry['version']}")
    extra = sorted(set(manifest) - {p.stem for p in files})
    problems += [f"manifest lists {name!r} but lua/{name}.lua does not exist" for name in extra]
    assert not problems, "; ".join(problems) + f" -- {FIX}"


def test_manifest_entries_have_exactly_name_version_sha1() -> None:
    manifest = json.loads((LUA / "manifest.json").read_text())
    assert set(manifest) == {"scripts"}
    for name, entry in manifest["scripts"].items():
        assert set(entry) == {"sha1", "version"}, name
        assert isinstance(entry["version"], int) and entry["version"] >= 1, name
        assert len(entry["sha1"]) == 40 and int(entry["sha1"], 16) >= 0, name


def test_the_package_reads_the_same_manifest() -> None:
    """In a checkout, the registry finds lua/ at the top (the wheel test covers installs)."""
    assert lua_dir().resolve() == LUA.resolve()
    assert read_manifest() == json.loads((LUA / "manifest.json").read_text())["scripts"]


# --- scripts/gen_manifest.py, run on a copy of the tree ------------------------------------------


def gen(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(tree / "scripts" / "gen_manifest.py"), *args],
                          cwd=tree, capture_output=True, text=True, timeout=60)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of lua/ and scripts/gen_manifest.py (the script finds lua/ next to its folder),
    its manifest brought in line with the copied files first, so that these tests do not
    depend on the state of the working tree."""
    shutil.copytree(LUA, tmp_path / "lua")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gen_manifest.py", tmp_path / "scripts")
    result = gen(tmp_path, "--force")
    assert result.returncode == 0, result.stderr
    return tmp_path


def manifest_of(tree: Path) -> dict[str, dict[str, object]]:
    return json.loads((tree / "lua" / "manifest.json").read_text())["scripts"]


def test_gen_manifest_is_a_no_op_on_an_unchanged_tree(tree: Path) -> None:
    before = (tree / "lua" / "manifest.json").read_bytes()
    result = gen(tree)
    assert result.returncode == 0, result.stderr
    assert (tree / "lua" / "manifest.json").read_bytes() == before
    assert set(json.loads(before)["scripts"]) == {p.stem for p in LUA.glob("*.lua")}


def test_gen_manifest_refuses_a_changed_script_with_an_unchanged_version(tree: Path) -> None:
    before = (tree / "lua" / "manifest.json").read_bytes()
    size = tree / "lua" / "size.lua"
    size.write_bytes(size.read_bytes() + b"-- a trailing change\n")

    result = gen(tree)

    version = parse_contract(size.read_text()).version
    assert result.returncode == 1
    assert f"size.lua changed but is still version {version}" in result.stderr
    assert (tree / "lua" / "manifest.json").read_bytes() == before  # nothing written


def test_gen_manifest_accepts_the_change_once_the_version_is_bumped(tree: Path) -> None:
    size = tree / "lua" / "size.lua"
    source = size.read_text()
    version = parse_contract(source).version
    assert f"-- version: {version}\n" in source
    size.write_text(source.replace(f"-- version: {version}\n", f"-- version: {version + 1}\n", 1)
                    + "-- changed\n")

    result = gen(tree)

    assert result.returncode == 0, result.stderr
    entry = manifest_of(tree)["size"]
    assert entry == {"version": version + 1, "sha1": hashlib.sha1(size.read_bytes()).hexdigest()}
    ack = (tree / "lua" / "ack.lua").read_bytes()  # the others are untouched
    assert manifest_of(tree)["ack"]["sha1"] == hashlib.sha1(ack).hexdigest()


def test_gen_manifest_force_records_a_change_without_a_bump(tree: Path) -> None:
    size = tree / "lua" / "size.lua"
    size.write_bytes(size.read_bytes() + b"-- unreleased tweak\n")

    result = gen(tree, "--force")

    assert result.returncode == 0, result.stderr
    assert manifest_of(tree)["size"] == {"version": parse_contract(size.read_text()).version,
                                         "sha1": hashlib.sha1(size.read_bytes()).hexdigest()}


def test_gen_manifest_drops_removed_scripts_and_adds_new_ones(tree: Path) -> None:
    (tree / "lua" / "dead_purge.lua").unlink()
    extra = (LUA / "size.lua").read_text().replace("-- name: size", "-- name: size_copy", 1)
    (tree / "lua" / "size_copy.lua").write_text(extra)

    result = gen(tree)

    assert result.returncode == 0, result.stderr
    names = set(manifest_of(tree))
    assert "dead_purge" not in names
    assert manifest_of(tree)["size_copy"]["version"] == parse_contract(extra).version
    assert names == {p.stem for p in (tree / "lua").glob("*.lua")}


def test_the_changelog_lists_every_script_at_its_version() -> None:
    """The newest release's table (script | previous | this) matches lua/manifest.json, so a
    producer in another language can trust it."""
    text = (ROOT / "CHANGELOG.md").read_text()
    table = text[text.index("| script |"):]
    rows = dict(re.findall(r"^\| (\w+) \| \S+ \| (\d+) \|$", table.split("\n## ")[0], flags=re.MULTILINE))
    manifest = json.loads((ROOT / "lua" / "manifest.json").read_text())["scripts"]
    shipped = {name: str(entry["version"]) for name, entry in manifest.items()}
    assert rows == shipped
