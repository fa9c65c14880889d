"""Flower (2.x) against our broker: a real ``celery flower`` process and a real worker.

Flower fills its pages from two things the transport carries: Celery's events (a
``celeryev.*`` queue bound to the ``celeryev`` topic exchange: worker heartbeats, task
events) and remote control (broadcasts on the ``celery.pidbox`` fanout exchange, replies on
a reply queue of its own: ``enable_events`` every 5 s, ``inspect stats/registered/
active_queues/conf``). The worker runs without ``-E``: task events reach Flower only once
Flower's ``enable_events`` broadcast has reached the worker. A transport that loses events
leaves the tasks out; one whose remote control is broken leaves ``/api/workers`` without the
worker's stats and registered tasks. The slow test keeps Flower filling for 11 minutes with
every binding lifetime short.

Flower's Broker tab and ``/api/queues/length`` choose a client by URL scheme (amqp, redis,
...) and read list lengths: they know only kombu's stock transports, and answer 404 for ours
(see docs/operations.md, "Flower").
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from scripts.servers import free_port

from .harness import TESTS_DIR, Broker, Worker, running, wait_for

ADD = "celery_e2e.app.add"
NOTE = "celery_e2e.app.note"
# The worker logs this when a remote ``enable_events`` turns its task events on.
EVENTS_ENABLED = b"Events of group {task} enabled by remote."
# What Flower logs when events or remote control fail under it.
FLOWER_FAILURES = ("Failed to capture events", "Inspect method", "Worker inspection failed",
                   "Failed to update workers", "Traceback")


@pytest.fixture(autouse=True)
def require_flower() -> None:
    try:
        import flower  # noqa: F401
    except ImportError as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must cover Flower (pip install -e '.[test]'): {error}")
        pytest.skip(f"flower is not installed here (pip install 'flower>=2.0'): {error}")


@dataclass
class Flower:
    """``celery -A celery_e2e.app flower`` on a free loopback port, with the workers' env."""

    broker: Broker
    log_dir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / "flower.log"

    def start(self, ready_timeout: float = 30) -> Flower:
        command = [sys.executable, "-m", "celery", "-A", "celery_e2e.app", "flower",
                   f"--port={self.port}", "--address=127.0.0.1", "--logging=info"]
        env = self.broker.env(FLOWER_UNAUTHENTICATED_API="true")
        for name in ("FLOWER_BASIC_AUTH", "FLOWER_AUTH", "FLOWER_UNIX_SOCKET", "FLOWER_URL_PREFIX"):
            env.pop(name, None)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=TESTS_DIR)
        deadline = time.monotonic() + ready_timeout
        while self.status("/healthcheck") != 200:
            if self.process.poll() is not None:
                raise RuntimeError(f"flower exited early:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"flower not answering:\n{self.log_tail()}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def fetch(self, path: str, timeout: float = 15) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def status(self, path: str) -> int | None:
        try:
            return self.fetch(path, timeout=2)[0]
        except OSError:  # not listening yet
            return None

    def json(self, path: str) -> Any:
        status, body = self.fetch(path)
        assert status == 200, f"GET {path}: {status} {body[:500]}"
        return json.loads(body)

    def page(self, path: str) -> str:
        status, body = self.fetch(path)
        assert status == 200, f"GET {path}: {status} {body[:500]}"
        return body

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def failures(self) -> list[str]:
        return [line for line in self.log().splitlines()
                if any(failure in line for failure in FLOWER_FAILURES)]


@contextlib.contextmanager
def flower_running(broker: Broker, log_dir: Path) -> Iterator[Flower]:
    flower = Flower(broker, log_dir)
    try:
        yield flower.start()
    except BaseException:
        print(f"--- log of flower ---\n{flower.log_tail()}")
        raise
    finally:
        flower.stop()


def worker_entry(flower: Flower, prefix: str) -> tuple[str, dict[str, Any]] | None:
    """The worker's name and remote-control info in ``/api/workers``, refreshed now."""
    for name, info in flower.json("/api/workers?refresh=1").items():
        if name.startswith(prefix) and {"stats", "registered", "active_queues"} <= set(info):
            return name, info
    return None


def succeeded(flower: Flower, expected: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """``/api/tasks`` entries of the expected tasks once every one is SUCCESS."""
    tasks = flower.json("/api/tasks")
    done = {task_id: tasks[task_id] for task_id in expected
            if tasks.get(task_id, {}).get("state") == "SUCCESS"}
    return done if len(done) == len(expected) else None


def wait_for_task_events_enabled(worker: Worker) -> None:
    wait_for(lambda: EVENTS_ENABLED in worker.log_path.read_bytes(), timeout=30,
             what="Flower's enable_events reaching the worker (remote control)")


def check_remote_control(name: str, info: dict[str, Any], worker: Worker) -> None:
    """What only remote control (inspect stats/registered/active_queues) tells Flower."""
    assert worker.process is not None
    assert ADD in info["registered"] and NOTE in info["registered"], info["registered"]
    assert info["stats"]["pid"] == worker.process.pid
    assert info["stats"]["broker"]["transport"] == "redislua", info["stats"]["broker"]
    assert "celery" in {queue["name"] for queue in info["active_queues"]}, info["active_queues"]


def test_flower_fills_workers_tasks_and_task_pages(broker: Broker, producer: Celery,
                                                   log_dir: Path) -> None:
    worker = Worker(broker, name="flower", log_dir=log_dir)  # no -E: Flower turns events on
    with running(worker), flower_running(broker, log_dir) as flower:
        wait_for_task_events_enabled(worker)
        expected: dict[str, Any] = {}
        for i in range(1, 5):
            expected[producer.send_task(ADD, (i, i)).id] = i + i
        expected[producer.send_task(NOTE, ("flower-note",)).id] = "flower-note"
        listed = wait_for(lambda: succeeded(flower, expected), timeout=30,
                          what="every task SUCCESS in /api/tasks")
        name, info = wait_for(lambda: worker_entry(flower, "flower@"), timeout=30,
                              what="the worker's remote-control info in /api/workers")

        # Events: each task, with its result, on the worker that ran it.
        for task_id, result in expected.items():
            assert listed[task_id]["result"] == repr(result), listed[task_id]
            assert listed[task_id]["worker"] == name
            detail = flower.json(f"/api/task/info/{task_id}")
            assert detail["state"] == "SUCCESS" and detail["result"] == repr(result), detail
            assert detail["name"] == (ADD if isinstance(result, int) else NOTE)
            assert detail["worker"] == name
            assert detail["received"] and detail["started"] and detail["succeeded"], detail
            page = flower.page(f"/task/{task_id}")
            assert task_id in page and "SUCCESS" in page and html.escape(repr(result)) in page
        # The tasks page's table (its HTML loads /tasks/datatable).
        assert "Tasks" in flower.page("/tasks")
        table = flower.json("/tasks/datatable?" + urllib.parse.urlencode({
            "draw": 1, "start": 0, "length": 100, "order[0][column]": 0,
            "columns[0][data]": "received", "order[0][dir]": "desc"}))
        assert {row["uuid"] for row in table["data"]} == set(expected), table
        assert all(row["state"] == "SUCCESS" for row in table["data"]), table

        # Events: the worker's heartbeats make it alive, its task events count on /workers.
        assert flower.json("/api/workers?status=1").get(name) is True
        workers_page = flower.page("/workers")
        row = re.search(rf'<tr id="{re.escape(urllib.parse.quote(name))}">(.*?)</tr>',
                        workers_page, re.S)
        assert row, workers_page
        cells = re.findall(r"<td>(.*?)</td>", row.group(1), re.S)
        assert cells[0].strip() == name and cells[1].strip() == "True", cells
        assert cells[5].strip() == str(len(expected)), cells  # task-succeeded

        # Remote control: inspect replies, and the worker page built from them.
        check_remote_control(name, info, worker)
        assert info["stats"]["total"] == {ADD: 4, NOTE: 1}, info["stats"]["total"]
        worker_page = flower.page(f"/worker/{urllib.parse.quote(name)}")
        assert ADD in worker_page and str(worker.process.pid) in worker_page

        # The Broker tab and queue lengths: not for non-stock transports (docs/operations.md, "Flower").
        status, body = flower.fetch("/api/queues/length")
        assert status == 404 and "broker is not supported" in body, (status, body)
        assert flower.fetch("/broker")[0] == 404
    assert flower.failures() == [], flower.log_tail()


RUN_FOR = 11 * 60
PACE = 20  # seconds between tasks


@pytest.mark.slow
@pytest.mark.timeout(RUN_FOR + 300)
def test_flower_keeps_filling_for_longer_than_any_binding_lifetime(
        broker: Broker, producer: Celery, log_dir: Path) -> None:
    """11 minutes with queue_expires 10 s and the binding floor at 3 s: the task queue's
    bindings live 10 s, the pidbox and reply queues' 10 s (control_queue_expires), Flower's
    event queue's 60 s (event_queue_expires), each refreshed only by its consumer. 11
    minutes is also more than twice the default floor (300 s)."""
    broker.transport_options.update(queue_expires=10, binding_lifetime_floor=3)
    producer.conf.broker_transport_options = broker.transport_options
    worker = Worker(broker, name="flower", log_dir=log_dir)
    with running(worker), flower_running(broker, log_dir) as flower:
        wait_for_task_events_enabled(worker)
        name, _ = wait_for(lambda: worker_entry(flower, "flower@"), timeout=30,
                           what="the worker's remote-control info in /api/workers")
        started = time.monotonic()
        sent: dict[str, int] = {}
        lags: list[float] = []
        while time.monotonic() - started < RUN_FOR:
            slot = time.monotonic()
            i = len(sent) + 1
            task_id = producer.send_task(ADD, (i, i)).id
            sent[task_id] = i + i
            listed = wait_for(partial(succeeded, flower, {task_id: None}), timeout=30, interval=0.2,
                              what=f"task {i} SUCCESS in /api/tasks after "
                                   f"{time.monotonic() - started:.0f} s")
            lags.append(time.monotonic() - slot)
            assert listed[task_id]["result"] == repr(i + i) and listed[task_id]["worker"] == name
            if i % 5 == 0:  # remote control, fresh: the worker's count of tasks run so far
                wait_for(lambda: (entry := worker_entry(flower, "flower@"))
                         and entry[1]["stats"]["total"].get(ADD) == len(sent),
                         timeout=30, what=f"inspect stats counting {len(sent)} tasks")
            time.sleep(max(0.0, PACE - (time.monotonic() - slot)))  # the pace, not a sync

        # At the end: every task still listed as SUCCESS, the worker alive and inspectable.
        assert succeeded(flower, sent), "a task went missing from /api/tasks"
        asked_at = time.time()
        name_now, info = wait_for(lambda: worker_entry(flower, "flower@"), timeout=30,
                                  what="the worker's remote-control info at the end")
        assert name_now == name
        check_remote_control(name, info, worker)
        assert info["timestamp"] >= asked_at  # refreshed now, not what Flower kept
        assert info["stats"]["total"] == {ADD: len(sent)}, info["stats"]["total"]
        assert flower.json("/api/workers?status=1").get(name) is True
    print(f"{len(sent)} tasks over {time.monotonic() - started:.0f} s; "
          f"send-to-SUCCESS-in-Flower max {max(lags):.2f} s, mean {sum(lags) / len(lags):.2f} s")
    assert len(sent) >= RUN_FOR // PACE
    assert flower.failures() == [], flower.log_tail()
