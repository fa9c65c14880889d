"""Bad input: every script refuses it with a clear error naming the problem, before any write.

Each case seeds a queue with ready, delayed (one of them already due), in-flight and
dead-lettered messages, a binding table and a fanout stream, snapshots the whole
database (DBSIZE, and DUMP + PEXPIRETIME of every key and of every key the call would
touch), runs one bad call and asserts a ScriptError ``celery-redis-lua: <script>: ...``
naming the argument and the value, and a byte-for-byte identical database afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from redis.crc import key_slot

from celery_redis_lua import Call, Keyspace, KeyspaceError, Policy, ScriptError, ScriptLibrary
from celery_redis_lua.protocol import ops
from celery_redis_lua.protocol.bounds import MAX_DURATION_MS, MAX_LIMIT
from conftest import Target
from helpers import server_now_ms, wait_for_server_time

QUEUE = "bad"
EXCHANGE = "bad-exchange"
MEMBER = "rk\x06\x16\x06\x16bad"
FANOUT = "bad-fanout"
MIGRATED = "migrated-task"  # an identity in the queue's migration record: a bad call keeps it
VIS = 60_000
POLICY = Policy(visibility_ms=VIS, delivery_limit=5, dead_letter_maxlen=100)  # what the valid calls pass
FANOUT_PREFIX = "/0."  # the transport's fanout stream names
Snapshot = tuple[int, dict[bytes, tuple[bytes | None, int]]]


@pytest.fixture
def lib(lib: ScriptLibrary) -> ScriptLibrary:
    """conftest's ``lib`` with the transport's fanout stream names (``<prefix>/0.<exchange>``)."""
    return ScriptLibrary(lib.client, replace(lib.keys, fanout_prefix=FANOUT_PREFIX), lib.policy)


@dataclass(frozen=True)
class Seeded:
    ready: str
    in_flight: str
    dead_entry: str
    last_id: bytes  # meta's last_id after seeding: a refused publish must not move it


def seed(lib: ScriptLibrary, target: Target) -> Seeded:
    lib.declare(QUEUE, expires_ms=600_000)  # every queue key carries a TTL a write would refresh
    ready = lib.publish(QUEUE, "ready", priority=3)
    lib.publish(QUEUE, "in-flight", priority=7, ttl_ms=600_000)
    lib.publish(QUEUE, "far", priority=1, eta_ms=server_now_ms(target.client) + 600_000)
    in_flight = lib.consume([QUEUE], 1).deliveries[0].id
    lib.publish(QUEUE, "dead", priority=9)
    dead = lib.consume([QUEUE], 1).deliveries[0].id
    assert lib.reject(QUEUE, [dead], requeue=False).dead_lettered == 1
    lib.bind(EXCHANGE, [MEMBER], lifetime_ms=600_000)
    lib.fanout_publish(FANOUT, "fan", maxlen=100, expires_ms=600_000)
    lib.migrated(QUEUE, "mark", MIGRATED)
    # Last: a delayed message that is already due, so a script that promoted (or swept)
    # before validating would change the database.
    eta = server_now_ms(target.client) + 20
    lib.publish(QUEUE, "due", priority=5, eta_ms=eta)
    wait_for_server_time(target.client, eta + 1)
    lib.fanout_bind(FANOUT, "bound", expires_ms=600_000,
                    stream_expires_ms=600_000)
    return Seeded(ready, in_flight, lib.dead_list(QUEUE)[0].entry_id,
                  target.client.hget(lib.keys.meta(QUEUE), "last_id"))


def dbsize(target: Target) -> int:
    if target.is_cluster:
        return int(target.client.dbsize(target_nodes=target.client.PRIMARIES))
    return int(target.client.dbsize())


def snapshot(target: Target, extra: list[str]) -> Snapshot:
    keys = target.keys() | {k.encode() for k in extra}
    client = target.client
    return dbsize(target), {key: (client.dump(key), client.pexpiretime(key)) for key in sorted(keys)}


def braceless_key_in_slot_of(key: str, stem: str) -> str:
    """A key without '{' that hashes to the same cluster slot as ``key``."""
    slot = key_slot(key.encode())
    for i in range(1_000_000):
        candidate = f"{stem}{i}"
        if key_slot(candidate.encode()) == slot:
            return candidate
    raise AssertionError("unreachable")


# -- call builders (valid calls; the cases spoil one thing) --------------------------------
Build = Callable[[Keyspace, Seeded], Call]


BASE: dict[str, Build] = {
    "pub": lambda k, s: ops.publish(k, POLICY, QUEUE, "payload"),
    "con": lambda k, s: ops.consume(k, POLICY, [QUEUE], 5),
    "rej": lambda k, s: ops.reject(k, POLICY, QUEUE, [s.in_flight], requeue=True),
    "ext": lambda k, s: ops.extend(k, POLICY, QUEUE, [s.in_flight]),
    "ack": lambda k, s: ops.ack(k, POLICY, QUEUE, [s.in_flight, s.ready]),
    "swp": lambda k, s: ops.sweep(k, POLICY, [QUEUE]),
    "prg": lambda k, s: ops.purge(k, POLICY, QUEUE),
    "dlt": lambda k, s: ops.delete(k, POLICY, QUEUE),
    "bnd": lambda k, s: ops.bind(k, POLICY, EXCHANGE, [MEMBER, "other"], lifetime_ms=600_000),
    "fan": lambda k, s: ops.fanout_publish(k, POLICY, FANOUT, "payload", maxlen=100),
    "dlist": lambda k, s: ops.dead_list(k, POLICY, QUEUE),
    "replay": lambda k, s: ops.dead_replay(k, POLICY, QUEUE, entry_ids=[s.dead_entry]),
    "given": lambda k, s: ops.dead_replay(k, POLICY, QUEUE, payloads={s.dead_entry: "new"}),
    "fbind": lambda k, s: ops.fanout_bind(k, POLICY, FANOUT, "bound", expires_ms=600_000),
    "fread": lambda k, s: ops.fanout_consume(k, POLICY, FANOUT, "bound", "me", count=10),
    "funbind": lambda k, s: ops.fanout_unbind(k, POLICY, FANOUT, "bound"),
    "fleave": lambda k, s: ops.fanout_leave(k, POLICY, FANOUT, "bound", "me"),
    "unpop": lambda k, s: ops.unpop(k, POLICY, QUEUE),
    "mig": lambda k, s: ops.migrated(k, POLICY, QUEUE, "forget", MIGRATED),
    "rer": lambda k, s: ops.rerouted(k, POLICY, QUEUE, EXCHANGE, 1),
    "dcl": lambda k, s: ops.declare(k, POLICY, QUEUE, expires_ms=600_000, fanout_exchange=FANOUT),
    "lim": lambda k, s: ops.limit(k, POLICY, QUEUE, in_flight=5, rate="20/s"),
    "cnl": lambda k, s: ops.cancel(k, POLICY, QUEUE, "a-task", reason="revoked"),
}
(pub, con, rej, ext, ack, swp, prg, dlt, bnd, fan, dlist, replay, given, fbind, fread, funbind,
 fleave, unpop, mig, rer, dcl, lim, cnl) = BASE.values()


def arg(build: Build, position: int, value: Any) -> Build:
    """``build`` with ARGV[position] (1-based, as in the script headers) replaced."""
    return args_at(build, {position: value})


def args_at(build: Build, values: dict[int, Any]) -> Build:
    """``build`` with ARGV[position] replaced by ``values[position]`` for each position."""
    def spoiled(k: Keyspace, s: Seeded) -> Call:
        call = build(k, s)
        args = list(call.args)
        for position, value in values.items():
            args[position - 1] = value
        return replace(call, args=args)
    return spoiled


def argv(build: Build, count: int) -> Build:
    """``build`` with only the first ``count`` arguments."""
    return lambda k, s: replace(build(k, s), args=list(build(k, s).args)[:count])


def keys(build: Build, count: int) -> Build:
    """``build`` with ``count`` keys: cut, or padded with keys of the same hash tag."""
    def spoiled(k: Keyspace, s: Seeded) -> Call:
        call = build(k, s)
        pool = [*call.keys, k.meta(QUEUE), k.dead(QUEUE), k.delayed(QUEUE)] if "{" in call.keys[0] \
            else [*call.keys] + [call.keys[0]] * count
        return replace(call, keys=pool[:count])
    return spoiled


def untagged(build: Build) -> Build:
    """``build`` with every key replaced by one queue key that has no hash tag."""
    def spoiled(k: Keyspace, s: Seeded) -> Call:
        call = build(k, s)
        return replace(call, keys=[f"{k.prefix}queue:{QUEUE}"] * len(call.keys))
    return spoiled


def second_untagged(build: Build, per_queue: int) -> Build:
    """``build`` for two queues, the second without a hash tag (same slot on a cluster)."""
    def spoiled(k: Keyspace, s: Seeded) -> Call:
        call = build(k, s)
        other = braceless_key_in_slot_of(call.keys[0], f"{k.prefix}queue:untagged")
        return replace(call, keys=[*call.keys, *[other] * per_queue])
    return spoiled


def empty_tag(build: Build) -> Build:
    """``build`` with every key given an empty hash tag ('{}' hashes the whole name)."""
    def spoiled(k: Keyspace, s: Seeded) -> Call:
        call = build(k, s)
        return replace(call, keys=[f"{k.prefix}queue:{{}}{QUEUE}"] * len(call.keys))
    return spoiled


CASES: dict[str, tuple[Build, tuple[str, ...]]] = {
    "publish-priority-word": (arg(pub, 2, "high"), ("priority", "'high'")),
    "publish-priority-256": (arg(pub, 2, 256), ("priority", "0..255", "'256'")),
    "publish-priority-negative": (arg(pub, 2, -1), ("priority", "'-1'")),
    "publish-priority-fraction": (arg(pub, 2, "1.5"), ("priority", "'1.5'")),
    "publish-payload-empty": (arg(pub, 1, ""), ("payload is missing or empty",)),
    "publish-payload-only": (argv(pub, 1),
                             ("expected 5, 6, 8, 11 or 12 arguments, or 12 per message", "got 1")),
    "publish-7-args": (lambda k, s: replace(pub(k, s), args=[*pub(k, s).args, "ex"]),
                       ("expected 5, 6, 8, 11 or 12 arguments, or 12 per message", "got 7")),
    "publish-route-no-exchange": (lambda k, s: replace(pub(k, s), args=[*pub(k, s).args, "", "1"]),
                                  ("exchange must be non-empty with routed_ms",)),
    "publish-route-time-word": (lambda k, s: replace(pub(k, s), args=[*pub(k, s).args, "ex", "soon"]),
                                ("routed_ms must be a non-negative integer", "'soon'")),
    "publish-task-id-too-long": (arg(pub, 6, "t" * 257), ("task_id must be at most 256 bytes", "got 257")),
    "publish-dedup-mode": (lambda k, s: replace(pub(k, s), args=[*pub(k, s).args, "", "", "d", "once", ""]),
                           ("dedup_mode must be simple, throttle or debounce", "'once'")),
    "publish-dedup-throttle-no-ttl": (
        lambda k, s: replace(pub(k, s), args=[*pub(k, s).args, "", "", "d", "throttle", ""]),
        ("dedup_ttl_ms is required with dedup_mode throttle",)),
    "publish-dedup-ttl-word": (
        lambda k, s: replace(pub(k, s), args=[*pub(k, s).args, "", "", "d", "simple", "x"]),
        ("dedup_ttl_ms", "'x'")),
    "publish-fairness-key-too-long": (
        lambda k, s: replace(pub(k, s), args=[*pub(k, s).args, "", "", "", "", "", "k" * 257]),
        ("fairness_key must be at most 256 bytes", "got 257")),
    "publish-fairness-key-bad-dedup": (
        lambda k, s: replace(pub(k, s), args=[*pub(k, s).args, "", "", "d", "once", "", "tenant"]),
        ("dedup_mode must be simple, throttle or debounce", "'once'")),
    "publish-ttl-negative": (arg(pub, 4, -5), ("ttl_ms", "'-5'")),
    "publish-ttl-zero": (arg(pub, 4, 0), ("ttl_ms", "'0'")),
    "publish-eta-negative": (arg(pub, 3, -5), ("eta_ms", "'-5'")),
    # An ETA past 10^13 ms would overflow into the next priority band of the ready score.
    "publish-eta-beyond-2286": (arg(pub, 3, 10**13), ("eta_ms", "0..9999999999999", "'10000000000000'")),
    "publish-eta-1e20": (arg(pub, 3, "100000000000000000000"), ("eta_ms", "'100000000000000000000'")),
    "publish-visibility-zero": (arg(pub, 5, 0), ("visibility_ms", "'0'")),
    # Issue 38: a TTL past 10 years would be added to the clock (exact to 2^53, %d to 2^63).
    "publish-ttl-past-bound": (arg(pub, 4, MAX_DURATION_MS + 1),
                               ("ttl_ms must be an integer in 1..315360000000 or -1", "'315360000001'")),
    "publish-ttl-1e19": (arg(pub, 4, 10**19), ("ttl_ms", "'10000000000000000000'")),
    "publish-7-keys": (keys(pub, 7), ("expected 8 keys", "got 7")),
    "publish-9-keys": (keys(pub, 9), ("expected 8 keys", "got 9")),
    "publish-untagged": (untagged(pub), ("has no {hash tag}", "queue:bad'")),
    "publish-empty-tag": (empty_tag(pub), ("has no {hash tag}", "queue:{}bad'")),
    "consume-count-zero": (arg(con, 1, 0), ("count", "1..10000", "'0'")),
    "consume-count-huge": (arg(con, 1, 10_001), ("count", "'10001'")),
    "consume-count-word": (arg(con, 1, "all"), ("count", "'all'")),
    "consume-visibility-negative": (arg(con, 2, -1), ("visibility_ms", "'-1'")),
    "consume-visibility-zero": (arg(con, 2, 0), ("visibility_ms", "'0'")),
    "consume-visibility-past-bound": (arg(con, 2, MAX_DURATION_MS + 1),
                                      ("visibility_ms must be an integer in 1..315360000000",
                                       "'315360000001'")),
    "consume-no-ack-2": (arg(con, 3, 2), ("no_ack", "'2'")),
    "consume-no-ack-word": (arg(con, 3, "yes"), ("no_ack", "'yes'")),
    "consume-dead-maxlen-negative": (arg(con, 4, -1), ("dead_letter_maxlen", "'-1'")),
    "consume-7-keys": (keys(con, 7), ("expected 8 keys per queue", "got 7")),
    "consume-9-keys": (keys(con, 9), ("expected 8 keys per queue", "got 9")),
    "consume-3-args": (argv(con, 3), ("expected 4 arguments", "got 3")),
    "consume-untagged": (untagged(con), ("has no {hash tag}",)),
    "consume-empty-tag": (empty_tag(con), ("has no {hash tag}",)),
    "consume-second-untagged": (second_untagged(con, 8), ("has no {hash tag}", "untagged")),
    "reject-requeue-2": (arg(rej, 1, 2), ("requeue", "'2'")),
    "reject-requeue-word": (arg(rej, 1, "true"), ("requeue", "'true'")),
    "reject-requeue-cause-unknown": (arg(rej, 1, "timeout"),
                                     ("requeue must be failed, returned, drop", "'timeout'")),
    "reject-limit-negative": (arg(rej, 2, -1), ("delivery_limit", "'-1'")),
    "reject-limit-word": (arg(rej, 2, "x"), ("delivery_limit", "'x'")),
    "reject-maxlen-negative": (arg(rej, 3, -1), ("dead_letter_maxlen", "'-1'")),
    "reject-visibility-zero": (arg(rej, 4, 0), ("visibility_ms", "'0'")),
    "reject-no-ids": (argv(rej, 4), ("expected at least 5 arguments", "got 4")),
    "reject-fence-word": (arg(rej, 5, "0000000000000001:x"),
                          ("must be an id or id:delivery_count", "'0000000000000001:x'")),
    "reject-fence-empty": (arg(rej, 5, ":1"), ("must be an id or id:delivery_count", "':1'")),
    "reject-7-keys": (keys(rej, 7), ("expected 8 keys", "got 7")),
    "reject-9-keys": (keys(rej, 9), ("expected 8 keys", "got 9")),
    "extend-visibility-zero": (arg(ext, 1, 0), ("visibility_ms", "'0'")),
    "extend-visibility-word": (arg(ext, 1, "soon"), ("visibility_ms", "'soon'")),
    "extend-visibility-1e19": (arg(ext, 1, 10**19), ("visibility_ms must be an integer in 1..315360000000",
                                                     "'10000000000000000000'")),
    "extend-7-keys": (keys(ext, 7), ("expected 8 keys", "got 7")),
    "ack-1-key": (keys(ack, 1), ("expected 8 keys", "got 1")),
    "ack-9-keys": (keys(ack, 9), ("expected 8 keys", "got 9")),
    "ack-no-ids": (argv(ack, 0), ("at least one id",)),
    "sweep-batch-zero": (arg(swp, 4, 0), ("batch", "1..10000", "'0'")),
    "sweep-batch-huge": (arg(swp, 4, 10_001), ("batch", "'10001'")),
    "sweep-batch-word": (arg(swp, 4, "x"), ("batch", "'x'")),
    "sweep-visibility-zero": (arg(swp, 1, 0), ("visibility_ms", "'0'")),
    "sweep-limit-negative": (arg(swp, 2, -1), ("delivery_limit", "'-1'")),
    "sweep-report-limit-negative": (arg(swp, 5, -1), ("report_limit", "'-1'")),
    "sweep-7-keys": (keys(swp, 7), ("expected 8 keys per queue", "got 7")),
    "sweep-untagged": (untagged(swp), ("has no {hash tag}",)),
    "sweep-second-untagged": (second_untagged(swp, 8), ("has no {hash tag}", "untagged")),
    "purge-batch-zero": (arg(prg, 1, 0), ("batch", "1..100000", "'0'")),
    "purge-batch-huge": (arg(prg, 1, 100_001), ("batch", "'100001'")),
    "purge-batch-word": (arg(prg, 1, "all"), ("batch", "'all'")),
    "purge-7-keys": (keys(prg, 7), ("expected 8 keys", "got 7")),
    "delete-7-keys": (keys(dlt, 7), ("expected 8 keys", "got 7")),
    "declare-2-args": (argv(dcl, 2), ("expected 3, 4, 7 or 8 arguments", "got 2")),
    "declare-5-args": (argv(dcl, 5), ("expected 3, 4, 7 or 8 arguments", "got 5")),
    "declare-consumer-timeout-zero": (arg(dcl, 8, 0), ("consumer_timeout_ms", "'0'")),
    "declare-consumer-timeout-word": (arg(dcl, 8, "1s"), ("consumer_timeout_ms", "'1s'")),
    "declare-consumer-timeout-past-bound": (arg(dcl, 8, MAX_DURATION_MS + 1),
                                            ("consumer_timeout_ms must be an integer in 1..315360000000",
                                             "'315360000001'")),
    "declare-other-consumer-timeout": (arg(dcl, 8, 5000),
                                       ("x-consumer-timeout stored none, declared 5000",)),
    "declare-9-args": (lambda k, s: replace(dcl(k, s), args=[*dcl(k, s).args, "x"]),
                       ("expected 3, 4, 7 or 8 arguments", "got 9")),
    "declare-retry-type-unknown": (arg(dcl, 5, "sometimes"), ("retry_type", "'sometimes'")),
    "declare-retry-type-without-min": (arg(dcl, 5, "failed"), ("x-delayed-retry-type 'failed' needs",)),
    "declare-retry-min-zero": (args_at(dcl, {5: "failed", 6: 0}), ("retry_min_ms", "'0'")),
    "declare-retry-min-word": (args_at(dcl, {5: "all", 6: "1s"}), ("retry_min_ms", "'1s'")),
    "declare-retry-max-below-min": (args_at(dcl, {5: "all", 6: 1000, 7: 10}),
                                    ("x-delayed-retry-max 10 is below x-delayed-retry-min 1000",)),
    "declare-expires-word": (arg(dcl, 1, "soon"), ("expires_ms", "'soon'")),
    # Issue 38: every duration at most 10 years, so that no later call overflows adding it.
    "declare-retry-min-1e19": (args_at(dcl, {5: "all", 6: 10**19}),
                               ("retry_min_ms must be an integer in 1..315360000000",
                                "'10000000000000000000'")),
    "declare-retry-min-past-bound": (args_at(dcl, {5: "failed", 6: MAX_DURATION_MS + 1}),
                                     ("retry_min_ms", "'315360000001'")),
    "declare-retry-max-past-bound": (args_at(dcl, {5: "all", 6: 1000, 7: MAX_DURATION_MS + 1}),
                                     ("retry_max_ms must be an integer in 1..315360000000",
                                      "'315360000001'")),
    "declare-expires-past-bound": (arg(dcl, 1, MAX_DURATION_MS + 1),
                                   ("expires_ms must be an integer in 1..315360000000", "'315360000001'")),
    "declare-ttl-past-bound": (arg(dcl, 2, MAX_DURATION_MS + 1),
                               ("message_ttl_ms must be an integer in 1..315360000000", "'315360000001'")),
    "declare-priority-1e19": (arg(dcl, 3, 10**19), ("max_priority", "0..255", "'10000000000000000000'")),
    "declare-priority-256": (arg(dcl, 3, 256), ("max_priority", "0..255", "'256'")),
    # Refused arguments record no fanout binding either.
    "declare-other-expires": (arg(dcl, 1, 20_000), ("x-expires stored 600000, declared 20000",)),
    "bind-lifetime-zero": (arg(bnd, 1, 0), ("lifetime_ms", "'0'")),
    "bind-lifetime-negative": (arg(bnd, 1, -5), ("lifetime_ms", "'-5'")),
    "bind-lifetime-word": (arg(bnd, 1, "soon"), ("lifetime_ms", "'soon'")),
    "bind-lifetime-past-bound": (arg(bnd, 1, MAX_DURATION_MS + 1),
                                 ("lifetime_ms must be an integer in 1..315360000000 or empty",
                                  "'315360000001'")),
    "bind-no-members": (argv(bnd, 1), ("at least one member",)),
    "bind-2-keys": (keys(bnd, 2), ("expected 1 key", "got 2")),
    "fanout-maxlen-zero": (arg(fan, 2, 0), ("maxlen", "'0'")),
    "fanout-maxlen-negative": (arg(fan, 2, -1), ("maxlen", "'-1'")),
    "fanout-maxlen-word": (arg(fan, 2, "lots"), ("maxlen", "'lots'")),
    "fanout-payload-empty": (arg(fan, 1, ""), ("payload is missing or empty",)),
    "fanout-expires-zero": (arg(fan, 3, 0), ("expires_ms", "'0'")),
    "fanout-expires-past-bound": (arg(fan, 3, MAX_DURATION_MS + 1),
                                  ("expires_ms must be an integer in 1..315360000000", "'315360000001'")),
    "fanout-3-keys": (keys(fan, 3), ("expected 2 keys", "got 3")),
    "fanout-bind-expires-word": (arg(fbind, 2, "soon"), ("expires_ms", "'soon'")),
    "fanout-bind-ttl-zero": (arg(fbind, 3, 0), ("message_ttl_ms", "'0'")),
    "fanout-bind-stream-expires-negative": (arg(fbind, 4, -1), ("stream_expires_ms", "'-1'")),
    "fanout-bind-expires-past-bound": (arg(fbind, 2, MAX_DURATION_MS + 1),
                                       ("expires_ms must be an integer in 1..315360000000",
                                        "'315360000001'")),
    "fanout-bind-ttl-1e19": (arg(fbind, 3, 10**19), ("message_ttl_ms", "'10000000000000000000'")),
    "fanout-bind-stream-expires-past-bound": (arg(fbind, 4, MAX_DURATION_MS + 1),
                                              ("stream_expires_ms", "'315360000001'")),
    "fanout-bind-no-queue": (arg(fbind, 1, ""), ("queue is missing or empty",)),
    "fanout-bind-1-key": (keys(fbind, 1), ("expected 2 keys", "got 1")),
    "fanout-consume-count-zero": (arg(fread, 3, 0), ("count", "1..10000", "'0'")),
    "fanout-consume-count-huge": (arg(fread, 3, 10_001), ("count", "'10001'")),
    "fanout-consume-no-consumer": (arg(fread, 2, ""), ("queue and consumer must be non-empty",)),
    "fanout-consume-stream-expires-word": (arg(fread, 4, "x"), ("stream_expires_ms", "'x'")),
    "fanout-consume-stream-expires-past-bound": (arg(fread, 4, MAX_DURATION_MS + 1),
                                                 ("stream_expires_ms must be an integer in 1..315360000000",
                                                  "'315360000001'")),
    "fanout-unbind-no-queue": (arg(funbind, 1, ""), ("queue is missing or empty",)),
    "fanout-unbind-3-args": (lambda k, s: replace(funbind(k, s), args=["a", "b", "c"]),
                             ("expected 1 argument", "got 3")),
    "fanout-leave-no-consumer": (arg(fleave, 2, ""), ("queue and consumer must be non-empty",)),
    "fanout-leave-2-keys": (keys(fleave, 2), ("expected 1 key", "got 2")),
    "unpop-an-argument": (lambda k, s: replace(unpop(k, s), args=["1"]), ("expected no arguments", "got 1")),
    "unpop-7-keys": (keys(unpop, 7), ("expected 8 keys", "got 7")),
    "dead-list-count-zero": (arg(dlist, 1, 0), ("count", "'0'")),
    "dead-list-after-word": (arg(dlist, 2, "abc"), ("after", "'abc'")),
    "dead-list-after-half-id": (arg(dlist, 2, "1-"), ("after", "'1-'")),
    "dead-list-2-keys": (keys(dlist, 2), ("expected 1 key", "got 2")),
    "dead-replay-entry-word": (arg(replay, 3, "nope"), ("entry id", "'nope'")),
    "dead-replay-entry-3-parts": (arg(replay, 3, "1-2-3"), ("entry id", "'1-2-3'")),
    # A valid entry id first: nothing may be replayed before the bad one is found.
    "dead-replay-good-then-bad": (
        lambda k, s: replace(replay(k, s), args=[*replay(k, s).args, "bad-id"]),
        ("entry id", "'bad-id'"),
    ),
    "dead-replay-count-zero": (argv(arg(replay, 2, 0), 2), ("count", "'0'")),
    "dead-replay-mode-zero": (arg(replay, 1, 0), ("payloads must be 'stored' or 'given'", "'0'")),
    "dead-replay-mode-past-bound": (arg(replay, 1, MAX_DURATION_MS + 1),
                                    ("payloads must be 'stored' or 'given'", "'315360000001'")),
    "dead-replay-mode-word": (arg(replay, 1, "mine"), ("payloads must be 'stored' or 'given'", "'mine'")),
    "dead-replay-given-odd": (argv(given, 3), ("pairs of entry id and payload", "got 1 arguments")),
    "dead-replay-given-empty-payload": (arg(given, 4, ""), ("payload given for entry", "is empty")),
    "dead-replay-given-entry-word": (arg(given, 3, "nope"), ("entry id", "'nope'")),
    "dead-replay-7-keys": (keys(replay, 7), ("expected 8 keys", "got 7")),
    "migrated-action-word": (arg(mig, 1, "drop"), ("action must be mark, forget or clear", "drop")),
    "migrated-clear-with-identity": (arg(mig, 1, "clear"), ("clear takes no identity",)),
    "migrated-forget-empty": (arg(mig, 2, ""), ("take one identity (a non-empty string)",)),
    "migrated-mark-no-identity": (argv(arg(mig, 1, "mark"), 1), ("take one identity",)),
    "migrated-forget-3-args": (lambda k, s: replace(mig(k, s), args=["forget", "a", "b"]),
                               ("take one identity",)),
    "migrated-2-keys": (keys(mig, 2), ("expected 1 key (record)", "got 2")),
    "rerouted-no-exchange": (arg(rer, 1, ""), ("exchange is missing or empty",)),
    "rerouted-time-word": (arg(rer, 2, "now"), ("changed_ms must be a non-negative integer", "'now'")),
    "rerouted-time-negative": (arg(rer, 2, -1), ("changed_ms", "'-1'")),
    "rerouted-1-arg": (argv(rer, 1), ("expected 2 arguments (exchange, changed_ms)", "got 1")),
    "rerouted-2-keys": (keys(rer, 2), ("expected 1 key (meta)", "got 2")),
    "limit-in-flight-negative": (arg(lim, 1, -1), ("in_flight must be an integer in 1..1000000", "'-1'")),
    "limit-in-flight-zero": (arg(lim, 1, 0), ("in_flight", "'0'")),
    "limit-in-flight-word": (arg(lim, 1, "many"), ("in_flight", "'many'")),
    "limit-in-flight-fraction": (arg(lim, 1, "2.5"), ("in_flight", "'2.5'")),
    "limit-rate-zero": (arg(lim, 2, "0/s"), ("rate must be N/s, N/m or N/h", "'0/s'")),
    "limit-rate-unit-unknown": (arg(lim, 2, "10/d"), ("rate", "'10/d'")),
    "limit-rate-no-unit": (arg(lim, 2, "10"), ("rate", "'10'")),
    "limit-rate-huge": (arg(lim, 2, "1000001/s"), ("rate", "'1000001/s'")),
    "limit-in-flight-past-bound": (arg(lim, 1, MAX_LIMIT + 1), ("in_flight", "1..1000000", "'1000001'")),
    "limit-in-flight-1e19": (arg(lim, 1, 10**19), ("in_flight", "'10000000000000000000'")),
    "limit-rate-1e19": (arg(lim, 2, f"{10**19}/h"), ("rate", "'10000000000000000000/h'")),
    # A good cap beside a bad rate: the cap must not be stored either.
    "limit-good-cap-bad-rate": (args_at(lim, {1: 7, 2: "fast"}), ("rate", "'fast'")),
    "limit-nothing": (args_at(lim, {1: "", 2: ""}), ("nothing to change",)),
    "cancel-reason-word": (arg(cnl, 3, "deleted"), ("reason must be 'cancelled' or 'revoked'", "'deleted'")),
    "cancel-no-task-id": (arg(cnl, 1, ""), ("task_id must be a non-empty string",)),
    "cancel-maxlen-word": (arg(cnl, 2, "lots"), ("dead_letter_maxlen", "'lots'")),
    "cancel-4-args": (lambda k, s: replace(cnl(k, s), args=[*cnl(k, s).args, "x"]),
                      ("expected 2 or 3 arguments", "got 4")),
    "limit-1-arg": (argv(lim, 1), ("expected 2 arguments (in_flight, rate)", "got 1")),
    "limit-7-keys": (keys(lim, 7), ("expected 8 keys", "got 7")),
    "limit-no-queue": (lambda k, s: ops.limit(k, POLICY, "never-declared", in_flight=3),
                       ("no queue", "meta:{never-declared}")),
}


def script_of(case: str) -> str:
    return CASES[case][0](Keyspace(), Seeded("1", "2", "1-1", b"3")).script


BY_SCRIPT: dict[str, list[str]] = {}
for _case in CASES:
    BY_SCRIPT.setdefault(script_of(_case), []).append(_case)


def check_case(target: Target, lib: ScriptLibrary, seeded: Seeded, case: str) -> str | None:
    """Run one bad call; return what went wrong (None: refused cleanly, nothing changed)."""
    build, expected = CASES[case]
    call = build(lib.keys, seeded)
    touched = [*call.keys, *lib.keys.queue_keys(QUEUE)]
    before = snapshot(target, touched)
    try:
        lib.runner.run(call)
    except ScriptError as error:
        message, script = str(error), error.script
    else:
        return f"{case}: no error"
    after = snapshot(target, touched)
    problems = []
    if script != call.script or not message.startswith(f"celery-redis-lua: {call.script}: "):
        problems.append(f"error not from {call.script}: {message!r}")
    problems += [f"{fragment!r} not in {message!r}" for fragment in expected if fragment not in message]
    if target.client.hget(lib.keys.meta(QUEUE), "last_id") != seeded.last_id:
        problems.append("the last id moved")
    if after[0] != before[0]:
        problems.append(f"DBSIZE {before[0]} -> {after[0]}")
    changed = sorted(k for k in before[1].keys() | after[1].keys() if before[1].get(k) != after[1].get(k))
    if changed:
        problems.append(f"changed keys {changed}")
    return f"{case}: {'; '.join(problems)}" if problems else None


@pytest.mark.parametrize("script", sorted(BY_SCRIPT))
def test_bad_input_is_refused_and_changes_nothing(target: Target, lib: ScriptLibrary, script: str) -> None:
    """Every bad case of ``script`` (see CASES) on one seeded database; a case that
    changed the database is reported and the database is seeded afresh for the next."""
    seeded = seed(lib, target)
    failures = []
    for case in BY_SCRIPT[script]:
        failure = check_case(target, lib, seeded, case)
        if failure:
            failures.append(failure)
            target.flush()
            seeded = seed(lib, target)
    assert not failures, "\n".join(failures)


def test_the_snapshot_sees_a_valid_call_and_ttl_minus_one_means_none(
        target: Target, lib: ScriptLibrary) -> None:
    """The control: a valid publish with ttl_ms -1 succeeds, moves the snapshot, and the
    message has no TTL deadline (-1 is "none", not an error)."""
    seeded = seed(lib, target)
    before = snapshot(target, list(lib.keys.queue_keys(QUEUE)))
    message_id = lib.run(ops.publish(lib.keys, POLICY, QUEUE, "p", ttl_ms=-1))
    assert message_id.encode() > seeded.last_id
    assert snapshot(target, list(lib.keys.queue_keys(QUEUE))) != before
    assert target.client.hget(lib.keys.state(QUEUE), message_id) == b"ready 0 0 -"
    assert target.client.hget(lib.keys.meta(QUEUE), "last_id") == message_id.encode()


@pytest.mark.parametrize("prefix", ["a{b", "a}b", "{x}:"])
def test_keyspace_rejects_braces_in_the_global_prefix(prefix: str) -> None:
    with pytest.raises(KeyspaceError, match="global_keyprefix") as raised:
        Keyspace(prefix)
    assert repr(prefix) in str(raised.value)


BUILDERS = ["queue", "delayed", "index", "meta", "dead", "message", "state", "wake", "queue_keys", "slot"]


@pytest.mark.parametrize("builder", BUILDERS)
def test_keyspace_rejects_an_empty_queue_name(builder: str) -> None:
    with pytest.raises(KeyspaceError, match="queue name must be a non-empty string") as raised:
        getattr(Keyspace("app:"), builder)("")
    assert "''" in str(raised.value)


@pytest.mark.parametrize("builder", BUILDERS)
def test_keyspace_rejects_a_queue_name_that_would_empty_the_hash_tag(builder: str) -> None:
    """'}x' would make '{}x}': an empty hash tag, so each key of the queue would hash on
    its whole name and land in another cluster slot (CROSSSLOT)."""
    with pytest.raises(KeyspaceError, match="must not start with '}'") as raised:
        getattr(Keyspace("app:"), builder)("}x")
    assert "'}x'" in str(raised.value)


@pytest.mark.parametrize("queue", ["a}b", "{a", "a{b}c", "x"])
def test_every_key_of_a_queue_shares_one_slot_whatever_its_name(queue: str) -> None:
    keyspace = Keyspace("app:")
    assert len({key_slot(key.encode()) for key in keyspace.queue_keys(queue)}) == 1
    assert keyspace.queue_of(keyspace.queue(queue)) == queue


@pytest.mark.parametrize("exchange", ["plain", "a{b", "{tag}x", "with.dots"])
def test_a_fanout_stream_and_its_groups_hash_share_one_slot(exchange: str) -> None:
    keyspace = Keyspace("app:", fanout_prefix=FANOUT_PREFIX)
    stream = keyspace.fanout(exchange)
    assert stream == f"app:/0.{exchange}"
    groups = keyspace.fanout_groups(stream)
    assert key_slot(stream.encode()) == key_slot(groups.encode())
    assert groups.startswith("app:")


def test_a_fanout_stream_with_a_stray_closing_brace_is_refused() -> None:
    with pytest.raises(KeyspaceError, match="rename the exchange"):
        Keyspace("app:").fanout_groups("app:/0.a}b")
