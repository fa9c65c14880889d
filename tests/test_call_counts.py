"""The commands each hot-path script runs (issue 41 §2): held here, so that a script cannot
grow on its common path unnoticed. glide-mq tracks the same number on its hot path.

The common path: a declared queue with no TTL, no ETA, no x-expires, no limits, a Celery task
id on each message. Each script is run with one message and with ten, and the commands it
ran are read from INFO commandstats (Redis 7 and Valkey count a script's own redis.call
commands there): what a script costs the server is mostly its round trip, its Lua shell and
these calls (docs/performance.md, "Where a publish goes"). Calls that grow with the batch are
the per-message part; a script whose per-message part grows fails here as surely as one that
adds a fixed call. A change that moves these numbers on purpose updates them here and in
docs/performance.md.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_redis_lua import Consumed, Keyspace, ScriptLibrary
from celery_redis_lua.protocol.ops import Outgoing
from scripts.servers import Server

# Script -> (calls with one message, calls with ten). Fixed + per-message, as measured on
# Valkey 9 and Redis 7.0 alike (2026-12-05):
#   publish  8           TIME, HMGET meta, HGET task index (a retried publish is found),
#                        LLEN wake, HSET payload, HSET state + task index, ZADD, HSET last_id
#   publish  8           the same for a batch of ten in one call (publish_many, a producer's
#    (batch)             group commit): the calls are the call's, not the messages'
#   consume  10          HMGET meta, TIME, ZRANGE delayed, ZPOPMIN, HMGET payloads, HMGET states,
#                        ZADD index, HSET states, ZCARD, LLEN wake: the same for a batch of ten
#   ack      6           HMGET state, HGET task index entry, ZREM index, HDEL payload, HDEL state with
#                        the task index entry, HGET limits (a ZREM of the ready set only for a copy
#                        the sweep put back: none in flight is there)
#   ack      6           a batch: HMGET states, HMGET task index entries, ZREM index, HDEL payloads,
#    (batch)             HDEL states with the index entries, HGET limits, for 2 to 4,000 ids
#   extend   4           TIME, ZMSCORE and one ZADD XX for up to 2,000 ids, HGET expires
#   reject   6 + 6/msg   requeued: HGET, ZREM, ZADD, HSET state, (HGET), HEXISTS (is it revoked:
#                        a delivery Celery revoked that comes back is dead-lettered) per message
EXPECTED = {
    "publish": (8, 8 * 10),
    "publish_many": (8, 8),
    "consume": (10, 10),
    "ack": (6, 6),
    "extend": (4, 4),
    "reject": (12, 66),
}
# Commands that are not the script's own: the test's reads and a first EVALSHA's load.
NOT_THE_SCRIPTS = {"evalsha", "config|resetstat", "info", "script|load"}


@pytest.fixture(params=["valkey", "redis"])
def lib(request: pytest.FixtureRequest) -> Iterator[ScriptLibrary]:
    server: Server = request.getfixturevalue(f"{request.param}_server")
    client = server.client()
    client.flushall()
    library = ScriptLibrary(client, Keyspace(), visibility_ms=60_000)
    library.declare("hot")
    yield library
    client.close()


def commands(lib: ScriptLibrary, run: Callable[[], Any]) -> Counter[str]:
    """The commands ``run`` made the server execute, by name."""
    client = lib.client
    client.config_resetstat()
    run()
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()
                    if name.removeprefix("cmdstat_") not in NOT_THE_SCRIPTS})


TASK_IDS = itertools.count()


def publish(lib: ScriptLibrary, n: int) -> Counter[str]:
    """``n`` publishes of new task ids to a queue that has ready messages (its wake token is
    armed: the first publish to an empty queue pushes it, one RPUSH more)."""
    return commands(lib, lambda: [lib.publish("hot", b"{}", task_id=f"task-{next(TASK_IDS)}")
                                  for _ in range(n)])


def publish_many(lib: ScriptLibrary, n: int) -> Counter[str]:
    """``n`` messages of new task ids in one publish call."""
    return commands(lib, lambda: lib.publish_many("hot", [Outgoing(b"{}", task_id=f"task-{next(TASK_IDS)}")
                                                         for _ in range(n)]))


def test_the_hot_path_runs_the_calls_it_is_known_to_run(lib: ScriptLibrary) -> None:
    seen: dict[str, list[Counter[str]]] = {name: [] for name in EXPECTED}
    publish(lib, 1)
    for n in (1, 10):
        seen["publish"].append(publish(lib, n))
        seen["publish_many"].append(publish_many(lib, n))
        publish(lib, 20)  # more than a batch takes, so no consume empties the queue
        taken: list[Consumed] = []
        seen["consume"].append(commands(lib, lambda n=n, taken=taken: taken.append(lib.consume(["hot"], n))))
        ids = [d.id for d in taken[0].deliveries]
        assert len(ids) == n
        seen["extend"].append(commands(lib, lambda ids=ids: lib.extend("hot", ids)))
        seen["ack"].append(commands(lib, lambda ids=ids: lib.ack("hot", ids)))
        again = [d.id for d in lib.consume(["hot"], n).deliveries]
        seen["reject"].append(commands(lib, lambda again=again: lib.reject("hot", again, requeue=True)))
    for name, (one, ten) in EXPECTED.items():
        counted = tuple(sum(c.values()) for c in seen[name])
        assert counted == (one, ten), f"{name}: {counted} calls, expected {(one, ten)}: " + \
            " | ".join(", ".join(f"{k} {v}" for k, v in sorted(c.items())) for c in seen[name])


def test_a_batch_past_lua_s_unpack_limit_is_consumed_and_acked_whole(lib: ScriptLibrary) -> None:
    """consume reads a batch's payloads and states in one HMGET per queue and ack its task index
    entries in one: past 4,000 ids each goes in chunks (Lua's unpack takes about 8,000
    values), over two queues in one consume call, and nothing of the messages is left."""
    client, keys = lib.client, Keyspace()
    sent: dict[str, bytes] = {}
    for queue in ("big-a", "big-b"):
        lib.declare(queue)
        for first in range(0, 4_500, 300):
            batch = [Outgoing(f"{queue}-{i}".encode(), task_id=f"{queue}-t{i}")
                     for i in range(first, first + 300)]
            for outgoing, message_id in zip(batch, lib.publish_many(queue, batch), strict=True):
                sent[str(message_id)] = outgoing.payload
    consumed = lib.consume(["big-a", "big-b"], 9_000)
    got = {d.id: d.payload for d in consumed.deliveries}
    assert got == sent  # every message once, with its own payload
    for queue in ("big-a", "big-b"):
        mine = [d for d in consumed.deliveries if d.queue == queue]
        acked = lib.ack(queue, [d.id for d in mine], counts=[d.delivery_count for d in mine])
        assert (int(acked), acked.stale) == (4_500, ())
        assert client.exists(keys.message(queue), keys.state(queue)) == 0  # every payload, state, index entry
