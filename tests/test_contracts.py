"""Every script's header is a complete contract, and the typed wrappers honour it.

The header (name, version, KEYS with Redis types, ARGV, returns, errors, why)
is parsed by celery_redis_lua.scripts.parse_contract; here we check that each
script has all of it, the shebang flags the design asks for, and that every
wrapper in celery_redis_lua.calls passes the number of KEYS and ARGV the header
declares (and that the server agrees, by running each wrapper's Call).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redis_lua import Keyspace, ScriptLibrary, calls
from celery_redis_lua.scripts import Call, Contract, parse_contract

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("lua/*.lua"))
NAMES = [p.stem for p in SCRIPTS]
ARGV_CHECKED = NAMES
REDIS_TYPES = {"ZSET", "HASH", "STREAM", "STRING", "LIST", "SET"}
FREES_MEMORY = {"ack", "reject", "delete", "purge", "sweep", "unbind", "lookup", "dead_purge",
                "fanout_unbind", "fanout_leave"}
READ_ONLY = {"size", "stats", "dead_list", "exists"}
# Every script that works on a queue's messages takes the same seven keys per queue.
QUEUE_SCRIPTS = {"publish", "consume", "claim", "unpop", "ack", "reject", "extend", "sweep",
                 "declare", "purge", "delete", "stats", "dead_replay"}
QUEUE_KEY_NAMES = ["queue", "delayed", "index", "meta", "dead", "message", "state"]
QUEUE_KEY_PATTERNS = ["P queue:{Q}", "P delayed:{Q}", "P messages_index:{Q}", "P meta:{Q}",
                      "P dead:{Q}", "P message:{Q}", "P state:{Q}"]


def contract(name: str) -> Contract:
    return parse_contract((ROOT / "lua" / f"{name}.lua").read_text())


def header_section(name: str, section: str) -> list[str]:
    """The raw comment lines of one header section (to see lines the parser would skip)."""
    lines: list[str] = []
    inside = False
    for line in (ROOT / "lua" / f"{name}.lua").read_text().splitlines()[1:]:
        if not line.startswith("--"):
            break
        text = line[2:].strip()
        if re.match(r"^[A-Za-z_]+:", line[3:] if line.startswith("-- ") else ""):
            inside = text.startswith(f"{section}:")
            continue
        if inside and text:
            lines.append(text)
    return lines


def test_there_are_scripts_for_every_operation() -> None:
    assert set(NAMES) >= {
        "publish", "consume", "claim", "ack", "reject", "extend", "sweep", "bind", "unbind",
        "lookup", "fanout_publish", "purge", "delete", "size", "stats", "dead_list",
        "dead_replay", "dead_purge", "fanout_bind", "fanout_consume", "exists", "unpop",
        "fanout_unbind", "fanout_leave",
    }


@pytest.mark.parametrize("name", NAMES)
def test_header_is_a_complete_contract(name: str) -> None:
    c = contract(name)
    assert c.name == name
    assert c.version >= 1
    assert c.summary and c.returns and c.why
    assert c.keys, f"{name} declares no KEYS: a cluster client could not route it"
    assert {k.type for k in c.keys} <= REDIS_TYPES, [k.type for k in c.keys]
    assert [a.position for a in c.argv] == list(range(1, len(c.argv) + 1))
    assert all(not a.variadic for a in c.argv[:-1]), "only the last ARGV may be variadic"
    assert c.errors, f"{name} lists no error replies"
    for error in c.errors:
        assert error.startswith(f"ERR celery-redis-lua: {name}: "), error


@pytest.mark.parametrize("name", NAMES)
def test_every_listed_error_line_is_an_error_reply(name: str) -> None:
    """parse_contract keeps only 'ERR ...' lines; nothing else may hide in 'errors:'."""
    raw = header_section(name, "errors")
    assert raw and raw == list(contract(name).errors)


@pytest.mark.parametrize("name", ARGV_CHECKED)
def test_every_argv_line_is_parsed(name: str) -> None:
    """Each 'N  name  type  meaning' line under 'ARGV:' is one ArgSpec: a line the parser
    skips would vanish from the contract (and from docs/scripts.md)."""
    raw = [line for line in header_section(name, "ARGV") if re.match(r"^\d+(\.\.)?\s", line)]
    assert [a.position for a in contract(name).argv] == [int(re.match(r"\d+", line)[0]) for line in raw], raw


@pytest.mark.parametrize("name", NAMES)
def test_shebang_and_flags(name: str) -> None:
    first = (ROOT / "lua" / f"{name}.lua").read_text().splitlines()[0]
    assert re.fullmatch(r"#!lua( flags=[a-z-]+(,[a-z-]+)*)?", first), first
    flags = set(contract(name).flags)
    if name in FREES_MEMORY:
        assert flags == {"allow-oom"}
    elif name in READ_ONLY:
        assert flags == {"no-writes"}
    else:
        assert flags == set(), f"{name} must carry no flags (writes, refused when out of memory)"


@pytest.mark.parametrize("name", sorted(QUEUE_SCRIPTS))
def test_queue_scripts_take_the_same_seven_keys(name: str) -> None:
    c = contract(name)
    assert [k.name for k in c.keys] == QUEUE_KEY_NAMES
    assert [k.pattern for k in c.keys] == QUEUE_KEY_PATTERNS
    assert [k.type for k in c.keys] == ["ZSET", "ZSET", "ZSET", "HASH", "STREAM", "HASH", "HASH"]
    assert c.keys_per_queue == (name in {"consume", "sweep", "stats"})


def test_no_script_takes_a_message_key_prefix_any_more() -> None:
    """Messages live in the queue's own hashes: no script builds a key from an ARGV."""
    for name in NAMES:
        assert "message_key_prefix" not in [a.name for a in contract(name).argv], name


# --- the typed wrappers -------------------------------------------------------------------------

KS = Keyspace("app:")
IDS = ["0000000000000001", "0000000000000002"]
QUEUES = ["wq1", "wq2"]


def sample_calls() -> dict[str, tuple[Call, int]]:
    """One Call per script with sample arguments, and how many queues it covers."""
    vis = 30_000
    built = [
        (calls.publish(KS, "wq1", "payload", priority=3, visibility_ms=vis), 1),
        (calls.consume(KS, QUEUES, count=2, visibility_ms=vis), 2),
        (calls.claim(KS, "wq1", IDS, visibility_ms=vis), 1),
        (calls.unpop(KS, "wq1", [(IDS[0], "2550000000000001"), (IDS[1], 2550000000000002.0)]), 1),
        (calls.ack(KS, "wq1", IDS), 1),
        (calls.reject(KS, "wq1", IDS, requeue=True, delivery_limit=3, dead_letter_maxlen=10,
                      visibility_ms=vis), 1),
        (calls.extend(KS, "wq1", IDS, visibility_ms=vis), 1),
        (calls.sweep(KS, QUEUES, visibility_ms=vis, delivery_limit=3, dead_letter_maxlen=10), 2),
        (calls.declare(KS, "wq1", expires_ms=60_000, message_ttl_ms=None, max_priority=10), 1),
        (calls.bind(KS, "ex", ["rk\x06\x16\x06\x16wq1", "rk2\x06\x16\x06\x16wq2"], lifetime_ms=None), 1),
        (calls.unbind(KS, "ex", ["rk2\x06\x16\x06\x16wq2"]), 1),
        (calls.lookup(KS, "ex", "\x06\x16"), 1),
        (calls.fanout_publish(KS, KS.fanout("ex", "/0."), "payload", maxlen=100, routing_key="rk"), 1),
        (calls.fanout_bind(KS, KS.fanout("ex", "/0."), "wq1", expires_ms=60_000), 1),
        (calls.fanout_consume(KS, KS.fanout("ex", "/0."), "wq1", "worker-1", count=10), 1),
        (calls.fanout_leave(KS, KS.fanout("ex", "/0."), "wq1", "worker-1"), 1),
        (calls.fanout_unbind(KS, KS.fanout("ex", "/0."), "wq1"), 1),
        (calls.exists(KS, "wq1"), 1),
        (calls.purge(KS, "wq2"), 1),
        (calls.delete(KS, "wq2"), 1),
        (calls.size(KS, "wq1"), 1),
        (calls.stats(KS, QUEUES), 2),
        (calls.dead_list(KS, "wq1"), 1),
        (calls.dead_replay(KS, "wq1", visibility_ms=vis, entry_ids=["1-0", "2-0"]), 1),
        (calls.dead_purge(KS, "wq1"), 1),
    ]
    return {call.script: (call, queues) for call, queues in built}


def test_every_script_has_a_wrapper() -> None:
    assert set(sample_calls()) == set(NAMES)


@pytest.mark.parametrize("name", ARGV_CHECKED)
def test_wrapper_passes_the_declared_keys_and_argv(name: str) -> None:
    c = contract(name)
    call, queues = sample_calls()[name]
    if c.keys_per_queue:
        assert len(call.keys) == len(c.keys) * queues
    else:
        assert queues == 1 and len(call.keys) == len(c.keys)
    if c.variadic_argv:
        assert len(call.args) >= c.fixed_argc
    else:
        assert len(call.args) == c.fixed_argc, f"{name}: {call.args!r}"
    assert all(isinstance(a, str | int | float | bytes) for a in call.args)
    if name in QUEUE_SCRIPTS:
        names = [KS.queue_of(call.keys[i]) for i in range(0, len(call.keys), 7)]
        assert len(names) == queues
        assert list(call.keys) == [k for q in names for k in KS.queue_keys(q)]


def test_every_wrapper_call_is_accepted_by_the_server(standalone: redis.Redis) -> None:
    """Run each sample Call on a real server: a wrong arity or a bad default is an error reply."""
    lib = ScriptLibrary(standalone, KS)
    built = sample_calls()
    results: dict[str, Any] = {}
    for name in built:  # one at a time, in the order above (publish first)
        results[name] = lib.runner.run_many([built[name][0]], raise_on_error=False)[0]
    failed = {name: r for name, r in results.items() if isinstance(r, Exception)}
    assert not failed, failed
    assert re.fullmatch(r"[0-9a-f]{16}", results["publish"])
    assert [d.payload for d in results["consume"].deliveries] == [b"payload"]
    assert results["claim"] == calls.Consumed([], None, 0)  # unknown ids: nothing to claim
    assert results["unpop"] == 0  # nor to put back
    assert results["lookup"] == [("rk", "", "wq1")]
    assert results["fanout_leave"] is True  # fanout_consume made the consumer 'worker-1'
    assert results["fanout_unbind"] is True
    assert [s.queue for s in results["stats"]] == QUEUES
    assert results["delete"] == 0
