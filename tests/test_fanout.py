"""Fanout streams at the script level.

fanout_publish: XADD of payload and routing key, MAXLEN ~ trimming, optional expiry (of
the stream and of the groups record beside it), order kept. fanout_unbind: a deleted or
unbound queue's consumer group goes, with its record. fanout_leave: one consumer leaves a
queue's group, the group and its other consumers stay.
"""

from __future__ import annotations

import dataclasses

import pytest
from redis.crc import key_slot

from celery_redis_lua import Deleted, ScriptLibrary
from conftest import Target

FANOUT_PREFIX = "/0."


@pytest.fixture
def lib(lib: ScriptLibrary) -> ScriptLibrary:
    """conftest's ``lib`` with the transport's fanout stream names (``<prefix>/0.<exchange>``)."""
    return ScriptLibrary(lib.client, dataclasses.replace(lib.keys, fanout_prefix=FANOUT_PREFIX), lib.policy)


def entries(lib: ScriptLibrary, stream: str) -> list[tuple[str, dict[bytes, bytes]]]:
    return [(entry_id.decode(), fields) for entry_id, fields in lib.client.xrange(stream)]


def test_fanout_publish_appends_payload_entries_in_order(lib: ScriptLibrary) -> None:
    exchange = "broadcast"
    stream = lib.keys.fanout(exchange)
    ids = [lib.fanout_publish(exchange, f"message {i}", routing_key=f"rk{i}") for i in range(5)]
    ids.append(lib.fanout_publish(exchange, b"\x00binary\xff"))
    stored = entries(lib, stream)
    assert [entry_id for entry_id, _ in stored] == ids
    assert [fields for _, fields in stored] == [
        {b"payload": f"message {i}".encode(), b"routing_key": f"rk{i}".encode()} for i in range(5)
    ] + [{b"payload": b"\x00binary\xff", b"routing_key": b""}]
    assert lib.client.pttl(stream) == -1  # no expiry unless asked


def test_fanout_stream_is_trimmed_to_about_maxlen(lib: ScriptLibrary) -> None:
    exchange = "trimmed"
    stream = lib.keys.fanout(exchange)
    total, maxlen = 1_000, 100
    replies = lib.run_many([lib.calls.fanout_publish(exchange, f"m{i}", maxlen=maxlen)
                            for i in range(total)])
    assert len(set(replies)) == total
    length = lib.client.xlen(stream)
    # '~' trims whole radix-tree nodes: never below maxlen, but far below what was added.
    assert maxlen <= length < 300
    stored = entries(lib, stream)
    # What survives is the newest entries, in publish order.
    assert [fields[b"payload"].decode() for _, fields in stored] == [
        f"m{i}" for i in range(total - length, total)]
    assert [entry_id for entry_id, _ in stored] == replies[total - length:]


def test_maxlen_larger_than_the_stream_keeps_everything(lib: ScriptLibrary) -> None:
    exchange = "roomy"
    stream = lib.keys.fanout(exchange)
    lib.run_many([lib.calls.fanout_publish(exchange, f"m{i}", maxlen=10_000) for i in range(300)])
    assert lib.client.xlen(stream) == 300


def test_fanout_expires_sets_and_refreshes_a_ttl(lib: ScriptLibrary) -> None:
    client = lib.client
    exchange = "expiring"
    stream = lib.keys.fanout(exchange)
    groups = lib.keys.fanout_groups(stream)
    lib.fanout_publish(exchange, "first", expires_ms=60_000)
    assert 50_000 < client.pttl(stream) <= 60_000
    lib.fanout_bind(exchange, "bound")  # the groups record exists now, without a TTL of its own
    lib.fanout_publish(exchange, "second", expires_ms=600_000)
    assert 590_000 < client.pttl(stream) <= 600_000
    assert 590_000 < client.pttl(groups) <= 600_000  # the record expires with its stream
    assert client.xlen(stream) == 2


def test_fanout_streams_use_the_key_prefix(target: Target, lib: ScriptLibrary) -> None:
    exchange = "ex"
    stream = lib.keys.fanout(exchange)
    assert stream == f"{lib.keys.prefix}/0.ex"
    lib.fanout_publish(exchange, "hello")
    assert target.keys() == {stream.encode()}


def group_names(lib: ScriptLibrary, stream: str) -> list[str]:
    return sorted(group["name"].decode() for group in lib.client.xinfo_groups(stream))


def consumer_names(lib: ScriptLibrary, stream: str, queue: str) -> list[str]:
    return sorted(c["name"].decode() for c in lib.client.xinfo_consumers(stream, queue))


def test_fanout_groups_record_shares_the_streams_slot(lib: ScriptLibrary) -> None:
    exchange = "ex"
    stream = lib.keys.fanout(exchange)
    groups = lib.keys.fanout_groups(stream)
    assert groups.startswith(lib.keys.prefix) and groups != stream
    assert key_slot(groups.encode()) == key_slot(stream.encode())


def test_fanout_unbind_destroys_the_queues_group_only(lib: ScriptLibrary) -> None:
    client, exchange = lib.client, "ex"
    stream = lib.keys.fanout(exchange)
    groups = lib.keys.fanout_groups(stream)
    assert lib.fanout_bind(exchange, "gone", expires_ms=60_000).created is True
    assert lib.fanout_bind(exchange, "stays").created is True
    lib.fanout_publish(exchange, "before")
    assert [p for _, _, p in lib.fanout_consume(exchange, "stays", "w1").entries] == [b"before"]
    assert group_names(lib, stream) == ["gone", "stays"]

    assert lib.fanout_unbind(exchange, "gone") is True

    assert group_names(lib, stream) == ["stays"]
    assert sorted(client.hkeys(groups)) == [b"stays"]  # its record went with it
    lib.fanout_publish(exchange, "after")
    assert [p for _, _, p in lib.fanout_consume(exchange, "stays", "w1").entries] == [b"after"]
    assert client.xlen(stream) == 2  # the stream and its entries are untouched

    assert lib.fanout_unbind(exchange, "gone") is False  # already gone
    # Bound again, the queue starts at the stream's end: what was sent meanwhile is not its.
    assert lib.fanout_bind(exchange, "gone").created is True
    assert lib.fanout_consume(exchange, "gone", "w1").entries == []


def test_fanout_unbind_without_a_stream_is_a_no_op(target: Target, lib: ScriptLibrary) -> None:
    assert lib.fanout_unbind("never", "q") is False
    assert target.keys() == set()


def test_delete_names_the_fanout_exchanges_its_declares_recorded(target: Target, lib: ScriptLibrary) -> None:
    """A fanout binding is recorded with the queue (its slot), so delete can name the
    exchanges whose groups must go: on a cluster they are in other slots, so the caller
    removes each with fanout_unbind, a second call."""
    lib.declare("fq", expires_ms=600_000)
    lib.publish("fq", "held")
    for exchange in ("ex-a", "ex-b"):
        assert lib.declare("fq", fanout_exchange=exchange).expires_ms == 600_000  # arguments kept
        lib.fanout_bind(exchange, "fq")
    assert lib.declare("fq", fanout_exchange="ex-a").ready == 1  # recorded once however often bound
    lib.fanout_bind("ex-a", "stays")

    deleted = lib.delete("fq")

    assert (deleted.messages, sorted(deleted.fanout_exchanges)) == (1, ["ex-a", "ex-b"])
    assert [lib.fanout_unbind(exchange, "fq") for exchange in deleted.fanout_exchanges] == [True, True]
    assert group_names(lib, lib.keys.fanout("ex-a")) == ["stays"]
    assert group_names(lib, lib.keys.fanout("ex-b")) == []
    assert lib.fanout_unbind("ex-a", "fq") is False  # the second call is idempotent
    # Declared again, the queue has no record of the old bindings.
    lib.declare("fq")
    assert lib.delete("fq").fanout_exchanges == ()


def test_delete_of_a_queue_never_fanout_bound_names_no_exchange(target: Target, lib: ScriptLibrary) -> None:
    lib.declare("plain", max_priority=3)
    lib.publish("plain", "m")
    assert lib.delete("plain") == Deleted(1)
    assert lib.delete("plain") == Deleted(0)  # nothing left, and nothing created
    assert target.keys() == set()


def test_fanout_leave_removes_one_consumer(lib: ScriptLibrary) -> None:
    exchange = "ex"
    stream = lib.keys.fanout(exchange)
    lib.fanout_bind(exchange, "q")
    lib.fanout_bind(exchange, "other")
    # Each reads something (Redis 7.0 makes a consumer only on a read that returns entries).
    lib.fanout_publish(exchange, "m1")
    assert [p for _, _, p in lib.fanout_consume(exchange, "q", "w1").entries] == [b"m1"]
    lib.fanout_publish(exchange, "m2")
    assert [p for _, _, p in lib.fanout_consume(exchange, "q", "w2").entries] == [b"m2"]
    assert len(lib.fanout_consume(exchange, "other", "w1").entries) == 2
    assert consumer_names(lib, stream, "q") == ["w1", "w2"]

    assert lib.fanout_leave(exchange, "q", "w1") is True

    assert consumer_names(lib, stream, "q") == ["w2"]
    assert consumer_names(lib, stream, "other") == ["w1"]  # another queue's consumer of that name
    assert group_names(lib, stream) == ["other", "q"]
    # The group keeps its place: the next entry is delivered once, to whoever reads next.
    lib.fanout_publish(exchange, "m3")
    assert [p for _, _, p in lib.fanout_consume(exchange, "q", "w2").entries] == [b"m3"]
    assert lib.fanout_consume(exchange, "q", "w1").entries == []

    assert lib.fanout_leave(exchange, "q", "nobody") is False
    assert lib.fanout_leave(exchange, "unbound", "w1") is False  # no such group
    assert lib.fanout_leave("never", "q", "w1") is False  # no stream
