"""examples/minimal/tasks.py, run as its docstring (and the README, and docs/getting-started.md) say:
a worker started from that directory and a producer that imports the module and waits for the
result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts.servers import Server

from .harness import wait_for

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minimal"


def test_the_minimal_example_runs_a_task_and_returns_its_result(tmp_path: Path) -> None:
    with Server("valkey") as server:
        env = {**os.environ, "CELERY_BROKER_URL": f"redislua://127.0.0.1:{server.port}/0",
               "CELERY_RESULT_BACKEND": f"redis://127.0.0.1:{server.port}/1"}
        log = (tmp_path / "worker.log").open("wb")
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--loglevel", "INFO", "--pool", "solo"],
            cwd=EXAMPLE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: b" ready." in (tmp_path / "worker.log").read_bytes(), timeout=60,
                     what="the worker is ready")
            # The README's and docs/getting-started.md's producer line.
            producer = "from tasks import add; print(add.delay(2, 3).get(timeout=30))"
            produced = subprocess.run([sys.executable, "-c", producer], cwd=EXAMPLE, env=env,
                                      capture_output=True, text=True, timeout=60)
            assert produced.returncode == 0, produced.stderr
            assert produced.stdout.strip() == "5"
        finally:
            worker.terminate()
            worker.wait(30)
