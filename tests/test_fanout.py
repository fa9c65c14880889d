"""Fanout publish: XADD of payload and routing key, MAXLEN ~ trimming, optional expiry, order kept."""

from __future__ import annotations

from celery_redis_lua import ScriptLibrary, calls
from conftest import Target

FANOUT_PREFIX = "/0."


def entries(lib: ScriptLibrary, stream: str) -> list[tuple[str, dict[bytes, bytes]]]:
    return [(entry_id.decode(), fields) for entry_id, fields in lib.client.xrange(stream)]


def test_fanout_publish_appends_payload_entries_in_order(lib: ScriptLibrary) -> None:
    stream = lib.keys.fanout("broadcast", FANOUT_PREFIX)
    ids = [lib.fanout_publish(stream, f"message {i}", routing_key=f"rk{i}") for i in range(5)]
    ids.append(lib.fanout_publish(stream, b"\x00binary\xff"))
    stored = entries(lib, stream)
    assert [entry_id for entry_id, _ in stored] == ids
    assert [fields for _, fields in stored] == [
        {b"payload": f"message {i}".encode(), b"routing_key": f"rk{i}".encode()} for i in range(5)
    ] + [{b"payload": b"\x00binary\xff", b"routing_key": b""}]
    assert lib.client.pttl(stream) == -1  # no expiry unless asked


def test_fanout_stream_is_trimmed_to_about_maxlen(lib: ScriptLibrary) -> None:
    stream = lib.keys.fanout("trimmed", FANOUT_PREFIX)
    total, maxlen = 1_000, 100
    replies = lib.run_many([calls.fanout_publish(stream, f"m{i}", maxlen=maxlen) for i in range(total)])
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
    stream = lib.keys.fanout("roomy", FANOUT_PREFIX)
    lib.run_many([calls.fanout_publish(stream, f"m{i}", maxlen=10_000) for i in range(300)])
    assert lib.client.xlen(stream) == 300


def test_fanout_expires_sets_and_refreshes_a_ttl(lib: ScriptLibrary) -> None:
    client = lib.client
    stream = lib.keys.fanout("expiring", FANOUT_PREFIX)
    lib.fanout_publish(stream, "first", expires_ms=60_000)
    assert 50_000 < client.pttl(stream) <= 60_000
    lib.fanout_publish(stream, "second", expires_ms=600_000)
    assert 590_000 < client.pttl(stream) <= 600_000
    assert client.xlen(stream) == 2


def test_fanout_streams_use_the_key_prefix(target: Target, lib: ScriptLibrary) -> None:
    stream = lib.keys.fanout("ex", FANOUT_PREFIX)
    assert stream == f"{lib.keys.prefix}/0.ex"
    lib.fanout_publish(stream, "hello")
    assert target.keys() == {stream.encode()}
