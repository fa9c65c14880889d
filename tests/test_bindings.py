"""Bindings: stale-at scores by the server's clock, lookup prunes stale members, table TTL.

A binding table is ``P binding:<exchange>``, a ZSET of
``routing_key SEP pattern SEP queue`` scored with the unix ms at which the binding goes
stale (``+inf`` for queues without expiry, else now + the lifetime the caller gives: the
script takes it as it is, and the transport is the one that floors it). The table key
expires with its stalest member, or never when some member lives forever.
"""

from __future__ import annotations

import dataclasses
import math

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.protocol.keys import Binding
from helpers import server_now_ms, wait_for_server_time

SEP = "\x06\x16"


def member(routing_key: str, pattern: str, queue: str, sep: str = SEP) -> str:
    return Keyspace(separator=sep).binding_member(routing_key, pattern, queue)


def test_the_default_separator_is_kombus() -> None:
    assert Keyspace().separator == SEP
    assert member("rk", "p", "q") == f"rk{SEP}p{SEP}q"
    assert Keyspace().parse_binding(member("rk", "p", "q").encode()) == Binding("rk", "p", "q")


def test_bind_with_lifetime_scores_stale_at_by_server_time(lib: ScriptLibrary) -> None:
    client, table = lib.client, lib.keys.binding("ex")
    before = server_now_ms(client)
    assert lib.bind("ex", [member("rk", "", "long")], lifetime_ms=400_000) == 1
    assert lib.bind("ex", [member("rk", "", "short")], lifetime_ms=1_000) == 1
    after = server_now_ms(client)

    long_score = client.zscore(table, member("rk", "", "long"))
    short_score = client.zscore(table, member("rk", "", "short"))
    assert before + 400_000 <= long_score <= after + 400_000
    # Short lifetimes are kept as given: bind has no floor of its own (the caller has one).
    assert before + 1_000 <= short_score <= after + 1_000
    assert client.pexpiretime(table) == int(long_score)


def test_a_short_lifetime_goes_stale_when_it_says(lib: ScriptLibrary) -> None:
    client, table = lib.client, lib.keys.binding("brief")
    assert lib.bind("brief", [member("rk", "", "q")], lifetime_ms=200) == 1
    stale_at = int(client.zscore(table, member("rk", "", "q")))
    assert lib.lookup("brief") == [("rk", "", "q")]
    wait_for_server_time(client, stale_at + 1)
    assert lib.lookup("brief") == []
    assert client.exists(table) == 0


def test_rebinding_refreshes_the_score_and_counts_nothing_new(lib: ScriptLibrary) -> None:
    client, table = lib.client, lib.keys.binding("ex")
    m = member("rk", "", "q")
    assert lib.bind("ex", [m], lifetime_ms=1_000) == 1
    first = client.zscore(table, m)
    before = server_now_ms(client)
    assert lib.bind("ex", [m], lifetime_ms=600_000) == 0
    assert client.zscore(table, m) >= before + 600_000 > first
    assert client.zcard(table) == 1


def test_bind_without_lifetime_is_forever_and_table_has_no_ttl(lib: ScriptLibrary) -> None:
    client, table = lib.client, lib.keys.binding("forever")
    assert lib.bind("forever", [member("a", "", "q1"), member("b", "", "q2")]) == 2
    assert client.zscore(table, member("a", "", "q1")) == math.inf
    assert client.zscore(table, member("b", "", "q2")) == math.inf
    assert client.pttl(table) == -1


def test_table_ttl_follows_the_stalest_member(lib: ScriptLibrary) -> None:
    client, table = lib.client, lib.keys.binding("ttl")
    lib.bind("ttl", [member("rk", "", "a")], lifetime_ms=400_000)
    lib.bind("ttl", [member("rk", "", "b")], lifetime_ms=1_000)  # stale long before a
    a_score = client.zscore(table, member("rk", "", "a"))
    assert client.pexpiretime(table) == int(a_score)

    lib.bind("ttl", [member("rk", "", "b")], lifetime_ms=900_000)  # b is now the stalest
    b_score = client.zscore(table, member("rk", "", "b"))
    assert b_score > a_score
    assert client.pexpiretime(table) == int(b_score)

    lib.bind("ttl", [member("rk", "", "c")])  # a member that never goes stale
    assert client.pttl(table) == -1

    lib.unbind("ttl", [member("rk", "", "c")])
    lib.bind("ttl", [member("rk", "", "a")], lifetime_ms=400_000)  # any bind sets it again
    assert client.pexpiretime(table) == int(b_score)


def test_lookup_splits_members_on_sep(lib: ScriptLibrary) -> None:
    members = [member("tasks", "", "celery"), member("", "#", "events"), member("a.b", "a.*", "q")]
    lib.bind("ex", members)
    found = lib.lookup("ex")
    assert sorted(found) == sorted(
        [("tasks", "", "celery"), ("", "#", "events"), ("a.b", "a.*", "q")])
    assert all(type(binding) is Binding for binding in found)

    piped = ScriptLibrary(lib.client, dataclasses.replace(lib.keys, separator="|"), lib.policy)
    piped.bind("pipe", [member("rk", "p", "q", sep="|")])
    assert piped.lookup("pipe") == [Binding(routing_key="rk", pattern="p", queue="q")]
    assert lib.lookup("nothing-bound") == []


def test_lookup_drops_and_prunes_stale_members(lib: ScriptLibrary) -> None:
    client, table = lib.client, lib.keys.binding("ex")
    live, forever, stale = member("rk", "", "live"), member("rk", "", "forever"), member("rk", "", "old")
    lib.bind("ex", [live, stale], lifetime_ms=400_000)
    lib.bind("ex", [forever])
    # Test setup: make one member stale by giving it a stale-at time in the past.
    client.zadd(table, {stale: server_now_ms(client) - 1_000})

    assert sorted(lib.lookup("ex")) == [("rk", "", "forever"), ("rk", "", "live")]
    assert client.zscore(table, stale) is None  # pruned, not just hidden
    assert client.zscore(table, live) is not None
    assert client.zcard(table) == 2


def test_lookup_of_only_stale_members_leaves_no_table(lib: ScriptLibrary) -> None:
    client, table = lib.client, lib.keys.binding("ex")
    lib.bind("ex", [member("rk", "", "a"), member("rk", "", "b")], lifetime_ms=400_000)
    past = server_now_ms(client) - 1
    client.zadd(table, {member("rk", "", "a"): past, member("rk", "", "b"): past})
    assert lib.lookup("ex") == []
    assert client.exists(table) == 0


def test_unbind_removes_members(lib: ScriptLibrary) -> None:
    client, table = lib.client, lib.keys.binding("ex")
    a, b = member("rk", "", "a"), member("rk", "", "b")
    lib.bind("ex", [a, b], lifetime_ms=400_000)
    assert lib.unbind("ex", [a]) == 1
    assert lib.lookup("ex") == [("rk", "", "b")]
    assert lib.unbind("ex", [a]) == 0  # already gone
    assert lib.unbind("ex", [b]) == 1
    assert lib.lookup("ex") == []
    assert client.exists(table) == 0


def test_bindings_of_different_exchanges_are_separate(lib: ScriptLibrary) -> None:
    lib.bind("one", [member("rk", "", "q1")])
    lib.bind("two", [member("rk", "", "q2")], lifetime_ms=400_000)
    assert lib.lookup("one") == [("rk", "", "q1")]
    assert lib.lookup("two") == [("rk", "", "q2")]
    assert lib.client.exists(lib.keys.binding("one"), lib.keys.binding("two")) == 2
