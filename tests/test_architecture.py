"""The package's shape: a protocol layer that never imports kombu, a kombu adapter on it,
no import cycle anywhere (TYPE_CHECKING imports included), and key names built and read
only in the keyspace module."""

from __future__ import annotations

import ast
import gc
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "celery_redis_lua"
KEYSPACE = "celery_redis_lua.protocol.keys"
# Pieces of key names: wherever one appears in a string (a key kind at the start of a string
# or of an f-string part, or after a non-word character), a key name is being made or read.
KEY_PIECE = re.compile(r"(^|[^\w\s])(queue|delayed|messages_index|meta|dead|state|message):|"
                       r"binding:|:groups|/\{")


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = _parse(path)
    return found


def _parse(path: Path) -> ast.Module:
    """ast.parse with the garbage collector held off: on Python 3.11 a finalizer that formats
    a traceback meanwhile (its carets use ast) breaks the parse with "SystemError: AST
    constructor recursion depth mismatch" (CPython gh-106905); CI met it once."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, anywhere in the file (TYPE_CHECKING too)."""
    package = name if name in known and _is_package(name) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets.add(base)
            targets |= {f"{base}.{alias.name}" for alias in node.names}
    return {t for t in targets if t in known and t != name}


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def test_the_package_has_no_import_cycle() -> None:
    found = modules()
    graph = {name: imports(name, tree, set(found)) for name, tree in found.items()}
    # Importing a module imports its package first: that is not an edge of ours.
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        if name in done:
            return
        assert name not in visiting, "import cycle: " + " -> ".join([*visiting[visiting.index(name):], name])
        visiting.append(name)
        for target in sorted(graph[name]):
            visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_protocol_layer_never_imports_kombu() -> None:
    for name, tree in modules().items():
        if not name.startswith("celery_redis_lua.protocol"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(n == "kombu" or n.startswith(("kombu.", "celery")) for n in names), name


def test_no_module_outside_the_keyspace_formats_a_key_name() -> None:
    for name, tree in modules().items():
        if name == KEYSPACE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and not _docstring(tree, node):
                assert not KEY_PIECE.search(node.value), \
                    f"{name}:{node.lineno} builds or reads a key name: {node.value!r}"


def _docstring(tree: ast.Module, node: ast.Constant) -> bool:
    """Docstrings and comments may name keys; code may not."""
    for owner in ast.walk(tree):
        body = getattr(owner, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and body[0].value is node:
            return True
    return False


# The three layers, bottom up; each imports only from the layers below it (and itself).
LAYERS = ("celery_redis_lua.protocol", "celery_redis_lua.kombu", "celery_redis_lua.tools")
# At the package root: only what names the layers' public parts (the import paths users type).
ROOT_MODULES = {"celery_redis_lua", "celery_redis_lua.__main__"}


def _layer(name: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if name == layer or name.startswith(layer + ".")), None)


def test_every_module_is_in_one_of_the_three_layers() -> None:
    assert {name for name in modules() if _layer(name) is None} == ROOT_MODULES


def test_the_layers_import_downward_only() -> None:
    found = modules()
    upward = []
    for name, tree in found.items():
        level = _layer(name)
        if level is None:
            continue
        for target in imports(name, tree, set(found)):
            if (_layer(target) or 0) > level:
                upward.append(f"{name} imports {target}")
    assert upward == []


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60  # issue 42 §2


def test_no_module_is_over_400_lines_and_no_function_over_60() -> None:
    """A module a reader holds in mind at once, a function seen whole: the offenders by
    path:name and length (methods and nested functions included)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if (count := len(text.splitlines())) > MAX_MODULE_LINES:
            long.append(f"{where} ({count} lines)")
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{where}:{node.name} ({length} lines)")
    assert long == [], f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: {long}"
