"""Limits per queue for all its consumers together, held in the broker (lua/limit.lua, enforced
by consume; ack, reject and the sweep wake a consumer when they free a slot).

An in-flight cap: at most N messages of the queue delivered and not yet acked, whoever holds
them; a rate: at most N deliveries per second, minute or hour (a token bucket of burst
max(1, N / 10)), judged by the server's clock. What a limit holds back is not touched: no
delivery count, no index entry. Script level on every server kind (standalone and cluster,
with and without a key prefix), then through kombu and the CLI.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from kombu import Consumer, Exchange, Producer, Queue
from kombu.message import Message

from celery_redis_lua import Limits, Policy, ScriptError, ScriptLibrary
from helpers import same_slot_names, server_now_ms, wait_for_server_time, wait_until
from kombu_support import Broker


def declared(lib: ScriptLibrary, name: str, messages: int = 0, **publish: object) -> str:
    lib.declare(name)
    for i in range(messages):
        lib.publish(name, f"m{i}", **publish)  # type: ignore[arg-type]
    return name


def states(lib: ScriptLibrary, queue: str) -> list[bytes]:
    found = lib.client.hgetall(lib.keys.state(queue))
    return sorted(v for k, v in found.items() if not k.startswith(b"task:"))


# -- the in-flight cap -------------------------------------------------------------------------

def test_a_capped_queue_delivers_up_to_its_cap_whoever_consumes(lib: ScriptLibrary) -> None:
    declared(lib, "capped", 10)
    assert lib.limit("capped", in_flight=3) == Limits(3, None)
    first = lib.consume(["capped"], 2).deliveries
    second = lib.consume(["capped"], 10).deliveries  # another consumer: the cap is the queue's
    assert (len(first), len(second)) == (2, 1)
    assert lib.consume(["capped"], 10).deliveries == []
    [m] = lib.metrics(["capped"])
    assert (m.ready, m.in_flight, m.limits) == (7, 3, Limits(3, None))
    # Nothing refused was touched: no delivery counted, no index entry.
    assert lib.client.zcard(lib.keys.index("capped")) == 3
    assert [s.split()[:2] for s in states(lib, "capped")].count([b"ready", b"0"]) == 7
    assert lib.ack("capped", [first[0].id]) == 1
    assert len(lib.consume(["capped"], 10).deliveries) == 1  # the freed slot, one message


def test_delayed_retries_and_countdowns_are_not_in_flight(lib: ScriptLibrary) -> None:
    declared(lib, "later", 3)
    lib.publish("later", "countdown", eta_ms=server_now_ms(lib.client) + 600_000)
    lib.limit("later", in_flight=2)
    assert len(lib.consume(["later"], 10).deliveries) == 2
    assert lib.stats(["later"])[0].in_flight == 2


def test_a_consume_across_queues_caps_each_and_keeps_priority_order(lib: ScriptLibrary) -> None:
    capped, free = same_slot_names(2, lib.keys, "mix")
    declared(lib, capped)
    declared(lib, free)
    for i in range(4):
        lib.publish(capped, f"c{i}", priority=9)
        lib.publish(free, f"f{i}", priority=5)
    lib.publish(free, "top", priority=10)
    lib.limit(capped, in_flight=2)
    consumed = lib.consume([capped, free], 10).deliveries
    assert [d.payload for d in consumed] == [b"top", b"c0", b"c1", b"f0", b"f1", b"f2", b"f3"]


def test_the_cap_drops_the_wake_token_and_a_freed_slot_pushes_it(lib: ScriptLibrary) -> None:
    declared(lib, "gate", 6)
    wake = lib.keys.wake("gate")
    lib.limit("gate", in_flight=2)
    a, b = lib.consume(["gate"], 10).deliveries
    assert lib.client.llen(wake) == 0  # a consumer blocked now is not woken in vain
    lib.publish("gate", "more")
    assert lib.client.llen(wake) == 0  # a ready message at the cap wakes nobody either
    lib.client.rpush(wake, "1")  # a token someone pushed (a requeue, a sweep, an old publish)
    assert lib.consume(["gate"], 10).deliveries == []  # refused by the cap: drops it
    assert lib.client.llen(wake) == 0
    lib.ack("gate", [a.id])
    assert lib.client.llen(wake) == 1  # the freed slot wakes a blocked consumer
    [c] = lib.consume(["gate"], 10).deliveries
    assert lib.client.llen(wake) == 0
    assert lib.reject("gate", [b.id], requeue=False).dead_lettered == 1
    assert lib.client.llen(wake) == 1  # a dropped delivery frees a slot too
    assert len(lib.consume(["gate"], 10).deliveries) == 1
    assert lib.reject("gate", [c.id], requeue=True).requeued == 1
    assert lib.client.llen(wake) == 1
    assert {x.payload for x in lib.consume(["gate"], 10).deliveries} <= {b"m0", b"m1", b"m2", b"m3",
                                                                          b"m4", b"m5", b"more"}


def test_a_timed_out_delivery_frees_its_slot(lib: ScriptLibrary) -> None:
    quick = ScriptLibrary(lib.client, lib.keys, Policy(visibility_ms=50, delivery_limit=1))
    declared(quick, "late", 3)
    quick.limit("late", in_flight=1)
    [taken] = quick.consume(["late"], 10).deliveries
    wake = lib.keys.wake("late")
    assert lib.client.llen(wake) == 0
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 60)
    report = quick.sweep(["late"])
    assert report.limit_reached == 1  # its one delivery was its last: dead-lettered
    assert lib.client.llen(wake) == 1
    [after] = quick.consume(["late"], 10).deliveries
    assert after.id != taken.id


def test_an_unlimited_queue_consumes_as_before(lib: ScriptLibrary) -> None:
    declared(lib, "free", 5)
    assert len(lib.consume(["free"], 3).deliveries) == 3
    assert lib.client.llen(lib.keys.wake("free")) == 1  # left messages: the token stays
    assert lib.metrics(["free"])[0].limits == Limits()
    assert not [f for f in lib.client.hkeys(lib.keys.meta("free")) if f.startswith(b"limit")]


# -- the rate ----------------------------------------------------------------------------------

def test_a_rate_gives_its_burst_then_one_token_per_interval(lib: ScriptLibrary) -> None:
    declared(lib, "paced", 30)
    lib.limit("paced", rate="100/s")  # burst 10, a token every 10 ms
    first = lib.consume(["paced"], 30)
    assert len(first.deliveries) == 10
    assert first.wake_in_ms is not None and 1 <= first.wake_in_ms <= 10
    assert lib.client.llen(lib.keys.wake("paced")) == 0  # refused consumers wait on wake_in_ms
    refused = lib.consume(["paced"], 30)
    assert refused.deliveries == [] and refused.wake_in_ms is not None and refused.wake_in_ms <= 10
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 35)
    assert 3 <= len(lib.consume(["paced"], 30).deliveries) <= 5  # 35-45 ms of tokens at 10 ms
    assert all(s.startswith(b"ready 0 ") for s in states(lib, "paced") if s.startswith(b"ready"))


def test_a_slow_rate_tells_how_long_until_the_next_token(lib: ScriptLibrary) -> None:
    declared(lib, "hourly", 3)
    lib.limit("hourly", rate="2/h")  # burst 1, a token every 30 minutes
    assert len(lib.consume(["hourly"], 3).deliveries) == 1
    refused = lib.consume(["hourly"], 3)
    assert refused.deliveries == []
    assert refused.wake_in_ms is not None and 1_799_000 <= refused.wake_in_ms <= 1_800_000
    lib.limit("hourly", rate="100/s")  # a new rate starts with a full bucket
    assert lib.client.llen(lib.keys.wake("hourly")) == 1  # and wakes a consumer
    assert len(lib.consume(["hourly"], 3).deliveries) == 2


def test_a_rate_replies_its_wait_again_last_for_the_consumer_to_time(lib: ScriptLibrary) -> None:
    # rate_in_ms: the consumer times a rate's wait itself (the server ends a block up to
    # 1/hz late); an ETA's wait stays the block's (wake_in_ms only).
    rated, soon = same_slot_names(2, lib.keys, "timed")
    declared(lib, rated, 3)
    declared(lib, soon, 1, eta_ms=server_now_ms(lib.client) + 60_000)
    assert lib.consume([soon], 1).rate_in_ms is None  # an ETA, no rate
    lib.limit(rated, rate="2/h")
    took = lib.consume([rated], 3)
    assert len(took.deliveries) == 1 and took.rate_in_ms is not None
    assert took.rate_in_ms == took.wake_in_ms and 1_799_000 <= took.rate_in_ms <= 1_800_000
    both = lib.consume([rated, soon], 3)  # the ETA comes first: both waits, each its own
    assert both.deliveries == [] and both.wake_in_ms is not None and both.wake_in_ms <= 60_000
    assert both.rate_in_ms is not None and both.rate_in_ms > 1_799_000
    lib.purge(rated)
    assert lib.consume([rated], 3).rate_in_ms is None  # nothing held back: no wait


def test_a_consumer_late_for_its_token_keeps_its_place(lib: ScriptLibrary) -> None:
    declared(lib, "late", 4)
    lib.limit("late", rate="2/s")  # burst 1, a token every 500 ms
    meta = lib.keys.meta("late")
    assert len(lib.consume(["late"], 4).deliveries) == 1
    due = int(lib.client.hget(meta, "limit_tat"))  # the next token's time, unix us
    # 100 ms late (less than half an interval): the token after stays 500 ms after this one's
    # due time, not after the late consume, so the wake's lateness is not lost.
    wait_for_server_time(lib.client, due // 1000 + 100)
    assert len(lib.consume(["late"], 4).deliveries) == 1
    assert int(lib.client.hget(meta, "limit_tat")) == due + 500_000
    # Idle past half an interval: the bucket starts afresh at now (one token, no more).
    wait_for_server_time(lib.client, (due + 500_000) // 1000 + 300)
    before_us = server_now_ms(lib.client) * 1000
    assert len(lib.consume(["late"], 4).deliveries) == 1
    assert int(lib.client.hget(meta, "limit_tat")) >= before_us + 500_000


def test_refused_consumes_spend_no_tokens(lib: ScriptLibrary) -> None:
    declared(lib, "tokens", 4)
    lib.limit("tokens", rate="1/m")
    assert len(lib.consume(["tokens"], 4).deliveries) == 1
    tat = lib.client.hget(lib.keys.meta("tokens"), "limit_tat")
    for _ in range(5):
        assert lib.consume(["tokens"], 4).deliveries == []
    assert lib.client.hget(lib.keys.meta("tokens"), "limit_tat") == tat


def test_cap_and_rate_together(lib: ScriptLibrary) -> None:
    declared(lib, "both", 20)
    assert lib.limit("both", in_flight=8, rate="50/s") == Limits(8, "50/s")
    assert str(lib.metrics(["both"])[0].limits) == "8 in flight, 50/s"
    assert len(lib.consume(["both"], 20).deliveries) == 5  # the rate's burst of 5 binds first


# -- the limit script ------------------------------------------------------------------------

def test_limits_change_and_clear_at_any_time(lib: ScriptLibrary) -> None:
    declared(lib, "knobs", 4)
    assert lib.limit("knobs", in_flight=1) == Limits(1, None)
    assert lib.limit("knobs", rate="5/m") == Limits(1, "5/m")
    assert lib.limit("knobs", in_flight=2) == Limits(2, "5/m")
    assert lib.limit("knobs", clear_rate=True) == Limits(2, None)
    assert lib.limit("knobs", clear_in_flight=True, rate="007/s") == Limits(None, "7/s")
    assert lib.limit("knobs", clear_in_flight=True, clear_rate=True) == Limits()
    meta = lib.client.hkeys(lib.keys.meta("knobs"))
    assert not [f for f in meta if f.startswith(b"limit")]


def test_a_lower_cap_wakes_nobody_and_a_higher_one_or_clearing_does(lib: ScriptLibrary) -> None:
    declared(lib, "wakes", 5)
    wake = lib.keys.wake("wakes")
    lib.limit("wakes", in_flight=1)
    lib.consume(["wakes"], 10)
    assert lib.client.llen(wake) == 0
    lib.limit("wakes", in_flight=1)
    assert lib.client.llen(wake) == 0
    lib.limit("wakes", in_flight=3)
    assert lib.client.llen(wake) == 1
    assert len(lib.consume(["wakes"], 10).deliveries) == 2
    lib.limit("wakes", clear_in_flight=True)
    assert lib.client.llen(wake) == 1
    lib.pause("wakes")
    lib.limit("wakes", in_flight=10)
    assert lib.client.llen(wake) == 0  # paused: resume wakes, not a limit


BAD = [
    ({"in_flight": -1}, "in_flight must be an integer in 1..1000000, 'clear' or '', got '-1'"),
    ({"in_flight": 0}, "got '0'"),
    ({"in_flight": "lots"}, "got 'lots'"),
    ({"in_flight": 1_000_001}, "got '1000001'"),
    ({"rate": "0/s"}, "rate must be N/s, N/m or N/h with N an integer in 1..1000000, 'clear' or '', "
                      "got '0/s'"),
    ({"rate": "10/d"}, "got '10/d'"),
    ({"rate": "10"}, "got '10'"),
    ({"rate": "1.5/s"}, "got '1.5/s'"),
    ({"rate": "-3/m"}, "got '-3/m'"),
    ({}, "nothing to change"),
]


@pytest.mark.parametrize(("given", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_limits_are_refused_by_value_and_change_nothing(lib: ScriptLibrary, given: dict[str, object],
                                                            message: str) -> None:
    declared(lib, "strict", 2)
    lib.limit("strict", in_flight=5, rate="10/s")
    meta = lib.client.hgetall(lib.keys.meta("strict"))
    wake = lib.client.lrange(lib.keys.wake("strict"), 0, -1)
    with pytest.raises(ScriptError, match=r"celery-redis-lua: limit: .*" + re.escape(message)):
        lib.limit("strict", **given)  # type: ignore[arg-type]
    assert lib.client.hgetall(lib.keys.meta("strict")) == meta
    assert lib.client.lrange(lib.keys.wake("strict"), 0, -1) == wake


def test_limiting_a_queue_that_does_not_exist_is_refused(lib: ScriptLibrary) -> None:
    with pytest.raises(ScriptError, match=r"limit: no queue '.*meta:\{nowhere\}'"):
        lib.limit("nowhere", in_flight=3)
    assert lib.client.exists(lib.keys.meta("nowhere")) == 0


def test_setting_and_clearing_one_limit_at_once_is_refused_in_python(lib: ScriptLibrary) -> None:
    declared(lib, "both-ways")
    with pytest.raises(ValueError, match="set a limit or clear it, not both"):
        lib.limit("both-ways", in_flight=3, clear_in_flight=True)


# -- through kombu: prefetch and a blocked consumer ---------------------------------------------

def test_a_prefetching_consumer_holds_no_more_than_the_cap(kind_broker: Broker) -> None:
    """Two kombu consumers with prefetch 10 each on a queue capped at 3: together they hold 3;
    an ack by one frees a slot that a consumer blocked in BLPOP (blocking_timeout 60) takes
    at once."""
    queue = Queue("capq", Exchange("capq"), routing_key="capq")
    lib = kind_broker.lib
    got: list[Message] = []
    lock = threading.Lock()

    def keep(body: object, message: Message) -> None:
        with lock:
            got.append(message)

    with kind_broker.connection(blocking_timeout=60) as one, \
            kind_broker.connection(blocking_timeout=60) as two:
        consumers = [Consumer(c, [queue], callbacks=[keep], prefetch_count=10) for c in (one, two)]
        for c in consumers:
            c.consume()
        lib.limit("capq", in_flight=3)
        producer = Producer(one, exchange=queue.exchange, routing_key="capq")
        for i in range(8):
            producer.publish({"i": i})
        stop = threading.Event()

        def drain(conn: object) -> None:
            while not stop.is_set():
                with contextlib.suppress(socket.timeout, TimeoutError):
                    conn.drain_events(timeout=0.5)  # type: ignore[attr-defined]

        threads = [threading.Thread(target=drain, args=(c,)) for c in (one, two)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: len(got) == 3, timeout=10, what="three delivered")
            wait_until(lambda: kind_broker.blocked_clients() >= 2, timeout=10, what="both blocked")
            assert len(got) == 3 and lib.stats(["capq"])[0].in_flight == 3
            for i in range(5):
                with lock:
                    first = got.pop(0)
                first.ack()
                wait_until(lambda: len(got) == 3, timeout=5, what=f"the freed slot {i} taken at once")
                assert lib.stats(["capq"])[0].in_flight <= 3
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=70)
        for message in got:
            message.ack()
        for c in consumers:
            c.cancel()
    assert lib.stats(["capq"])[0].ready == 0


def test_a_kombu_consumer_times_a_rates_wait_itself(kind_broker: Broker) -> None:
    """drain_events (no event loop), blocked with blocking_timeout 60: a consumer the rate
    refused consumes at the next token on its own clock (the server ends a block up to 1/hz,
    100 ms by default, late), and its block still wakes it at once for another queue."""
    rated = Queue("rateq", Exchange("rateq"), routing_key="rateq")
    free = Queue("freeq", Exchange("freeq"), routing_key="freeq")
    lib = kind_broker.lib
    arrived: list[tuple[str, float]] = []

    def keep(body: object, message: Message) -> None:
        arrived.append((message.delivery_info["routing_key"], time.monotonic()))
        message.ack()

    def drain_until(count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(arrived) < count and time.monotonic() < deadline:
            with contextlib.suppress(socket.timeout, TimeoutError):
                conn.drain_events(timeout=0.2)  # type: ignore[attr-defined]
        assert len(arrived) >= count, arrived

    with kind_broker.connection(blocking_timeout=60) as conn:
        consumer = Consumer(conn, [rated, free], callbacks=[keep], prefetch_count=10)
        consumer.consume()
        lib.limit("rateq", rate="10/s")  # burst 1: a token every 100 ms, and no more
        to_rated = Producer(conn, exchange=rated.exchange, routing_key="rateq")
        for _ in range(21):
            to_rated.publish({})
        drain_until(21, timeout=10)
        times = [at for _, at in arrived]
        assert 10 * 0.95 <= 20 / (times[-1] - times[0]) <= 10 * 1.05, times[-1] - times[0]
        lib.limit("rateq", rate="1/m")  # one token, then the next in a minute
        to_rated.publish({})
        to_rated.publish({})
        drain_until(22, timeout=5)
        published = time.monotonic()
        Producer(conn, exchange=free.exchange, routing_key="freeq").publish({})
        drain_until(23, timeout=5)
        assert arrived[-1][0] == "freeq" and arrived[-1][1] - published < 2
        consumer.cancel()


def test_the_cli_sets_shows_and_clears_limits(kind_broker: Broker) -> None:
    from click.testing import CliRunner

    from celery_redis_lua.tools.cli import main

    url = f"redis://127.0.0.1:{kind_broker.server.port}/0"
    at = ["--url", url, "--prefix", kind_broker.prefix]
    kind_broker.lib.declare("cli-limited")
    runner = CliRunner()
    done = runner.invoke(main, ["limit", "cli-limited", "--in-flight", "8", "--rate", "20/s", *at])
    assert done.exit_code == 0 and "'cli-limited' limits: 8 in flight, 20/s" in done.output, done.output
    # What the cap counts, said where it is set (issue 38): unacked deliveries, so prefetch.
    assert done.stdout.splitlines()[1] == (
        "The in-flight cap counts unacked deliveries: with Celery's default early ack it limits "
        "prefetch, not running tasks; to cap running tasks, set task_acks_late=True."), done.output
    rate_only = runner.invoke(main, ["limit", "cli-limited", "--rate", "20/s", *at])
    assert rate_only.stdout.splitlines() == ["'cli-limited' limits: 8 in flight, 20/s"], rate_only.output
    shown = runner.invoke(main, ["status", "--queue", "cli-limited", *at])
    assert shown.output.splitlines()[0].split()[-1] == "limits"
    assert "8 in flight, 20/s" in shown.output, shown.output
    cleared = runner.invoke(main, ["limit", "cli-limited", "--clear-rate", *at])
    assert "limits: 8 in flight" in cleared.output, cleared.output
    cleared = runner.invoke(main, ["limit", "cli-limited", "--clear", *at])
    assert "limits: -" in cleared.output, cleared.output
    for bad, fragment in [(["--in-flight", "-2"], "got '-2'"), (["--rate", "0/s"], "got '0/s'"),
                          (["--rate", "5/d"], "got '5/d'"), (["--in-flight", "x"], "got 'x'"),
                          ([], "give --in-flight, --rate or a --clear option"),
                          (["--clear", "--rate", "5/s"], "--clear clears both"),
                          # Absurd N: refused naming the flag it was typed with (issue 38).
                          (["--in-flight", str(10**19)],
                           "--in-flight must be an integer in 1..1000000 (or --clear-in-flight), "
                           "got '10000000000000000000'"),
                          (["--rate", "1000001/m"], "--rate must be N/s, N/m or N/h with N an integer in "
                                                    "1..1000000")]:
        refused = runner.invoke(main, ["limit", "cli-limited", *bad, *at])
        assert refused.exit_code != 0 and fragment in refused.stderr, (bad, refused.stderr)
        assert refused.stdout == ""
    missing = runner.invoke(main, ["limit", "no-such-queue", "--in-flight", "2", *at])
    assert missing.exit_code == 3 and "no queue 'no-such-queue'" in missing.stderr
    assert kind_broker.lib.metrics(["cli-limited"])[0].limits == Limits()


def test_the_operations_page_says_what_the_in_flight_cap_counts() -> None:
    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text().split())
    assert "What the in-flight cap counts: unacked deliveries" in page
    assert "the cap limits prefetch (tasks delivered and not yet started), not running tasks" in page
    assert "a cap on running tasks needs `task_acks_late=True`" in page
