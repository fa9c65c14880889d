"""`make demo CLUSTER=1`: the tour runs on an embedded three-primary Valkey cluster and shows
what it promises (priority order, a countdown held in the broker, a redelivery, a
broadcast to both workers), then leaves nothing running."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import ROOT


def test_the_demo_runs_on_an_embedded_cluster() -> None:
    done = subprocess.run([sys.executable, "-m", "scripts.demo", "--cluster"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "three-primary Valkey cluster" in out
    assert len(re.findall(r"queue '[\w-]+' lives on the primary 127\.0\.0\.1:\d+", out)) == 2
    ran = re.findall(r"^\s+\d\s+(\S+)\s+(\d+)\s*$", out, flags=re.M)
    assert [label for label, _ in ran] == ["urgent", "high", "normal", "normal-2", "low", "low-2"]
    assert re.search(r"tasks the worker held in memory meanwhile \(inspect scheduled\)\s+0", out)
    assert re.search(r"^\s+2\s+w\d@demo\s+1\s+True", out, flags=re.M)  # the redelivery
    assert len(re.findall(r"w\d@demo\s+hello-everyone", out)) == 2
    assert "embedded servers stopped" in out
