"""Pause and resume a queue, held in the broker (lua/pause.lua, lua/resume.lua, consume).

A paused queue takes publishes and delivers nothing, to any consumer, countdowns included;
messages in flight finish normally; resume wakes a blocked consumer at once. Script level
on every server kind (standalone and cluster, with and without a key prefix), then through
kombu with a consumer blocked on the queue.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
from kombu import Consumer, Exchange, Producer, Queue
from kombu.message import Message

from celery_redis_lua import ScriptError, ScriptLibrary
from helpers import same_slot_names, server_now_ms, wait_for_server_time, wait_until
from kombu_support import Broker


def declared(lib: ScriptLibrary, *names: str) -> None:
    for name in names:
        lib.declare(name)


def test_a_paused_queue_takes_publishes_and_delivers_nothing_until_resumed(lib: ScriptLibrary) -> None:
    declared(lib, "held")
    lib.publish("held", "first")
    assert lib.pause("held", "maintenance") is True
    lib.publish("held", "second")
    lib.publish("held", "due soon", eta_ms=server_now_ms(lib.client) + 50)
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 60)
    assert lib.consume(["held"], 10).deliveries == []
    [m] = lib.metrics(["held"])
    assert (m.ready, m.delayed, m.paused) == (2, 1, "maintenance")  # the due countdown waits too
    assert lib.resume("held") is True
    consumed = lib.consume(["held"], 10)
    assert sorted(d.payload for d in consumed.deliveries) == [b"due soon", b"first", b"second"]
    [m] = lib.metrics(["held"])
    assert m.paused is None


def test_expiry_in_a_paused_queue_is_judged_at_the_sweep_and_at_consume(lib: ScriptLibrary) -> None:
    """docs/promises.md: a message whose TTL passes in a paused queue still shows as ready
    until the next sweep (or the first consume after resume), as RabbitMQ drops expired
    messages only at the head of a queue; the sweep dead-letters it with reason 'expired'
    though the queue stays paused, and a countdown of a paused queue waits for resume."""
    declared(lib, "frozen", "thawed")
    for queue in ("frozen", "thawed"):
        lib.publish(queue, "short-lived", ttl_ms=30)
        lib.publish(queue, "kept")
        lib.pause(queue, "deploy")
    lib.publish("frozen", "countdown", eta_ms=server_now_ms(lib.client) + 30)
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 40)
    [m] = lib.metrics(["frozen"])
    assert (m.ready, m.delayed, m.dead) == (2, 1, 0)  # expired, but nothing has looked yet
    report = lib.sweep(["frozen"])
    assert (report.expired, report.promoted) == (1, 0)  # dead-lettered while paused; no promotion
    assert [(d.reason, d.payload) for d in lib.dead_list("frozen")] == [("expired", b"short-lived")]
    [m] = lib.metrics(["frozen"])
    assert (m.ready, m.delayed, m.dead, m.paused) == (1, 1, 1, "deploy")
    assert lib.resume("thawed") is True  # no sweep: the consume after resume judges it
    consumed = lib.consume(["thawed"], 10)
    assert ([d.payload for d in consumed.deliveries], consumed.expired) == ([b"kept"], 1)
    assert [d.reason for d in lib.dead_list("thawed")] == ["expired"]
    assert lib.resume("frozen") is True
    assert sorted(d.payload for d in lib.consume(["frozen"], 10).deliveries) == [b"countdown", b"kept"]


def test_pause_and_resume_say_whether_they_changed_anything(lib: ScriptLibrary) -> None:
    declared(lib, "twice")
    assert lib.resume("twice") is False
    assert lib.pause("twice", "first") is True
    assert lib.pause("twice", "second") is False
    assert lib.metrics(["twice"])[0].paused == "second"
    assert lib.resume("twice") is True
    assert lib.resume("twice") is False


def test_messages_in_flight_finish_normally(lib: ScriptLibrary) -> None:
    declared(lib, "busy")
    lib.publish("busy", "running")
    [taken] = lib.consume(["busy"], 1).deliveries
    lib.pause("busy")
    assert lib.ack("busy", [taken.id]) == 1
    assert lib.stats(["busy"])[0].in_flight == 0


def test_a_consume_across_queues_skips_the_paused_one(lib: ScriptLibrary) -> None:
    stopped, going = same_slot_names(2, lib.keys, "mix")
    declared(lib, stopped, going)
    lib.publish(stopped, "stopped", priority=9)
    lib.publish(going, "going")
    lib.pause(stopped)
    consumed = lib.consume([stopped, going], 10)
    assert [(d.queue, d.payload) for d in consumed.deliveries] == [(going, b"going")]


def test_a_paused_queue_wakes_nobody_and_resume_wakes_a_consumer(lib: ScriptLibrary) -> None:
    declared(lib, "sleepy")
    lib.publish("sleepy", "before")  # pushes the wake token
    wake = lib.keys.wake("sleepy")
    assert lib.client.llen(wake) == 1
    lib.pause("sleepy")
    assert lib.client.llen(wake) == 0
    lib.publish("sleepy", "during")
    assert lib.client.llen(wake) == 0  # a blocked consumer stays asleep
    lib.resume("sleepy")
    assert lib.client.llen(wake) == 1


def test_bad_input_is_refused_by_name_and_changes_nothing(lib: ScriptLibrary) -> None:
    with pytest.raises(ScriptError, match=r"pause: no queue '.*meta:\{nowhere\}'"):
        lib.pause("nowhere")
    with pytest.raises(ScriptError, match=r"resume: no queue '.*meta:\{nowhere\}'"):
        lib.resume("nowhere")
    assert lib.client.exists(lib.keys.meta("nowhere")) == 0  # nothing was created
    declared(lib, "talkative")
    with pytest.raises(ScriptError, match="reason must be at most 256 bytes, got 257"):
        lib.pause("talkative", "x" * 257)
    assert lib.metrics(["talkative"])[0].paused is None


# -- through kombu: a consumer blocked on the queue ------------------------------------------

def test_resume_wakes_a_blocked_kombu_consumer_at_once(kind_broker: Broker) -> None:
    """The consumer blocks (BLPOP) on the queue's wake list for up to blocking_timeout
    (60 s here); publishes to the paused queue do not wake it, resume does, at once."""
    queue = Queue("gate", Exchange("gate"), routing_key="gate")
    got: list[Message] = []
    lib = kind_broker.lib
    with kind_broker.connection(blocking_timeout=60) as conn, \
            Consumer(conn, [queue], callbacks=[lambda body, message: got.append(message)]):
        lib.pause("gate", "deploy")
        producer = Producer(conn, exchange=queue.exchange, routing_key="gate")
        for i in range(3):
            producer.publish({"i": i})
        stop = threading.Event()

        def drain() -> None:
            while not stop.is_set() and len(got) < 3:
                with contextlib.suppress(socket.timeout, TimeoutError):
                    conn.drain_events(timeout=1)

        draining = threading.Thread(target=drain)
        draining.start()
        try:
            wait_until(lambda: kind_broker.blocked_clients() >= 1, timeout=10, what="the consumer blocked")
            assert got == []  # paused: nothing delivered, nobody woken
            lib.resume("gate")
            wait_until(lambda: len(got) == 3, timeout=5, what="all three delivered soon after resume")
        finally:
            stop.set()
            draining.join(timeout=70)
        for message in got:
            message.ack()
    assert sorted(m.payload["i"] for m in got) == [0, 1, 2]


def test_the_cli_pauses_resumes_and_shows_it(kind_broker: Broker) -> None:
    from click.testing import CliRunner

    from celery_redis_lua.tools.cli import main

    url = f"redis://127.0.0.1:{kind_broker.server.port}/0"
    prefix = kind_broker.prefix
    kind_broker.lib.declare("cli-gate")
    runner = CliRunner()
    at = ["--url", url, "--prefix", prefix]
    paused = runner.invoke(main, ["pause", "cli-gate", "--reason", "db migration", *at])
    assert paused.exit_code == 0 and "'cli-gate' paused" in paused.output, paused.output
    shown = runner.invoke(main, ["status", "--queue", "cli-gate", *at])
    assert "yes: db migration" in shown.output, shown.output
    resumed = runner.invoke(main, ["resume", "cli-gate", *at])
    assert "'cli-gate' resumed" in resumed.output, resumed.output
    missing = runner.invoke(main, ["pause", "no-such-queue", *at])
    assert missing.exit_code == 3 and "no queue" in missing.output + str(missing.stderr_bytes or b"")
