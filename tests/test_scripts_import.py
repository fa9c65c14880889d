"""Every module of scripts/ imports (the harnesses are not run by the default suite, so a
rename or a moved API must break here, not at the next benchmark or chaos run)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
MODULES = sorted(".".join(p.relative_to(SCRIPTS.parent).with_suffix("").parts).removesuffix(".__init__")
                 for p in SCRIPTS.rglob("*.py"))
OPTIONAL = {"hdrh", "matplotlib"}  # the bench extra (make bench-all installs it)


@pytest.mark.parametrize("module", MODULES)
def test_script_module_imports(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The demo's Celery app reads its broker from the environment the demo gives its workers
    # (nothing connects at import).
    monkeypatch.setenv("DEMO_BROKER_URL", "redislua://127.0.0.1:1/0")
    monkeypatch.setenv("DEMO_LEDGER_URL", "redis://127.0.0.1:1/0")
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name in OPTIONAL:
            pytest.skip(f"{module} needs {error.name} (pip install -e '.[bench]')")
        raise
