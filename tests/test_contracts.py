"""Every script's header is a complete contract, and the typed operations honour it.

The header (name, version, KEYS with Redis types, ARGV, returns, errors, why)
is parsed by celery_redis_lua.protocol.contract.parse_contract; here we check that each
script has all of it, the shebang flags the design asks for, that every script has
exactly one operation in celery_redis_lua.protocol.ops (bound on ScriptLibrary unless the
library loops it), and that every operation passes the number of KEYS and ARGV the header
declares (and that the server agrees, by running each operation's Call).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redis_lua import Call, Dedup, Keyspace, Limits, Policy, ScriptLibrary
from celery_redis_lua.protocol import ops
from celery_redis_lua.protocol.contract import Contract, parse_contract
from celery_redis_lua.protocol.library import LOOPED
from celery_redis_lua.protocol.ops import OPERATIONS
from helpers import is_message_id

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("lua/*.lua"))
NAMES = [p.stem for p in SCRIPTS]
ARGV_CHECKED = NAMES
REDIS_TYPES = {"ZSET", "HASH", "STREAM", "STRING", "LIST", "SET"}
FREES_MEMORY = {"ack", "reject", "delete", "purge", "sweep", "unbind", "lookup", "dead_purge", "cancel",
                "fanout_unbind", "fanout_leave"}
READ_ONLY = {"size", "stats", "metrics", "dead_list", "exists", "locate"}
# Every script that works on a queue's messages takes the same eight keys per queue.
QUEUE_SCRIPTS = {"publish", "consume", "unpop", "ack", "reject", "extend", "sweep",
                 "declare", "purge", "delete", "stats", "metrics", "dead_replay", "locate", "cancel",
                 "pause", "resume", "limit"}
QUEUE_KEY_NAMES = ["queue", "delayed", "index", "meta", "dead", "message", "state", "wake"]
QUEUE_KEY_PATTERNS = ["P queue:{Q}", "P delayed:{Q}", "P messages_index:{Q}", "P meta:{Q}",
                      "P dead:{Q}", "P message:{Q}", "P state:{Q}", "P wake:{Q}"]


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
        "publish", "consume", "ack", "reject", "extend", "sweep", "bind", "unbind",
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
def test_queue_scripts_take_the_same_eight_keys(name: str) -> None:
    c = contract(name)
    assert [k.name for k in c.keys] == QUEUE_KEY_NAMES
    assert [k.pattern for k in c.keys] == QUEUE_KEY_PATTERNS
    assert [k.type for k in c.keys] == ["ZSET", "ZSET", "ZSET", "HASH", "STREAM", "HASH", "HASH", "LIST"]
    assert c.keys_per_queue == (name in {"consume", "sweep", "stats", "metrics"})


def test_no_script_takes_a_message_key_prefix_any_more() -> None:
    """Messages live in the queue's own hashes: no script builds a key from an ARGV."""
    for name in NAMES:
        assert "message_key_prefix" not in [a.name for a in contract(name).argv], name


# --- the typed operations -----------------------------------------------------------------------

KS = Keyspace("app:", fanout_prefix="/0.")  # the transport's fanout stream names (db 0)
POLICY = Policy(visibility_ms=30_000, delivery_limit=3, dead_letter_maxlen=10)
POLICY_ARGV = {"visibility_ms": 30_000, "delivery_limit": 3, "dead_letter_maxlen": 10}  # ARGV names
IDS = ["0000000000000001", "0000000000000002"]
QUEUES = ["wq1", "wq2"]


def sample_calls() -> dict[str, tuple[Call[Any], int]]:
    """One Call per operation of ops.OPERATIONS (keyed by the operation's name) with sample
    arguments under a sample Policy, and how many queues it covers."""
    k, p = KS, POLICY
    built = {
        "publish": (ops.publish(k, p, "wq1", "payload", priority=3, route=("ex", 1_700_000_000_000),
                               dedup=Dedup("d1", "throttle", 1000), fairness_key="tenant"), 1),
        "consume": (ops.consume(k, p, QUEUES, 2), 2),
        "unpop": (ops.unpop(k, p, "wq1"), 1),
        "pause": (ops.pause(k, p, "wq1", "sample"), 1),
        "resume": (ops.resume(k, p, "wq1"), 1),
        "limit": (ops.limit(k, p, "wq1", in_flight=5, rate="20/s"), 1),
        "ack": (ops.ack(k, p, "wq1", IDS), 1),
        "reject": (ops.reject(k, p, "wq1", IDS, requeue=True), 1),
        "extend": (ops.extend(k, p, "wq1", IDS), 1),
        "sweep": (ops.sweep(k, p, QUEUES), 2),
        "declare": (ops.declare(k, p, "wq1", expires_ms=60_000, message_ttl_ms=None, max_priority=10,
                               fanout_exchange="ex"), 1),
        "bind": (ops.bind(k, p, "ex", ["rk\x06\x16\x06\x16wq1", "rk2\x06\x16\x06\x16wq2"],
                          lifetime_ms=None), 1),
        "unbind": (ops.unbind(k, p, "ex", ["rk2\x06\x16\x06\x16wq2"]), 1),
        "lookup": (ops.lookup(k, p, "ex"), 1),
        "rerouted": (ops.rerouted(k, p, "wq1", "ex", 1_700_000_000_000), 1),
        "fanout_publish": (ops.fanout_publish(k, p, "ex", "payload", maxlen=100, routing_key="rk"), 1),
        "fanout_bind": (ops.fanout_bind(k, p, "ex", "wq1", expires_ms=60_000), 1),
        "fanout_consume": (ops.fanout_consume(k, p, "ex", "wq1", "worker-1", count=10), 1),
        "fanout_leave": (ops.fanout_leave(k, p, "ex", "wq1", "worker-1"), 1),
        "fanout_unbind": (ops.fanout_unbind(k, p, "ex", "wq1"), 1),
        "exists": (ops.exists(k, p, "wq1"), 1),
        "purge": (ops.purge(k, p, "wq2"), 1),
        "delete": (ops.delete(k, p, "wq2"), 1),
        "size": (ops.size(k, p, "wq1"), 1),
        "stats": (ops.stats(k, p, QUEUES), 2),
        "metrics": (ops.metrics(k, p, QUEUES), 2),
        "locate": (ops.locate(k, p, "wq1", "task-1"), 1),
        "cancel": (ops.cancel(k, p, "wq1", "task-1"), 1),
        "dead_list": (ops.dead_list(k, p, "wq1"), 1),
        "dead_replay": (ops.dead_replay(k, p, "wq1", entry_ids=["1-0", "2-0"]), 1),
        "dead_purge": (ops.dead_purge(k, p, "wq1"), 1),
        "migrated": (ops.migrated(k, p, "wq1", "mark", "task-1"), 1),
    }
    return built


def test_every_script_has_exactly_one_operation_and_every_operation_a_script() -> None:
    assert set(OPERATIONS) == set(NAMES)  # a dict: one operation per name
    assert [op.__name__ for op in OPERATIONS.values()] == list(OPERATIONS)
    assert len(set(map(id, OPERATIONS.values()))) == len(OPERATIONS)  # no operation serves two scripts
    built = sample_calls()
    assert set(built) == set(OPERATIONS)
    for name, (call, _) in built.items():
        assert call.script == name, f"ops.{name} calls the script {call.script!r}"


def test_every_operation_not_looped_is_a_library_method() -> None:
    assert set(LOOPED) <= set(OPERATIONS)
    for name, op in OPERATIONS.items():
        if name in LOOPED:
            assert callable(getattr(ScriptLibrary, name)), name  # the library's own loop
        else:
            assert getattr(ScriptLibrary, name).op is op, name


def test_library_calls_bind_the_keyspace_and_the_policy() -> None:
    """lib.calls.<op>(...) is the operation with the library's keyspace and policy first."""
    lib = ScriptLibrary(None, KS, POLICY)
    built = sample_calls()
    assert lib.calls.reject("wq1", IDS, requeue=True).args == built["reject"][0].args
    assert lib.calls.sweep(QUEUES).args == built["sweep"][0].args
    assert lib.calls.fanout_bind("ex", "wq1", expires_ms=60_000).keys == built["fanout_bind"][0].keys
    with pytest.raises(AttributeError):
        lib.calls.no_such_script  # noqa: B018


@pytest.mark.parametrize("name", ARGV_CHECKED)
def test_operation_passes_the_declared_keys_and_argv(name: str) -> None:
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
    for spec in c.argv:  # the settings come from the Policy, each in its declared place
        if spec.name in POLICY_ARGV:
            assert call.args[spec.position - 1] == POLICY_ARGV[spec.name], (name, spec.name, call.args)
    if name in QUEUE_SCRIPTS:
        names = [KS.queue_of(call.keys[i]) for i in range(0, len(call.keys), len(QUEUE_KEY_NAMES))]
        assert len(names) == queues
        assert list(call.keys) == [k for q in names for k in KS.queue_keys(q)]


def test_every_operation_call_is_accepted_by_the_server(standalone: redis.Redis) -> None:
    """Run each sample Call on a real server: a wrong arity or a bad default is an error reply."""
    lib = ScriptLibrary(standalone, KS, POLICY)
    built = sample_calls()
    results: dict[str, Any] = {}
    # The sample publish carries a cached route; the queue does not exist yet, so the route
    # is refused (all 8 arguments accepted, nothing written); without it, it is stored.
    with pytest.raises(ops.StaleRoute):
        lib.runner.run(built["publish"][0])
    assert standalone.dbsize() == 0
    built["publish"] = (replace(built["publish"][0], args=built["publish"][0].args[:6]), 1)
    for name in built:  # one at a time, in the order above (publish first)
        results[name] = lib.runner.run_many([built[name][0]], raise_on_error=False)[0]
    failed = {name: r for name, r in results.items() if isinstance(r, Exception)}
    assert not failed, failed
    assert is_message_id(results["publish"])
    assert [d.payload for d in results["consume"].deliveries] == [b"payload"]
    assert results["unpop"] == 0  # consume took the message: no token to give back
    assert (results["pause"], results["resume"]) == (True, True)
    assert results["limit"] == Limits(5, "20/s")
    assert results["lookup"] == [("rk", "", "wq1")]
    assert results["fanout_leave"] is True  # fanout_consume made the consumer 'worker-1'
    assert results["fanout_unbind"] is True
    assert [s.queue for s in results["stats"]] == QUEUES
    assert results["delete"] == ops.Deleted(0)
