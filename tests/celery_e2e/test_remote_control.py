"""Celery's remote control, broadcast queues, purge, events and chords on the transport:
everything that rides on fanout streams and topic bindings, with real workers."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chord, group
from kombu.common import Broadcast

from .harness import TESTS_DIR, Broker, Worker, running, wait_for

ON_CLUSTERS = True  # also on three-primary clusters (conftest.py)

NOTE = "celery_e2e.app.note"


def test_inspect_ping_answers_from_both_workers(broker: Broker, producer: Celery,
                                               log_dir: Path) -> None:
    with running(Worker(broker, name="w1", log_dir=log_dir), Worker(broker, name="w2", log_dir=log_dir)):
        replies = wait_for(lambda: _two(producer.control.inspect(timeout=2, limit=2).ping()),
                           timeout=30, what="pongs from two workers")
        queues = producer.control.inspect(timeout=2, limit=2).active_queues() or {}
        # The CLI, with its default one-second wait for replies.
        cli = wait_for(lambda: _cli_pongs(broker), timeout=30, what="`celery inspect ping` pongs")
    assert {line.split("@")[0] for line in cli} == {"w1", "w2"}
    assert {name.split("@")[0] for name in replies} == {"w1", "w2"}
    assert all(reply == {"ok": "pong"} for reply in replies.values())
    assert {name.split("@")[0] for name in queues} == {"w1", "w2"}
    assert all([q["name"] for q in qs] == ["celery"] for qs in queues.values())


def _cli_pongs(broker: Broker) -> list[str] | None:
    """Lines of `celery inspect ping` that name a worker answering pong, if two did."""
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "celery_e2e.app", "inspect", "ping"],
        env=broker.env(), cwd=TESTS_DIR, capture_output=True, text=True, timeout=60)
    lines = [line.strip("-> ").split(":")[0] for line in done.stdout.splitlines()
             if line.startswith("->") and "OK" in line]
    pongs = "pong" in done.stdout and done.returncode == 0
    return lines if pongs and len(lines) == 2 else None


def _two(replies: dict[str, Any] | None) -> dict[str, Any] | None:
    return replies if replies and len(replies) == 2 else None


def test_a_broadcast_task_reaches_every_worker(broker: Broker, producer: Celery,
                                              log_dir: Path) -> None:
    env = {"CRL_BROADCAST": "1"}
    workers = (Worker(broker, name="b1", env=env, log_dir=log_dir),
               Worker(broker, name="b2", env=env, log_dir=log_dir))
    with running(*workers):
        # As a Celery user routes to a broadcast queue: the fanout exchange 'bcast' (the
        # producer's Broadcast has a queue name of its own; only the exchange matters).
        producer.send_task(NOTE, ("to-all",), queue=Broadcast("bcast"))
        direct = producer.send_task(NOTE, ("to-one",))
        assert direct.get(timeout=30) == "to-one"
        wait_for(lambda: len(_labels(broker, "to-all")) >= 2, timeout=30, what="both broadcasts")
        # a second broadcast, to see each worker take each one once (no re-reads)
        producer.send_task(NOTE, ("to-all-2",), queue=Broadcast("bcast"))
        wait_for(lambda: len(_labels(broker, "to-all-2")) >= 2, timeout=30, what="second broadcast")
    hosts = {w.name for w in workers}
    assert sorted(h.split("@")[0] for h in _labels(broker, "to-all")) == sorted(hosts)
    assert sorted(h.split("@")[0] for h in _labels(broker, "to-all-2")) == sorted(hosts)
    assert len(_labels(broker, "to-one")) == 1


def _labels(broker: Broker, label: str) -> list[str]:
    """Hostnames of the workers that ran the note with ``label``."""
    return [e["hostname"] for e in broker.entries("ran") if e["label"] == label]


def test_celery_purge_empties_the_queues(broker: Broker, producer: Celery) -> None:
    lib = broker.lib()
    for i in range(5):
        producer.send_task(NOTE, (f"c{i}",))
    for i in range(3):
        producer.send_task(NOTE, (f"o{i}",), queue="other")
    producer.send_task(NOTE, ("later",), countdown=3600)
    before = {s.queue: (s.ready, s.delayed) for s in lib.stats(["celery", "other"])}
    assert before == {"celery": (5, 1), "other": (3, 0)}

    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "celery_e2e.app", "purge", "-f", "-Q", "celery,other"],
        env=broker.env(), cwd=TESTS_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Purged 9 messages from 2 known task queues" in done.stdout
    after = {s.queue: (s.ready, s.delayed, s.in_flight) for s in lib.stats(["celery", "other"])}
    assert after == {"celery": (0, 0, 0), "other": (0, 0, 0)}
    assert broker.entries("ran") == []


class _Receiver(threading.Thread):
    """Captures Celery events on a connection of its own until told to stop."""

    def __init__(self, app: Celery) -> None:
        super().__init__(daemon=True)
        self.app = app
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.receiver: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.app.connection_for_read() as connection:
                self.receiver = self.app.events.Receiver(
                    connection, handlers={"*": self.events.append})
                original = self.receiver.on_consume_ready

                def on_consume_ready(*args: Any, **kwargs: Any) -> None:
                    original(*args, **kwargs)
                    self.ready.set()

                self.receiver.on_consume_ready = on_consume_ready
                self.receiver.capture(limit=None, timeout=None, wakeup=False)
        except BaseException as error:  # shown by the test
            self.error = error
            self.ready.set()

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.join(10)


@pytest.fixture
def receiver(producer: Celery) -> Iterator[_Receiver]:
    thread = _Receiver(producer)
    thread.start()
    yield thread
    thread.stop()


def test_an_event_receiver_sees_task_received_and_succeeded(
        broker: Broker, producer: Celery, receiver: _Receiver, log_dir: Path) -> None:
    assert receiver.ready.wait(30) and receiver.error is None, receiver.error
    with running(Worker(broker, name="ev", extra_args=["-E"], log_dir=log_dir)):
        result = producer.send_task(NOTE, ("watched",))
        assert result.get(timeout=30) == "watched"

        def seen() -> set[str]:
            return {e["type"] for e in list(receiver.events) if e.get("uuid") == result.id}

        wait_for(lambda: {"task-received", "task-succeeded"} <= seen(), timeout=30,
                 what="task-received and task-succeeded events")
    assert receiver.error is None
    mine = [e for e in list(receiver.events) if e.get("uuid") == result.id]
    received = next(e for e in mine if e["type"] == "task-received")
    succeeded = next(e for e in mine if e["type"] == "task-succeeded")
    assert received["name"] == NOTE and received["hostname"].startswith("ev@")
    assert succeeded["result"] == "'watched'"
    assert any(e["type"] == "worker-online" for e in list(receiver.events))


def test_a_chord_over_a_group_completes(broker: Broker, producer: Celery, log_dir: Path) -> None:
    with running(Worker(broker, name="chord", concurrency=4, log_dir=log_dir)):
        header = group(producer.signature("celery_e2e.app.add", (i, i)) for i in range(10))
        body = producer.signature("celery_e2e.app.tsum")
        result = chord(header, body, app=producer).apply_async()
        assert result.get(timeout=60) == sum(2 * i for i in range(10))
        assert sorted(r.get(timeout=30) for r in result.parent.results) == [2 * i for i in range(10)]
    [stats] = broker.lib().stats(["celery"])
    assert (stats.ready, stats.in_flight, stats.dead) == (0, 0, 0)

