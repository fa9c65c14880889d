"""Model-based test: random publish / consume / ack / reject / extend / sweep sequences,
with message TTLs, queue expiry, delete-and-recreate and late acks, against a real server
and a small Python model that predicts every reply exactly (which messages a consume
delivers and in what order, which it dead-letters as expired, delivery counts, reject and
sweep counts, dead letters). After every step the server must match the model: each
unacked message is ready (queued; indexed only by its TTL), in flight (indexed, not queued)
or delayed, with its payload and its state string; a queue with anything ready or delayed
holds one wake token, an idle one none; no ready id is duplicated or also held in flight
(unless a sweep restored it); ready scores encode the priority; the expiring queue's keys
all share one expiry time; ids only grow per queue name, across deletes and expiries. At
teardown everything is consumed and acked and only meta keys (and dead-letter streams)
are left. Time is the server's: short ETAs and 1 ms TTLs are waited for, and a dead
consumer's deliveries lapse by extend at 1 ms plus a wait; every other deadline is 60 s
away. A queue's expiry is shortened with PEXPIREAT (declare floors x-expires at 10 s), but
it is the server that expires the keys.
"""

from __future__ import annotations

import sys
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from hypothesis.stateful import run_state_machine_as_test as run_machine
from redis.cluster import RedisCluster

from celery_redis_lua import Keyspace, Policy, Rejected, ScriptLibrary
from helpers import is_message_id, names_on_each_node, server_now_ms, wait_for_server_time, wait_until
from scripts.servers import Cluster, Server

F = 10**13  # score = (255 - priority) * F + ready_at_ms
VIS = 60_000
LIMIT = 3  # first delivery + two redeliveries, then dead-lettered
EXPIRES = 600_000  # x-expires of the expiring queue (it never runs out by itself here)
PRIORITIES = st.one_of(st.sampled_from([0, 5, 255]), st.integers(0, 255))
PICKS = st.lists(st.integers(0, 63), min_size=1, max_size=3)
TTLS = st.sampled_from([None, None, 1, 60_000])  # 1 ms: expired before the next step
T = TypeVar("T")


def pick(items: list[T], picks: list[int]) -> list[T]:
    """Items chosen by index (modulo), so that what hypothesis draws never depends on the
    model's state, which depends on timing (e.g. whether an ETA had passed)."""
    return list(dict.fromkeys(items[i % len(items)] for i in picks)) if items else []


@dataclass(eq=False)
class Msg:
    queue: str
    id: str
    payload: bytes
    priority: int
    state: str  # 'delayed' | 'ready' | 'unacked', as in the state string
    eta: int | None = None
    expires_at: int | None = None  # message TTL deadline (server ms)
    delivery_count: int = 0
    score: int | None = None  # the ready score the server stored (validated when recorded)
    timed_out_step: int | None = None  # in flight with a deadline already passed (server clock)
    restored: bool = False  # a sweep put it back while our consumer still held it

    def delivery(self) -> tuple[str, str, int, bytes]:
        return self.queue, self.id, self.delivery_count, self.payload

    def state_string(self) -> str:
        expires = "-" if self.expires_at is None else str(self.expires_at)
        return f"{self.state} {self.delivery_count} {self.priority} {expires}"


@dataclass
class Model:
    messages: dict[tuple[str, str], Msg] = field(default_factory=dict)
    held: set[tuple[str, str]] = field(default_factory=set)  # delivered, not acked/rejected
    gone: set[tuple[str, str]] = field(default_factory=set)  # acked, dead-lettered or deleted
    dead: dict[str, list[tuple[str, str, int, int, bytes]]] = field(default_factory=dict)
    published: dict[str, int] = field(default_factory=dict)
    last_id: dict[str, str] = field(default_factory=dict)  # newest id ever given, per queue name
    meta_last_id: dict[str, str | None] = field(default_factory=dict)  # what meta holds (None: no meta)

    def in_state(self, state: str, queue: str | None = None) -> list[Msg]:
        return sorted((m for m in self.messages.values()
                       if m.state == state and queue in (None, m.queue)), key=lambda m: (m.queue, m.id))

    def expired(self, m: Msg, at: int) -> bool:
        return m.expires_at is not None and m.expires_at <= at


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def all_keys(client: Any, pattern: str = "*") -> set[str]:
    if isinstance(client, RedisCluster):
        return {text(k) for k in client.keys(pattern, target_nodes=client.ALL_NODES)}
    return {text(k) for k in client.keys(pattern)}


def make_machine(client: Any, keyspace: Keyspace, queues: list[str],
                 expiring: str) -> type[RuleBasedStateMachine]:
    k = keyspace

    class QueueMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            client.flushall()
            self.lib = ScriptLibrary(client, k, Policy(visibility_ms=VIS, delivery_limit=LIMIT))
            self.short = self.lib.with_policy(visibility_ms=1)
            self.m = Model(dead={q: [] for q in queues}, published=dict.fromkeys(queues, 0),
                           meta_last_id=dict.fromkeys(queues))
            self.step = 0
            self.declare_expiring()

        def now(self) -> int:
            return server_now_ms(client)

        def declare_expiring(self) -> None:
            declared = self.lib.declare(expiring, expires_ms=EXPIRES)
            assert declared.expires_ms == EXPIRES
            if self.m.meta_last_id[expiring] is None:
                self.m.meta_last_id[expiring] = "0" * 16

        def record_ready(self, m: Msg, t0: int, t1: int) -> None:
            """m was made ready by a script that ran between server times t0 and t1."""
            score = client.zscore(k.queue(m.queue), m.id)
            assert score is not None, f"{m.id} should be ready"
            score = int(score)
            assert score // F == 255 - m.priority, (m, score)
            assert t0 <= score % F <= t1, (m, score, t0, t1)
            m.state, m.score, m.timed_out_step = "ready", score, None

        def resolve_promotions(self, scope: list[str], visited: bool, t0: int, t1: int) -> int:
            """Delayed messages of ``scope`` that a script run in [t0, t1] promoted (it
            looked at these queues when ``visited``, else it must not have touched them)."""
            promoted = 0
            for m in self.m.in_state("delayed"):
                if m.queue not in scope:
                    continue
                assert m.eta is not None
                still = client.zscore(k.delayed(m.queue), m.id) is not None
                if not visited or m.eta > t1:
                    assert still, f"{m.id} promoted before its ETA or by a call that skipped it"
                elif m.eta <= t0:
                    assert not still, f"{m.id} due at {m.eta} was not promoted at {t0}..{t1}"
                if not still:
                    m.state, m.score = "ready", (255 - m.priority) * F + m.eta
                    promoted += 1
            return promoted

        def dead_letter(self, m: Msg, reason: str, count: int) -> None:
            self.m.dead[m.queue].append((m.id, reason, count, m.priority, m.payload))
            del self.m.messages[m.queue, m.id]
            self.m.gone.add((m.queue, m.id))

        def forget_queue(self, queue: str) -> None:
            """The queue went (deleted, or expired) with everything in it; what our consumer
            still holds of it stays held: its late acks and rejects must find nothing."""
            for key in [key for key in self.m.messages if key[0] == queue]:
                del self.m.messages[key]
                self.m.gone.add(key)
            self.m.dead[queue] = []
            self.m.meta_last_id[queue] = None

        @initialize(batch=st.lists(st.tuples(st.sampled_from(queues), PRIORITIES), max_size=10))
        def prefill(self, batch: list[tuple[str, int]]) -> None:
            """A backlog to start from, so that consumes, rejects and time-outs have work."""
            for queue, priority in batch:
                self.publish([queue], priority, None, None)

        @rule(into=st.lists(st.sampled_from(queues), min_size=1, max_size=4), priority=PRIORITIES,
              delay=st.one_of(st.none(), st.integers(15, 100)), ttl=TTLS)
        def publish(self, into: list[str], priority: int, delay: int | None, ttl: int | None) -> None:
            """Publish to each target queue in one pipeline: mostly within one ms, so ties
            of priority and time are broken by id (one queue) and by queue order (several).
            A 1 ms TTL is waited out at once (delayed messages get 60 s: their TTL counts
            from the ETA, which test_ttl_expiry covers)."""
            if delay is not None and ttl == 1:
                ttl = 60_000
            t0 = self.now()
            eta = None if delay is None else t0 + delay
            payloads = []
            for queue in into:
                self.m.published[queue] += 1
                payloads.append(f"{queue}-{self.m.published[queue]}")
            ids = self.lib.run_many([self.lib.calls.publish(q, p, priority=priority, eta_ms=eta, ttl_ms=ttl)
                                     for q, p in zip(into, payloads, strict=True)])
            t1 = self.now()
            for queue, payload, message_id in zip(into, payloads, ids, strict=True):
                assert is_message_id(message_id)
                assert message_id > self.m.last_id.get(queue, ""), "ids only grow, per queue name"
                self.m.last_id[queue] = self.m.meta_last_id[queue] = message_id
                m = Msg(queue, message_id, payload.encode(), priority, "ready")
                self.m.messages[queue, message_id] = m
                if ttl is not None:
                    state = text(client.hget(k.state(queue), message_id)).split(" ")
                    m.expires_at = int(state[3])
                    base = (t0, t1) if eta is None else (eta, eta)
                    assert base[0] + ttl <= m.expires_at <= base[1] + ttl, (m, base)
                delayed_score = client.zscore(k.delayed(queue), message_id)
                if delayed_score is not None:
                    assert eta is not None and int(delayed_score) == eta
                    m.state, m.eta = "delayed", eta
                else:
                    assert eta is None or eta <= t1, "a future ETA was made ready"
                    self.record_ready(m, t0, t1)
            if ttl == 1:
                wait_for_server_time(client, t1 + 2)  # past every 1 ms TTL just given

        @rule(count=st.integers(1, 5), only=st.one_of(st.none(), st.sampled_from(queues)),
              lapse=st.booleans())
        def consume(self, count: int, only: str | None, lapse: bool) -> None:
            """From every queue (merged by priority), or from one (ZPOPMIN). With ``lapse``
            the consumer dies: its deliveries pass their visibility deadline (server clock)."""
            delivered = self.do_consume(count, [only] if only else queues)
            if lapse and delivered:
                self.time_out(delivered)

        def do_consume(self, count: int, asked: list[str]) -> list[Msg]:
            t0 = self.now()
            consumed = self.lib.consume(asked, count)
            t1 = self.now()
            expected: list[Msg] = []
            expired: list[Msg] = []
            wake_etas: list[int] = []
            self.resolve_promotions([q for q in queues if q not in asked], False, t0, t1)
            for group in self.lib.slot_groups(asked):  # asked in turn until count is reached
                visited = len(expected) < count
                self.resolve_promotions(group, visited, t0, t1)
                if not visited:
                    continue
                ready = [m for q in group for m in self.m.in_state("ready", q)]
                ready.sort(key=lambda m: (m.score, group.index(m.queue), m.id))
                for m in ready:  # expired ones are dead-lettered and replaced
                    if len(expected) == count:
                        break
                    (expired if self.m.expired(m, t0) else expected).append(m)
                wake_etas += [m.eta for q in group for m in self.m.in_state("delayed", q) if m.eta]
            actual = [(d.queue, d.id, d.delivery_count, d.payload) for d in consumed.deliveries]
            assert actual == [m.delivery() for m in expected]
            assert consumed.expired == len(expired)
            for m in expired:
                self.dead_letter(m, "expired", m.delivery_count)
                self.m.held.discard((m.queue, m.id))
            for q in queues:  # within a queue: priority never rises
                priorities = [m.priority for m in expected if m.queue == q]
                assert priorities == sorted(priorities, reverse=True)
            if wake_etas:
                low, high = max(0, min(wake_etas) - t1), max(0, min(wake_etas) - t0)
                assert consumed.wake_in_ms is not None and low <= consumed.wake_in_ms <= high
            else:
                assert consumed.wake_in_ms is None
            for m in expected:
                m.state, m.score, m.timed_out_step, m.restored = "unacked", None, None, False
                self.m.held.add((m.queue, m.id))
            return expected

        @rule(picks=PICKS, stale=st.one_of(st.none(), st.integers(0, 63)))
        def ack(self, picks: list[int], stale: int | None) -> None:
            """Ack held deliveries (in flight, restored by a sweep, or of a queue deleted or
            expired since), maybe plus an id that is gone."""
            queues_held = sorted({q for q, _ in self.m.held})
            if not queues_held:
                return
            queue = queues_held[picks[0] % len(queues_held)]
            ids = pick(sorted(i for q, i in self.m.held if q == queue), picks)
            ids += pick(sorted(i for q, i in self.m.gone if q == queue and i not in ids),
                        [] if stale is None else [stale])
            existing = [i for i in ids if (queue, i) in self.m.messages]
            assert self.lib.ack(queue, ids) == len(existing)
            for i in ids:
                self.m.held.discard((queue, i))
                self.m.messages.pop((queue, i), None)
                self.m.gone.add((queue, i))

        @rule(picks=PICKS, requeue=st.booleans(), late=st.booleans())
        def reject(self, picks: list[int], requeue: bool, late: bool) -> None:
            """Reject in-flight deliveries; with ``late``, also one whose queue was deleted or
            expired since (it must change nothing)."""
            in_flight = sorted({m.queue for m in self.m.in_state("unacked")})
            if not in_flight:
                return
            queue = in_flight[picks[0] % len(in_flight)]
            ids = pick([m.id for m in self.m.in_state("unacked", queue)], picks)
            gone_held = sorted(i for q, i in self.m.held if q == queue and (q, i) not in self.m.messages)
            stale = pick(gone_held, picks[:1]) if late else []
            t0 = self.now()
            result = self.lib.reject(queue, ids + stale, requeue=requeue)
            t1 = self.now()
            requeued = dead = 0
            for i in stale:
                self.m.held.discard((queue, i))
            for i in ids:
                m = self.m.messages[queue, i]
                self.m.held.discard((queue, i))
                if requeue and m.delivery_count + 1 < LIMIT:
                    m.delivery_count += 1
                    self.record_ready(m, t0, t1)
                    requeued += 1
                else:
                    self.dead_letter(m, "delivery-limit" if requeue else "rejected",
                                     m.delivery_count + requeue)
                    dead += 1
            assert result == Rejected(requeued, dead, 0)

        @rule(picks=st.lists(st.integers(0, 63), min_size=1, max_size=4))
        def extend(self, picks: list[int]) -> None:
            """60 s deadlines for whatever is indexed among the ids (gone ids are ignored)."""
            known = sorted({key for key in self.m.messages if self.m.messages[key].state == "unacked"}
                           | self.m.gone)
            if not known:
                return
            queue = known[picks[0] % len(known)][0]
            ids = pick([i for q, i in known if q == queue], picks)
            indexed = [self.m.messages[queue, i] for i in ids if (queue, i) in self.m.messages]
            assert self.lib.extend(queue, ids) == len(indexed)
            for m in indexed:
                m.timed_out_step = None

        def time_out(self, chosen: list[Msg]) -> None:
            """Push the deadlines of ``chosen`` (in flight, one queue each) into the past."""
            for queue in sorted({m.queue for m in chosen}):
                ids = [m.id for m in chosen if m.queue == queue]
                assert self.short.extend(queue, ids) == len(ids)
            wait_for_server_time(client, self.now() + 2)
            self.step += 1
            for m in chosen:
                m.timed_out_step = self.step

        @rule()
        def sweep(self) -> None:
            index = {q: {text(i): int(s) for i, s in client.zrange(k.index(q), 0, -1, withscores=True)}
                     for q in queues}
            t0 = self.now()
            report = self.lib.sweep(queues)
            t1 = self.now()
            promoted = self.resolve_promotions(queues, True, t0, t1)
            requeued, expired, dead_lettered, dropped = 0, 0, 0, []
            for group in self.lib.slot_groups(queues):
                for q in group:
                    due = [m for m in self.m.messages.values() if m.queue == q and (
                        (m.state == "unacked" and m.timed_out_step is not None)
                        or (m.state == "ready" and m.score is not None and m.id in index[q]
                            and self.m.expired(m, t0) and index[q][m.id] <= t0))]
                    for m in sorted(due, key=lambda m: (index[q][m.id], m.id)):
                        if m.state == "ready":  # its TTL passed while it waited
                            dropped.append((q, m.id, m.delivery_count, "expired", m.payload))
                            self.dead_letter(m, "expired", m.delivery_count)
                            expired += 1
                        elif m.delivery_count + 1 < LIMIT:
                            m.delivery_count += 1
                            self.record_ready(m, t0, t1)
                            m.restored = (q, m.id) in self.m.held
                            requeued += 1
                        else:
                            dropped.append((q, m.id, m.delivery_count + 1, "delivery-limit", m.payload))
                            self.dead_letter(m, "delivery-limit", m.delivery_count + 1)
                            dead_lettered += 1
            assert (report.promoted, report.requeued, report.limit_reached, report.expired) == (
                promoted, requeued, dead_lettered, expired)
            assert (report.unclaimed, report.backlog, report.orphans, report.more) == (0, 0, 0, False)
            assert [(d.queue, d.id, d.delivery_count, d.reason, d.payload)
                    for d in report.dropped_messages] == dropped[:10]

        @rule()
        def wait_for_delayed(self) -> None:
            """Until every delayed message is due by the server clock (no-op without any)."""
            wait_for_server_time(client, max([m.eta or 0 for m in self.m.in_state("delayed")], default=0))

        @rule(queue=st.sampled_from(queues))
        def delete(self, queue: str) -> None:
            """Delete the queue (then a consumer declares it again, if it expires)."""
            held = len([m for m in self.m.messages.values() if m.queue == queue])
            assert self.lib.delete(queue).messages == held
            self.forget_queue(queue)
            assert not (all_keys(client) & set(k.queue_keys(queue)))
            if queue == expiring:
                self.declare_expiring()

        @rule()
        def expire(self) -> None:
            """The expiring queue's time runs out: the server expires all its keys at once
            (declare floors x-expires at 10 s, so the deadline is brought forward here)."""
            names = [key for key in k.queue_keys(expiring) if key in all_keys(client)]
            at = self.now() + 5
            for name in names:
                client.pexpireat(name, at)
            wait_until(lambda: not (all_keys(client) & set(names)), timeout=10, interval=0.005,
                       what="the queue expired")
            self.forget_queue(expiring)
            self.declare_expiring()

        @invariant()
        def server_matches_model(self) -> None:
            now = self.now()
            present = all_keys(client)
            for q in queues:
                queued = {text(i): int(s) for i, s in client.zrange(k.queue(q), 0, -1, withscores=True)}
                # One wake token while anything is ready or delayed (a consumer blocked on the
                # list must wake for it), none once the queue is idle (nothing is left behind).
                busy = bool(self.m.in_state("ready", q) or self.m.in_state("delayed", q))
                assert client.lrange(k.wake(q), 0, -1) == ([b"1"] if busy else []), q
                assert queued == {m.id: m.score for m in self.m.in_state("ready", q)}, q
                delayed = {text(i): int(s) for i, s in client.zrange(k.delayed(q), 0, -1, withscores=True)}
                assert delayed == {m.id: m.eta for m in self.m.in_state("delayed", q)}, q
                index = {text(i): int(s) for i, s in client.zrange(k.index(q), 0, -1, withscores=True)}
                in_flight = self.m.in_state("unacked", q)
                expiring_ready = [m for m in self.m.in_state("ready", q) if m.expires_at is not None]
                assert set(index) == {m.id for m in expiring_ready + in_flight}, q
                for m in in_flight:
                    assert m.id not in queued, f"{m.id} is in flight and ready at once"
                    assert (index[m.id] < now) if m.timed_out_step else (index[m.id] > now + VIS // 2)
                for m in expiring_ready:  # the sweep looks at it by its TTL at the latest
                    assert index[m.id] <= m.expires_at, m
                mine = [m for m in self.m.messages.values() if m.queue == q]
                states = {text(i): text(v) for i, v in client.hgetall(k.state(q)).items()}
                assert states == {m.id: m.state_string() for m in mine}, q
                payloads = {text(i): v for i, v in client.hgetall(k.message(q)).items()}
                assert payloads == {m.id: m.payload for m in mine}, q
                last = client.hget(k.meta(q), "last_id")
                assert (None if last is None else text(last)) == self.m.meta_last_id[q], q
                assert [(d.id, d.reason, d.delivery_count, d.priority, d.payload)
                        for d in self.lib.dead_list(q)] == self.m.dead[q]
                for m in self.m.messages.values():
                    if m.state == "ready" and (m.queue, m.id) in self.m.held:
                        assert m.restored, f"{m.id} is held in flight and ready without a sweep restoring it"
                names = [key for key in k.queue_keys(q) if key in present]
                if q == expiring:  # every key of the queue expires at one time, messages included
                    assert len({client.pexpiretime(name) for name in names}) == 1, names
                    assert all(client.pexpiretime(name) > now for name in names)
                else:
                    assert all(client.pttl(name) == -1 for name in names)
            assert present <= {key for q in queues for key in k.queue_keys(q)}

        def teardown(self) -> None:
            if sys.exc_info()[0] is not None:
                return  # a step failed: report that, not a follow-on failure here
            delayed = self.m.in_state("delayed")
            if delayed:
                wait_for_server_time(client, max(m.eta or 0 for m in delayed))
            while self.m.in_state("ready") or self.m.in_state("delayed"):
                self.do_consume(5, queues)
            for q in queues:
                ids = sorted(i for queue, i in self.m.held if queue == q)
                if ids:
                    assert self.lib.ack(q, ids) == sum((q, i) in self.m.messages for i in ids)
                    for i in ids:
                        self.m.messages.pop((q, i), None)
            assert not self.m.messages
            expected = {k.meta(q) for q in queues if self.m.meta_last_id[q] is not None}
            expected |= {k.dead(q) for q in queues if self.m.dead[q]}
            assert all_keys(client) == expected

    return QueueMachine


def run(client: Any, keyspace: Keyspace, queues: list[str], examples: int) -> None:
    machine = make_machine(client, keyspace, queues, expiring=queues[-1])
    run_machine(machine, settings=settings(
        max_examples=examples, stateful_step_count=30, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_model_on_standalone_valkey(valkey_server: Server) -> None:
    """Two queues consumed together: one consume call merges them by priority; 'b' has an
    x-expires."""
    with closing(valkey_server.client(socket_timeout=10)) as client:
        run(client, Keyspace(), ["a", "b"], examples=40)


def test_model_on_standalone_redis(redis_server: Server) -> None:
    with closing(redis_server.client(socket_timeout=10)) as client:
        run(client, Keyspace("app:"), ["a", "b"], examples=15)


def test_model_on_valkey_cluster(valkey_cluster: Cluster) -> None:
    """Three queues, one per primary: the library asks each slot group in turn."""
    keyspace = Keyspace("app:")
    with closing(valkey_cluster.client(socket_timeout=10)) as client:
        run(client, keyspace, names_on_each_node(client, keyspace, "mq"), examples=12)


def test_a_consume_that_takes_the_last_messages_leaves_no_wake_token(valkey_server: Server) -> None:
    """Found by the model: a consume that promotes the last delayed message and takes
    exactly what is left (e.g. prefetch 1) must not leave a wake token behind."""
    with closing(valkey_server.client(socket_timeout=10)) as client:
        client.flushall()
        lib = ScriptLibrary(client, Keyspace(), visibility_ms=VIS)
        lib.publish("w", "ready")
        eta = server_now_ms(client) + 20
        lib.publish("w", "delayed", eta_ms=eta)
        wait_for_server_time(client, eta)
        consumed = lib.consume(["w"], 2)
        assert [d.payload for d in consumed.deliveries] == [b"ready", b"delayed"]
        assert consumed.wake_in_ms is None  # nothing is delayed any more...
        assert lib.ack("w", [d.id for d in consumed.deliveries]) == 2
        assert all_keys(client) == {"meta:{w}"}  # ...so nothing may wake a blocked consumer
