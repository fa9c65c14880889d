"""The Celery app the benchmark's workers run (``celery -A scripts.bench.app worker``).

Configured from the environment (BENCH_BROKER_URL, BENCH_TRANSPORT, BENCH_TRANSPORT_OPTIONS
as JSON, BENCH_QUEUE, BENCH_ACKS_LATE); the producer builds the same app in-process with ``make_app``.
The one task, ``bench.noop``, appends ``<tag> <sent> <started>`` (time.monotonic(),
a system-wide clock) to the file BENCH_LEDGER with one O_APPEND write, so recording
costs no broker or network round trip. The worker touches BENCH_READY when ready.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready

_ledger: dict[str, int | None] = {"pid": None, "fd": None}


def _record(tag: str, sent: float) -> None:
    started = time.monotonic()
    if _ledger["pid"] != os.getpid():  # a prefork child opens its own descriptor
        path = os.environ["BENCH_LEDGER"]
        _ledger["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _ledger["pid"] = os.getpid()
    fd = _ledger["fd"]
    assert fd is not None
    os.write(fd, f"{tag} {sent!r} {started!r}\n".encode())


def make_app(broker_url: str, transport: str | None = None, queue: str = "bench",
             acks_late: bool = False, transport_options: dict[str, Any] | None = None) -> Celery:
    app = Celery("bench", broker=broker_url, set_as_current=False)
    config: dict[str, Any] = {
        "task_default_queue": queue,
        "task_acks_late": acks_late,
        "task_ignore_result": True,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if transport:
        config["broker_transport"] = transport
    if transport_options:  # e.g. confirm_publish, for the producer and the worker alike
        config["broker_transport_options"] = transport_options
    app.conf.update(config)

    @app.task(name="bench.noop")
    def noop(tag: str, sent: float) -> None:
        _record(tag, sent)

    return app


app = make_app(
    os.environ.get("BENCH_BROKER_URL", "memory://"),  # set by the benchmark for workers
    os.environ.get("BENCH_TRANSPORT") or None,
    os.environ.get("BENCH_QUEUE", "bench"),
    os.environ.get("BENCH_ACKS_LATE") == "1",
    json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
)


@worker_ready.connect
def _ready(**_: Any) -> None:
    ready = os.environ.get("BENCH_READY")
    if ready:
        Path(ready).write_text(str(os.getpid()))
