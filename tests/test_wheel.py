"""The wheel carries the Lua scripts inside the package, an installed wheel finds them, and
the wheel holds only what runs in production.

Builds the wheel, installs it into a fresh venv outside the source tree (no
PYTHONPATH, no editable install, cwd elsewhere), and runs publish + consume
through the installed package against a throwaway server. The development tools
(scripts/: the throwaway servers, the doc generator, the harnesses) stay out of it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import id_microseconds, is_message_id
from scripts.servers import Server

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "celery_redis_lua"
# What runs in production: the package (its three layers: protocol/, kombu/ and the operator's
# tools/, and the scripts in lua/) and the two files that register the URL schemes where
# nothing imports it.
PRODUCTION_FILES = {"celery_redis_lua/__init__.py", "celery_redis_lua/__main__.py",
                    "_celery_redis_lua_alias.py", "celery_redis_lua_alias.pth",
                    "celery_redis_lua/py.typed"}  # PEP 561: type checkers read the package's annotations
PRODUCTION_DIRS = ("celery_redis_lua/protocol/", "celery_redis_lua/kombu/", "celery_redis_lua/tools/",
                   "celery_redis_lua/lua/")
DEVELOPMENT_ONLY = {"servers.py", "docgen.py"}


def in_production(name: str) -> bool:
    return name in PRODUCTION_FILES or name.startswith(PRODUCTION_DIRS)


PROBE = r"""
import importlib.metadata, importlib.util, json, sys, sysconfig
from pathlib import Path
import celery_redis_lua
from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.contract import load_scripts, lua_dir, read_manifest
import redis

client = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))
lib = ScriptLibrary(client, Keyspace("wheel:"), visibility_ms=60_000)

def now_ms():
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000

before = now_ms()
message_id = lib.publish("wheel-q", "from the installed wheel", priority=9)
after = now_ms()
consumed = lib.consume(["wheel-q"], 10)
print(json.dumps({
    "package": celery_redis_lua.__file__,
    "lua_dir": str(lua_dir()),
    "purelib": sysconfig.get_paths()["purelib"],
    "scripts": sorted(load_scripts()),
    "manifest": read_manifest(),
    "id": message_id,
    "published_between": [before, after],
    "deliveries": [[d.queue, d.id, d.delivery_count, d.payload.decode()] for d in consumed.deliveries],
    "installed": sorted(str(f) for f in importlib.metadata.files("celery-redis-lua")),
    "typed": (Path(celery_redis_lua.__file__).parent / "py.typed").is_file(),
    "dev_modules": [name for name in ("celery_redis_lua.servers", "celery_redis_lua.docgen", "scripts")
                    if importlib.util.find_spec(name) is not None],
}))
"""


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{command[:4]} failed:\n{result.stdout}\n{result.stderr}"
    return result


def build_wheel(out: Path) -> Path:
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)], cwd=ROOT)
    wheels = list(out.glob("celery_redis_lua-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def install(venv: Path, wheel: Path) -> None:
    """The wheel with its dependencies, pinned to the versions of this environment so
    that pip's cache serves them (the package imports kombu to register its URL scheme)."""
    python = str(venv / "bin" / "python")
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in ("redis", "kombu", "celery")]
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-input",
         "--disable-pip-version-check", str(wheel), *pins])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


def test_wheel_carries_every_script_byte_for_byte(wheel: Path) -> None:
    sources = {p.name: p.read_bytes() for p in (ROOT / "lua").iterdir()
               if p.suffix == ".lua" or p.name == "manifest.json"}
    with zipfile.ZipFile(wheel) as archive:
        packaged = {Path(n).name: archive.read(n) for n in archive.namelist()
                    if n.startswith("celery_redis_lua/lua/")}
        assert "celery_redis_lua/__init__.py" in archive.namelist()
    assert packaged == sources


def test_wheel_holds_only_what_runs_in_production(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("celery_redis_lua-"), dist_info
    shipped = [n for n in names if n.split("/")[0] not in dist_info]
    assert [n for n in shipped if not in_production(n)] == []
    assert "celery_redis_lua/py.typed" in shipped, "no py.typed: checkers would ignore the annotations"
    assert set(shipped) >= PRODUCTION_FILES
    assert not [n for n in shipped if Path(n).name in DEVELOPMENT_ONLY]
    assert not [n for n in shipped if n.startswith("scripts/") or "/scripts/" in n]
    # protocol/ and kombu/ are exactly the modules of the source tree, nothing else.
    layers = {n for n in shipped if n.startswith(PRODUCTION_DIRS[:2])}
    sources = {f"celery_redis_lua/{p.relative_to(PACKAGE).as_posix()}"
               for layer in ("protocol", "kombu") for p in (PACKAGE / layer).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert layers == sources
    assert {"celery_redis_lua/protocol/__init__.py", "celery_redis_lua/kombu/__init__.py"} <= layers


def test_installed_wheel_runs_scripts_from_inside_the_package(wheel: Path, tmp_path: Path) -> None:
    assert ROOT not in tmp_path.parents
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    install(venv, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}

    with Server("valkey") as server:
        result = run([str(venv / "bin" / "python"), "-c", PROBE, str(server.port)], cwd=tmp_path, env=env)
        report = json.loads(result.stdout)

    purelib = Path(report["purelib"])
    assert purelib.is_relative_to(venv)
    assert Path(report["package"]).is_relative_to(purelib)
    assert Path(report["lua_dir"]) == purelib / "celery_redis_lua" / "lua"
    assert not Path(report["lua_dir"]).resolve().is_relative_to(ROOT)
    assert report["scripts"] == sorted(p.stem for p in (ROOT / "lua").glob("*.lua"))
    assert report["manifest"] == json.loads((ROOT / "lua" / "manifest.json").read_text())["scripts"]
    # The queue's first id: 13 hex digits of the server's microseconds at publish, counter 0.
    before, after = report["published_between"]
    assert is_message_id(report["id"]) and report["id"].endswith("0")
    assert before * 1000 <= id_microseconds(report["id"]) <= (after + 1) * 1000
    assert report["deliveries"] == [["wheel-q", report["id"], 0, "from the installed wheel"]]
    # Installed, too, the package is only what runs in production: no development tools.
    installed = [f for f in report["installed"] if not f.startswith("../")  # the console script
                 and ".dist-info/" not in f and "__pycache__" not in f]
    assert installed and [f for f in installed if not in_production(f)] == []
    assert not [f for f in report["installed"] if Path(f).name in DEVELOPMENT_ONLY]
    assert report["dev_modules"] == []
    # PEP 561: the installed package is typed, so checkers read its annotations.
    assert report["typed"]
