"""A full server (maxmemory, noeviction) refuses publish before it writes, and still drains.

publish carries no shebang flags, so the server refuses it when used memory is
above maxmemory, before the script runs: nothing is written, not even meta's
``last_id``. ack, purge and sweep carry allow-oom, so they run on a full server and
free memory: they delete fields of the queue's payload and state hashes (``message:{Q}``,
``state:{Q}``), which hold every message of the queue. Each test starts its own small
server (1mb is below Valkey 9's baseline of about 1.1 MB, so the limit here is 4mb) and
fills it with raw strings until the server answers OOM.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from redis.exceptions import OutOfMemoryError

from celery_redis_lua import Keyspace, ScriptLibrary
from conftest import require_kind as require
from helpers import server_now_ms, wait_for_server_time
from scripts.servers import Server

VISIBILITY_MS = 300
PAYLOAD = "p" * 65_536
FREED = 5 * len(PAYLOAD) // 2  # at least half of five payloads (INFO itself moves by ~25 KB)
FILL_CHUNK = b"x" * 16_384


@dataclass
class Full:
    client: redis.Redis
    lib: ScriptLibrary
    published: list[str]
    in_flight: list[str]
    delivered_at_ms: int
    filled: Iterator[int]

    def fill_until_oom(self) -> None:
        """Write raw strings until the server refuses one with OOM."""
        for _ in range(2_000):
            try:
                self.client.set(f"fill:{next(self.filled)}", FILL_CHUNK)
            except OutOfMemoryError:
                return
        raise AssertionError("the server never reported OOM")

    def used_memory(self) -> int:
        return int(self.client.info("memory")["used_memory"])

    def assert_publish_refused(self) -> None:
        """publish is refused with OOM and writes nothing (DBSIZE, last_id, any queue key)."""
        keys = self.lib.keys
        watched = list(keys.queue_keys("q"))
        before = (self.client.dbsize(), self.client.hget(keys.meta("q"), "last_id"),
                  [self.client.dump(k) for k in watched])
        with pytest.raises(OutOfMemoryError, match="maxmemory"):
            self.lib.publish("q", "refused")
        after = (self.client.dbsize(), self.client.hget(keys.meta("q"), "last_id"),
                 [self.client.dump(k) for k in watched])
        assert after == before

    def messages(self) -> tuple[int, int]:
        """How many messages the queue holds: fields of its payload and state hashes."""
        keys = self.lib.keys
        return self.client.hlen(keys.message("q")), self.client.hlen(keys.state("q"))


@pytest.fixture(params=["valkey", "redis"])
def full(request: pytest.FixtureRequest) -> Iterator[Full]:
    """10 messages in queue 'q', 5 of them delivered (in flight, 300 ms visibility)."""
    require(request.param)
    with Server(request.param, args=["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]) as server:
        client = server.client(socket_timeout=10)
        lib = ScriptLibrary(client, Keyspace(), visibility_ms=VISIBILITY_MS)
        published = [lib.publish("q", f"{i}:{PAYLOAD}") for i in range(10)]
        in_flight = [d.id for d in lib.consume(["q"], 5).deliveries]
        delivered_at = server_now_ms(client)
        assert in_flight == published[:5]
        # Valkey 9 allocates 25-50 KB once, on the first HINCRBY it runs (the scripts' drop
        # counters): done here, it does not count against what a drop frees.
        client.hincrby("warm-up", "count", 1)
        yield Full(client, lib, published, in_flight, delivered_at, itertools.count())
        client.close()


def test_publish_is_refused_before_writing_anything(full: Full) -> None:
    last_id = full.published[-1].encode()
    assert full.client.hget(full.lib.keys.meta("q"), "last_id") == last_id
    full.fill_until_oom()
    full.assert_publish_refused()
    full.client.script_flush()  # the NOSCRIPT path (load, retry) is refused the same way
    full.assert_publish_refused()
    assert full.client.hget(full.lib.keys.meta("q"), "last_id") == last_id
    assert full.messages() == (10, 10)


def test_ack_runs_on_a_full_server_and_frees_memory(full: Full) -> None:
    full.fill_until_oom()
    full.assert_publish_refused()
    dbsize, memory = full.client.dbsize(), full.used_memory()

    assert full.lib.ack("q", full.in_flight) == 5

    # Fields went; the hashes still hold the other five, and the emptied index goes (ready
    # messages have no entry there).
    assert full.client.dbsize() == dbsize - 1
    assert full.messages() == (5, 5)
    assert not any(full.client.hexists(full.lib.keys.message("q"), i) for i in full.in_flight)
    assert memory - full.used_memory() >= FREED
    assert full.client.zscore(full.lib.keys.index("q"), full.in_flight[0]) is None


def test_purge_runs_on_a_full_server_and_frees_memory(full: Full) -> None:
    full.client.script_flush()  # purge is loaded for the first time while the server is full
    full.fill_until_oom()
    full.assert_publish_refused()
    dbsize, memory = full.client.dbsize(), full.used_memory()

    assert full.lib.purge("q") == 5  # the ready ones; in-flight messages are left alone

    assert full.client.dbsize() == dbsize - 2  # the emptied queue ZSET, and its idle wake token
    assert full.messages() == (5, 5)
    assert sorted(full.client.hkeys(full.lib.keys.message("q"))) == [i.encode() for i in full.in_flight]
    assert memory - full.used_memory() >= FREED
    assert full.client.exists(full.lib.keys.queue("q")) == 0


def test_sweep_runs_on_a_full_server_and_frees_memory(full: Full) -> None:
    wait_for_server_time(full.client, full.delivered_at_ms + VISIBILITY_MS + 1)
    # Loaded first: the script cache counts in used_memory, and the sweep's first call would
    # add its source (about 16 KB) to what the test reads as freed.
    full.lib.runner.load(["sweep"])
    full.fill_until_oom()
    full.assert_publish_refused()
    dbsize, memory = full.client.dbsize(), full.used_memory()

    # Limit 1: the timed-out deliveries may not start a second attempt; maxlen 0 deletes them.
    report = full.lib.with_policy(delivery_limit=1, dead_letter_maxlen=0).sweep(["q"])

    assert (report.limit_reached, report.expired) == (5, 0)
    assert sorted(d.id for d in report.dropped_messages) == sorted(full.in_flight)
    assert {d.reason for d in report.dropped_messages} == {"delivery-limit"}
    # No dead-letter stream (maxlen 0); the hashes stay; the emptied index goes.
    assert full.client.dbsize() == dbsize - 1
    assert full.messages() == (5, 5)
    assert sorted(full.client.hkeys(full.lib.keys.message("q"))) == [
        i.encode() for i in full.published[5:]]
    assert memory - full.used_memory() >= FREED
