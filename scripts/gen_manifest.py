#!/usr/bin/env python3
"""Write lua/manifest.json: every script's name, contract version and SHA1 of its exact bytes.

A script whose bytes changed must carry a new contract version: this refuses to
record a new SHA1 under a version the manifest already lists with another SHA1
(``--force`` overrides, for scripts not yet released). tests/test_manifest.py
fails whenever the manifest and the files disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from celery_redis_lua.protocol.contract import Script  # noqa: E402

LUA = ROOT / "lua"
MANIFEST = LUA / "manifest.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true",
                        help="allow a changed script to keep its version (unreleased work only)")
    options = parser.parse_args()

    old = json.loads(MANIFEST.read_text())["scripts"] if MANIFEST.exists() else {}
    scripts = {}
    problems = []
    for path in sorted(LUA.glob("*.lua")):
        script = Script.from_file(path)
        entry = {"version": script.contract.version, "sha1": script.sha1}
        previous = old.get(script.name)
        if (previous and previous["version"] == entry["version"]
                and previous["sha1"] != entry["sha1"] and not options.force):
            problems.append(f"{path.name} changed but is still version {entry['version']}: "
                            "bump '-- version:' in its header")
        scripts[script.name] = entry
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    MANIFEST.write_text(json.dumps({"scripts": scripts}, indent=2, sort_keys=True) + "\n")
    print(f"wrote {MANIFEST.relative_to(ROOT)} ({len(scripts)} scripts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
