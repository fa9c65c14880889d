"""Lifetimes through kombu: queues and bindings that expire, message TTL, fanout groups and
their consumers, re-created queues. One test per defect found by trying the transport as
a user would (each failed on the code before its fix); on Valkey and Redis.

Waits are real: a queue's x-expires has a 10 s floor, so the tests that prove a consumed
queue outlives it hold a delivery for longer than that. Bindings of expiring queues live
max(x-expires, binding_lifetime_floor), which the tests lower through that option.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.message import Message

from celery_redis_lua import ScriptError
from celery_redis_lua.kombu.keeper import KEEPER
from conftest import TARGETS, require_kind
from helpers import message_state, server_now_ms, wait_for_server_time, wait_until
from kombu_support import Broker, consume, drain

EXPIRES_S = 10  # the x-expires floor


def collect(conn: Connection, queues: list[Queue], **consumer_args: Any) -> tuple[Consumer, list[Message]]:
    got: list[Message] = []
    consumer = Consumer(conn, queues, callbacks=[lambda body, message: got.append(message)],
                        **consumer_args)
    consumer.consume()
    return consumer, got


def drain_for(conn: Connection, seconds: float) -> None:
    """Keep the connection's loop turning (upkeep, sweep) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=min(left, 1.0))


def drain_until(conn: Connection, predicate: Any, timeout: float = 10, what: str = "condition") -> None:
    """Turn the connection's loop until ``predicate()`` holds (fails after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not met within {timeout}s"
        drain_for(conn, 0.1)


def binding_score(broker: Broker, exchange: str, member: bytes) -> float | None:
    return broker.client.zscore(broker.keys.binding(exchange), member)


# -- defect 1: bindings of expiring queues went stale under a live consumer --------------------

@pytest.mark.slow  # 22 s (it outlives binding lifetimes): make test-all, for CI's budget
def test_a_consumed_expiring_queue_keeps_its_bindings_and_its_route(kind_broker: Broker) -> None:
    """Found by a user: a queue with x-expires bound to a topic exchange got a binding that
    lived max(x-expires, 300 s), and nothing refreshed it while its consumer lived; after
    that, publishes to the exchange were dropped. Here the binding lives max(10 s, 3 s) (the
    floor lowered through its option) and the consumer runs for two lifetimes."""
    options = {"binding_lifetime_floor": 3, "visibility_timeout": 300}
    exchange = Exchange("ev", "topic")
    queue = Queue("evq", exchange, routing_key="#", expires=EXPIRES_S)
    with kind_broker.connection(**options) as consumer_conn, \
            kind_broker.connection(**options) as producer_conn:
        consumer, got = collect(consumer_conn, [queue], no_ack=True)
        [(member, first)] = kind_broker.client.zrange(kind_broker.keys.binding("ev"), 0, -1, withscores=True)
        assert first is not None and first <= server_now_ms(kind_broker.client) + EXPIRES_S * 1000
        producer = Producer(producer_conn, exchange=exchange)
        sent = 0
        deadline = time.monotonic() + 4 * EXPIRES_S / 2 + 2
        while time.monotonic() < deadline:  # past every lifetime the binding had
            producer.publish({"n": sent}, routing_key=f"ev.{sent}")
            sent += 1
            drain_for(consumer_conn, 1.0)
        drain(consumer_conn, got, sent)
        assert [m.payload["n"] for m in got] == list(range(sent))
        assert binding_score(kind_broker, "ev", member) > first  # refreshed by the upkeep
        consumer.cancel()


# -- defect 2: a consumed queue expired under its consumer ---------------------------------------

@pytest.mark.slow  # 15 s of waiting out expiries: make test-all, for CI's budget
def test_a_queue_with_a_consumer_never_expires_and_late_acks_touch_only_their_own(
        kind_broker: Broker) -> None:
    """Found by a user: with x-expires shorter than visibility_timeout / 3, the queue's keys
    (and its arguments) expired while a consumer held a message; the next publish reused
    the held message's id and the old delivery's ack deleted the new message."""
    queue = Queue("short", Exchange("shortx"), routing_key="short", expires=EXPIRES_S,
                  max_priority=5)
    keys = kind_broker.keys
    with kind_broker.connection(visibility_timeout=300) as conn:
        Producer(conn, exchange=queue.exchange, routing_key="short").publish("held", declare=[queue])
        consumer, got = collect(conn, [queue])
        drain(conn, got, 1)
        drain_for(conn, EXPIRES_S * 1.5)  # the consumer holds it for longer than x-expires
        assert kind_broker.client.hget(keys.meta("short"), "max_priority") == b"5"
        assert kind_broker.client.exists(keys.message("short"), keys.state("short")) == 2
        Producer(conn, exchange=queue.exchange, routing_key="short").publish("next")
        got[0].ack()  # the late ack
        drain(conn, got, 2)
        assert [m.payload for m in got] == ["held", "next"]
        got[1].ack()
        consumer.cancel()


# -- defect 3: message TTL ran while a message was delivered or delayed ----------------------

def test_a_held_message_past_its_ttl_is_dead_lettered_not_lost(kind_broker: Broker) -> None:
    """Found by a user: a worker that held a message past its TTL and requeued it lost it
    without a trace (the hash had expired; the sweep dropped the entry as an orphan)."""
    queue = Queue("ttlq", Exchange("ttlx"), routing_key="ttlq", message_ttl=0.5)
    with kind_broker.connection(sweep_interval=0.5) as conn:
        Producer(conn, exchange=queue.exchange, routing_key="ttlq").publish("slow", declare=[queue])
        consumer, got = collect(conn, [queue])
        drain(conn, got, 1)
        wait_for_server_time(kind_broker.client, server_now_ms(kind_broker.client) + 700)
        got[0].requeue()
        drain_until(conn, lambda: kind_broker.lib.dead_list("ttlq"), what="a dead letter")
        [dead] = kind_broker.lib.dead_list("ttlq")
        assert (dead.reason, dead.delivery_count) == ("expired", 1)
        assert b"c2xvdw==" in dead.payload  # base64 of the body "slow"
        assert len(got) == 1  # it was never delivered again past its TTL
        consumer.cancel()


def test_a_countdown_longer_than_the_message_ttl_still_runs(kind_broker: Broker) -> None:
    """Found by a user: the TTL ran from publish, so a countdown longer than message_ttl
    never ran. It counts from the ETA."""
    queue = Queue("cdq", Exchange("cdx"), routing_key="cdq", message_ttl=0.5)
    with kind_broker.connection() as conn:
        eta = time.time() + 1.5
        Producer(conn, exchange=queue.exchange, routing_key="cdq").publish(
            "later", declare=[queue], headers={"eta": _iso(eta)})
        [message] = consume(conn, [queue], 1)
        assert message.payload == "later"
        assert time.time() >= eta - 0.05
        assert kind_broker.lib.dead_list("cdq") == []


def _iso(unix: float) -> str:
    from datetime import UTC, datetime
    return datetime.fromtimestamp(unix, UTC).isoformat()


# -- defect 4: fanout ignored the queue's x-message-ttl and x-expires -----------------------

def _pidbox(expires: float, message_ttl: float) -> tuple[Exchange, Queue]:
    exchange = Exchange("ctl.pidbox", "fanout", durable=False, auto_delete=True)
    return exchange, Queue("w1.ctl.pidbox", exchange, expires=expires, message_ttl=message_ttl,
                           auto_delete=True, durable=False)


def test_a_consumer_back_after_its_queue_expired_gets_no_stale_broadcast(kind_broker: Broker) -> None:
    """Found by a user: a worker restarted under the same node name ran a control command
    ('shutdown') broadcast while it was away. Its pidbox queue (x-expires 10 s) had expired,
    as Celery means it to; the consumer group must go with it."""
    exchange, queue = _pidbox(expires=EXPIRES_S, message_ttl=300)
    with kind_broker.connection() as conn:
        consumer, got = collect(conn, [queue], no_ack=True)
        Producer(conn, exchange=exchange).publish("before")
        drain(conn, got, 1)
        consumer.cancel()
    with kind_broker.connection() as producer_conn:
        Producer(producer_conn, exchange=exchange).publish("shutdown (sent while away)")
    wait_for_server_time(kind_broker.client, server_now_ms(kind_broker.client) + EXPIRES_S * 1000 + 500)
    with kind_broker.connection() as conn:
        consumer, got = collect(conn, [queue], no_ack=True)
        Producer(conn, exchange=exchange).publish("after")
        drain(conn, got, 1)
        drain_for(conn, 0.5)
        assert [m.payload for m in got] == ["after"]
        consumer.cancel()


def test_broadcasts_older_than_the_queue_s_message_ttl_are_not_delivered(kind_broker: Broker) -> None:
    exchange, queue = _pidbox(expires=60, message_ttl=1)
    with kind_broker.connection() as conn:
        consumer, got = collect(conn, [queue], no_ack=True)
        drain_for(conn, 0.2)
        consumer.cancel()
        Producer(conn, exchange=exchange).publish("stale")
        wait_for_server_time(kind_broker.client, server_now_ms(kind_broker.client) + 1200)
        Producer(conn, exchange=exchange).publish("fresh")
        consumer, got = collect(conn, [queue], no_ack=True)
        drain(conn, got, 1)
        drain_for(conn, 0.3)
        assert [m.payload for m in got] == ["fresh"]


# -- defect 5: fanout consumer groups and consumers leaked ---------------------------------

def test_fanout_groups_go_with_their_queue_and_consumers_with_their_channel(kind_broker: Broker) -> None:
    exchange = Exchange("leaky", "fanout")
    queue = Queue("leaky-q", exchange)
    stream = kind_broker.keys.fanout("leaky")
    with kind_broker.connection() as conn:
        consumer, got = collect(conn, [queue], no_ack=True)
        Producer(conn, exchange=exchange).publish("one")
        drain(conn, got, 1)
        assert len(kind_broker.client.xinfo_consumers(stream, "leaky-q")) == 1
        consumer.cancel()  # the channel stops consuming the queue: its consumer leaves
        assert kind_broker.client.xinfo_consumers(stream, "leaky-q") == []
        queue(conn.default_channel).delete()
        assert kind_broker.client.xinfo_groups(stream) == []
        assert not kind_broker.client.exists(kind_broker.keys.fanout_groups(stream))


@pytest.fixture(params=TARGETS)
def any_broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    """Each server kind and each cluster kind, with a prefix: on a cluster a queue's keys
    and a fanout exchange's stream are in different slots."""
    kind = request.param
    if kind.endswith("-cluster"):
        require_kind(kind.removesuffix("-cluster"))
        server: Any = request.getfixturevalue(kind.replace("-", "_"))
    else:
        server = request.getfixturevalue(f"{kind}_server")
    client = server.client(socket_timeout=10)
    client.flushall()
    yield Broker(server, "app:", client)
    client.flushall()
    client.close()


@pytest.mark.parametrize("deleted_from", ["another connection", "the same connection"])
def test_a_fanout_queue_deleted_from_any_connection_loses_its_group(any_broker: Broker,
                                                                     deleted_from: str) -> None:
    """Found by a user: a fanout queue consumed and closed on one connection, then deleted
    from a new one, kept its consumer group (the connection that deleted it did not know
    the binding), so a queue declared later under that name received the broadcasts sent
    while it did not exist. In RabbitMQ a queue's deletion removes its bindings whoever
    declared them."""
    exchange = Exchange("bc", "fanout")
    queue = Queue("gq", exchange)
    stream = any_broker.keys.fanout("bc")
    with any_broker.connection() as conn:
        consumer, got = collect(conn, [queue], no_ack=True)
        Producer(conn, exchange=exchange).publish("before")
        drain(conn, got, 1)
        consumer.cancel()
        if deleted_from == "the same connection":
            queue(conn.default_channel).delete()
    if deleted_from == "another connection":
        with any_broker.connection() as other:
            queue(other.default_channel).delete()
    groups_after_delete = [g["name"].decode() for g in any_broker.client.xinfo_groups(stream)]
    assert not any_broker.lib.exists("gq")
    with any_broker.connection() as producer_conn:
        for i in range(2):
            Producer(producer_conn, exchange=exchange).publish(f"sent while gone {i}")
    with any_broker.connection() as conn:
        consumer, got = collect(conn, [queue], no_ack=True)
        Producer(conn, exchange=exchange).publish("after")
        drain(conn, got, 1)
        drain_for(conn, 0.5)
        consumer.cancel()
        received = [m.payload for m in got]
    assert (groups_after_delete, received) == ([], ["after"])


def test_an_expiring_fanout_queue_keeps_its_record_under_its_consumer(kind_broker: Broker) -> None:
    """The record of a fanout binding lives in the queue's meta, which expires with the
    queue: a consumer past x-expires keeps it (and the queue) alive, so a deletion from
    another connection after that still finds the group."""
    exchange, queue = _pidbox(expires=EXPIRES_S, message_ttl=300)
    stream = kind_broker.keys.fanout(exchange.name)
    with kind_broker.connection() as conn:
        consumer, _ = collect(conn, [queue], no_ack=True)
        drain_for(conn, EXPIRES_S + 2)
        assert kind_broker.lib.exists(queue.name)  # consumed: it never expires (it did)
        consumer.cancel()
    with kind_broker.connection() as other:
        queue(other.default_channel).delete()
    assert kind_broker.client.xinfo_groups(stream) == []


# -- defect 6: a large fanout batch lost entries --------------------------------------------

def test_a_fanout_batch_of_nine_thousand_is_read_and_acked_whole(kind_broker: Broker) -> None:
    """Found by a user: XACK of the whole batch hit Lua's unpack limit (~8,000) after
    XREADGROUP had already moved the group on: the entries stayed pending for good."""
    lib, stream = kind_broker.lib, kind_broker.keys.fanout("big")
    lib.fanout_bind("big", "bigq")
    pipe = kind_broker.client.pipeline(transaction=False)
    for i in range(9_000):
        pipe.xadd(stream, {"payload": f"m{i}", "routing_key": ""})
    pipe.execute()
    batch = lib.fanout_consume("big", "bigq", "me", count=9_000)
    assert len(batch.entries) == 9_000
    assert kind_broker.client.xpending(stream, "bigq")["pending"] == 0


# -- defect 7: a fanout queue bound on one channel was never served on another ---------------

def test_a_fanout_queue_bound_on_one_channel_is_consumed_on_another(kind_broker: Broker) -> None:
    """The minimal reproduction a user reported (and kombu's own integration test test_fanout)."""
    with kind_broker.connection() as conn:
        queue = Queue("f1", exchange=Exchange("fx", "fanout"))
        queue(conn.channel()).declare()
        consumer, got = collect(conn, [queue], no_ack=True)  # the default channel
        Producer(conn, exchange=Exchange("fx", "fanout")).publish("hello")
        drain(conn, got, 1, timeout=5)
        assert got[0].payload == "hello"
        consumer.cancel()


def test_a_pidbox_reset_onto_a_new_channel_keeps_handling_broadcasts(kind_broker: Broker) -> None:
    """Celery's Pidbox.reset stops the remote-control consumer and starts it again on a new
    channel of the same connection; kombu then skips the bind it already knows."""
    exchange, queue = _pidbox(expires=EXPIRES_S, message_ttl=300)
    with kind_broker.connection() as conn, kind_broker.connection() as producer_conn:
        producer = Producer(producer_conn, exchange=exchange)
        handled: list[Any] = []
        channel = conn.channel()
        consumer = Consumer(channel, [queue], no_ack=True,
                            callbacks=[lambda body, message: handled.append(body)])
        consumer.consume()
        for i in range(3):
            producer.publish({"command": i})
        drain(conn, handled, 3)
        consumer.cancel()
        channel.close()  # the reset
        consumer = Consumer(conn.channel(), [queue], no_ack=True,
                            callbacks=[lambda body, message: handled.append(body)])
        consumer.consume()
        for i in range(3, 6):
            producer.publish({"command": i})
        drain(conn, handled, 6, timeout=5)
        assert [h["command"] for h in handled] == list(range(6))
        consumer.cancel()


# -- defect 8: a fanout backlog larger than one batch waited blocking_timeout ------------------

def test_a_fanout_backlog_larger_than_a_batch_drains_at_once(kind_broker: Broker) -> None:
    exchange = Exchange("burst", "fanout")
    queue = Queue("burst-q", exchange)
    with kind_broker.connection(blocking_timeout=10) as conn:
        queue(conn.default_channel).declare()
        producer = Producer(conn, exchange=exchange)
        for i in range(250):
            producer.publish(i)
        consumer, got = collect(conn, [queue], no_ack=True)
        started = time.monotonic()
        drain(conn, got, 250, timeout=20)
        assert time.monotonic() - started < 5  # not 100 now and 150 after the 10 s block
        assert [m.payload for m in got] == list(range(250))
        consumer.cancel()


# -- defect 10: smaller ones -----------------------------------------------------------------

def test_a_producer_s_declare_keeps_the_worker_s_queue_arguments(kind_broker: Broker) -> None:
    """Found by a user: a declare without arguments (as a producer makes) stripped the
    worker's x-max-priority, TTL and expiry. Now it keeps them, and a declaration with
    other arguments is refused with the difference named, as RabbitMQ does."""
    exchange = Exchange("args")
    with kind_broker.connection() as worker, kind_broker.connection() as producer_conn:
        Queue("argq", exchange, routing_key="argq", max_priority=3, message_ttl=60)(
            worker.default_channel).declare()
        producer = Producer(producer_conn, exchange=exchange, routing_key="argq")
        producer.publish("p9", priority=9, declare=[Queue("argq", exchange, routing_key="argq")])
        state = kind_broker.client.hvals(kind_broker.keys.state("argq"))[0].split()
        assert int(state[2]) == 3 and state[3] != b"-"  # capped, and the TTL still applies
        with pytest.raises(ScriptError, match="x-max-priority stored 3, declared 10"):
            Queue("argq", exchange, routing_key="argq", max_priority=10, message_ttl=60)(
                producer_conn.default_channel).declare()


def test_a_wake_token_taken_as_its_channel_closes_goes_back(kind_broker: Broker) -> None:
    """A consumer's BLPOP can take the queue's one wake token at the instant its channel
    closes. Kept, the token would be gone with the connection and every other blocked
    consumer would sleep a whole blocking_timeout with a message ready; close gives it
    back (unpop), and the message itself was never touched (no message is popped by a
    blocking command), so it goes out with delivery count 0."""
    queue = Queue("popq", Exchange("popx"), routing_key="popq")
    wake = kind_broker.keys.wake("popq")
    with kind_broker.connection() as conn:
        Producer(conn, exchange=queue.exchange, routing_key="popq").publish("seen", declare=[queue])
        kind_broker.client.delete(wake)  # as if consumed: the next publish arms it again
        channel = conn.channel()
        assert channel.start_queue_wait(["popq"], None)  # blocked on the wake list
        wait_until(lambda: kind_broker.blocked_clients() >= 1)
        Producer(conn, exchange=queue.exchange, routing_key="popq").publish("unseen")
        # The wait's BLPOP took the token (server side); the channel has not read it yet.
        assert kind_broker.client.llen(wake) == 0
        channel.close()
        assert kind_broker.client.lrange(wake, 0, -1) == [b"1"]
        messages = consume(conn, [queue], 2)
        assert [(m.payload, m.headers["x-delivery-count"]) for m in messages] == [("seen", 0), ("unseen", 0)]
        assert not any(m.delivery_info["redelivered"] for m in messages)


def test_an_eta_past_the_year_2286_is_refused_by_name(kind_broker: Broker) -> None:
    queue = Queue("etaq", Exchange("etax"), routing_key="etaq")
    with kind_broker.connection() as conn:
        with pytest.raises(ValueError, match=r"'eta'.*2286"):
            Producer(conn, exchange=queue.exchange, routing_key="etaq").publish(
                "far", declare=[queue], headers={"eta": "9999-12-31T00:00:00+00:00"})
        assert kind_broker.lib.stats(["etaq"])[0].delayed == 0


def test_a_countdown_s_expires_is_its_deadline_and_a_bad_one_is_refused_by_name(kind_broker: Broker) -> None:
    """Celery sends `expires` as ms from now ('expiration') and as a time (the header); a
    countdown's TTL counts from its ETA, so it is what is left of the header's time then."""
    queue = Queue("expq", Exchange("expx"), routing_key="expq")
    lib = kind_broker.lib
    with kind_broker.connection() as conn:
        producer = Producer(conn, exchange=queue.exchange, routing_key="expq")
        with pytest.raises(ValueError, match=r"header 'expires' is not an ISO 8601 time: 'soon'"):
            producer.publish("bad", declare=[queue], headers={"eta": "2030-01-01T00:00:00+00:00",
                                                               "expires": "soon"})
        assert lib.stats(["expq"])[0].delayed == 0
        producer.publish("countdown", declare=[queue], expiration=60,  # kombu: seconds
                         headers={"eta": "2030-01-01T00:00:00+00:00", "expires": "2030-01-01T00:00:02+00:00"})
    [message_id] = lib.client.zrange(lib.keys.delayed("expq"), 0, -1)
    state = message_state(lib.client, lib.keys, "expq", message_id.decode())
    assert state is not None and int(state[3]) == 1_893_456_002_000  # the header's time, not ETA + 60 s


def test_retry_on_timeout_is_not_passed_on_so_no_script_is_ever_sent_twice(kind_broker: Broker) -> None:
    """retry_on_timeout=True let redis-py resend a consume whose reply timed out (the first
    run's messages then sat in flight, unseen, until the visibility timeout)."""
    with pytest.warns(RuntimeWarning, match="retry_on_timeout"), \
            kind_broker.connection(retry_on_timeout=True) as conn:
        channel = conn.default_channel
        connection = channel.client.connection_pool.get_connection()
        try:
            assert connection.retry.get_retries() == 0
        finally:
            channel.client.connection_pool.release(connection)


def test_the_keeper_refreshes_a_consumed_queue_three_times_per_x_expires(kind_broker: Broker) -> None:
    """Registered when consuming starts, withdrawn when it stops."""
    queue = Queue("pace", Exchange("pacex"), routing_key="pace", expires=12)
    with kind_broker.connection(visibility_timeout=300) as conn:
        consumer, _ = collect(conn, [queue])
        channel = conn.default_channel
        (alive,) = [a for key, a in KEEPER._alive.items() if key == (id(channel), "pace")]
        assert alive.interval == pytest.approx(4.0)
        assert [call.script for call in alive.calls] == ["extend", "bind"]
        consumer.cancel()
        assert (id(channel), "pace") not in KEEPER._alive


def test_the_keeper_keeps_a_short_visibility_s_deadline_ahead_while_the_loop_stands_still(
        kind_broker: Broker) -> None:
    """A visibility of 0.9 s: the keeper extends the held delivery every 0.3 s, well before
    the deadline. While the lease keeper ticked once a second whatever the interval, a
    stand-in set the deadline 0.9 s ahead and the next came 1 s later: the delivery was
    overdue (a sweep anywhere would hand it back) every second."""
    queue = Queue("brief", Exchange("briefx"), routing_key="brief")
    client, index = kind_broker.client, kind_broker.keys.index("brief")
    with kind_broker.connection(visibility_timeout=0.9) as conn:
        Producer(conn, exchange=queue.exchange, routing_key="brief").publish("task", declare=[queue])
        consumer, got = collect(conn, [queue])
        drain(conn, got, 1)
        (member,) = client.zrange(index, 0, -1)
        overdue: list[float] = []
        watch_until = time.monotonic() + 3.0
        while time.monotonic() < watch_until:  # the loop stands still, as during a solo task
            deadline_ms, now_ms = client.zscore(index, member), server_now_ms(client)
            if deadline_ms is None or deadline_ms <= now_ms:
                overdue.append(now_ms - (deadline_ms or 0))
            time.sleep(0.01)  # the sampling period of the watch, not a synchronisation
        assert not overdue, f"the deadline lapsed {len(overdue)} times (by up to {max(overdue)} ms)"
        got[0].ack()
        consumer.cancel()


def test_a_delivery_held_while_the_keeper_sleeps_on_a_long_deadline_is_extended_in_time(
        kind_broker: Broker) -> None:
    """The keeper sleeps until its earliest deadline (here a keep-alive 100 s away). A
    delivery with a visibility of 0.9 s taken meanwhile must not wait that out: its deadline
    is 0.9 s away. Under the lease keeper a newcomer waited up to a whole tick (1 s)."""
    slow = Queue("slowq", Exchange("slowx"), routing_key="slowq", expires=300)
    fast = Queue("brisk", Exchange("briskx"), routing_key="brisk")
    client, index = kind_broker.client, kind_broker.keys.index("brisk")
    with kind_broker.connection(visibility_timeout=300) as idle, \
            kind_broker.connection(visibility_timeout=0.9) as conn:
        sleeper, _ = collect(idle, [slow])  # the keeper now sleeps for 100 s
        Producer(conn, exchange=fast.exchange, routing_key="brisk").publish("task", declare=[fast])
        consumer, got = collect(conn, [fast])
        drain(conn, got, 1)
        (member,) = client.zrange(index, 0, -1)
        first = client.zscore(index, member)
        wait_until(lambda: client.zscore(index, member) != first, timeout=0.6,
                   what="the deadline pushed forward within two thirds of the visibility")
        got[0].ack()
        consumer.cancel()
        sleeper.cancel()


@pytest.mark.slow  # 15 s of waiting out expiries: make test-all, for CI's budget
def test_the_keeper_keeps_a_stalled_consumer_s_expiring_queue_alive(kind_broker: Broker) -> None:
    """The solo pool runs a task inside the event loop: the loop does nothing while it runs.
    The keeper's thread refreshes the queue, so it does not expire under the task."""
    queue = Queue("stall", Exchange("stallx"), routing_key="stall", expires=EXPIRES_S)
    keys = kind_broker.keys
    with kind_broker.connection(visibility_timeout=300) as conn:
        Producer(conn, exchange=queue.exchange, routing_key="stall").publish("task", declare=[queue])
        consumer, got = collect(conn, [queue])
        drain(conn, got, 1)
        stop = threading.Event()
        stop.wait(EXPIRES_S * 1.5)  # the loop stands still, as during a solo task
        assert kind_broker.client.exists(keys.meta("stall"), keys.state("stall")) == 2
        got[0].ack()
        consumer.cancel()
