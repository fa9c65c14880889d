"""The kombu adapter stays small (issue 31): it grew a mechanism per speed-up once, and the
promises broke in the seams between them. What is not about kombu lives in protocol/."""

from __future__ import annotations

import ast
from pathlib import Path

ADAPTER = Path(__file__).resolve().parents[1] / "python" / "celery_redis_lua" / "kombu"
# 2,400 until sharded queues (issue 41 §3): their kombu hooks (a logical queue's declare,
# publish, consume order, size, purge and delete over its shards: kombu/sharding.py, 75 lines)
# are kombu's by nature; the shard map, picker and turns went to protocol/shardmap.py.
# 2,475 with confirm_together() (issue 41 §1): the channel hands a block's publishes to it and
# publishes again, on a connection of its own, what a stale route refused (kombu/routes.py,
# 30 lines); the block itself is protocol/together.py.
MAX_LINES, MAX_CHANNEL_LINES, MAX_FUNCTION_LINES = 2475, 450, 60


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_adapter_is_at_most_2475_lines_and_channel_py_450() -> None:
    sizes = {p.name: lines(p) for p in ADAPTER.glob("*.py")}
    assert sum(sizes.values()) <= MAX_LINES, sizes
    assert sizes["channel.py"] <= MAX_CHANNEL_LINES


def test_no_function_of_the_adapter_is_over_60_lines() -> None:
    long = [f"{p.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in sorted(ADAPTER.glob("*.py"))
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
