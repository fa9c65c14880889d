"""Limits per queue with real Celery workers: an in-flight cap that two workers of 8 threads
each never exceed together (and do reach), and a rate that three workers hold between them.
On a standalone Valkey and a three-primary Valkey cluster; Redis kinds under `slow` (the
same scripts, and each test runs for seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

import celery_redis_lua
from celery_redis_lua import ScriptError

from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True
CAP, CAPPED_TASKS, TASK_S = 3, 30, 0.2
RATE, WINDOW_S, RATED_TASKS = 20, 10.0, 260  # 20/s for 10 s: about 200 starts, then some left
TOLERANCE = 0.10


def max_overlap(started: list[dict], finished: list[dict]) -> int:
    """Most tasks running at once, from their own start and end times (an end before a start
    at the same instant: the slot was free)."""
    events = sorted([(e["at"], 1) for e in started] + [(e["at"], -1) for e in finished])
    running_now = most = 0
    for _, step in events:
        running_now += step
        most = max(most, running_now)
    return most


def test_two_workers_of_8_threads_never_exceed_an_in_flight_cap_of_3(
        broker: Broker, producer: Celery, log_dir: Path) -> None:
    # Late acks: a message is in flight from its delivery until its task has finished, so
    # the overlap of the tasks' own [start, end] is at most what the cap lets be in flight.
    workers = [Worker(broker, name=f"capped{i}", concurrency=8, env={"CRL_ACKS_LATE": "1"}, log_dir=log_dir)
               for i in (1, 2)]
    with running(*workers):
        # Bad input through the app's API: refused by value, nothing set.
        with pytest.raises(ScriptError, match=r"rate must be N/s, N/m or N/h .* got '0/s'"):
            celery_redis_lua.limit(producer, "celery", rate="0/s")
        with pytest.raises(ScriptError, match=r"in_flight must be an integer .* got '-3'"):
            celery_redis_lua.limit(producer, "celery", in_flight=-3)
        with pytest.raises(ScriptError, match=r"no queue '.*meta:\{nowhere\}'"):
            celery_redis_lua.limit(producer, "nowhere", in_flight=3)
        with pytest.raises(ValueError, match="nothing to clear"):
            celery_redis_lua.clear_limits(producer, "celery", in_flight=False, rate=False)
        assert broker.lib().metrics(["celery"])[0].limits == celery_redis_lua.Limits()
        assert celery_redis_lua.limit(producer, "celery", in_flight=CAP) == celery_redis_lua.Limits(CAP, None)
        for i in range(CAPPED_TASKS):
            producer.send_task("celery_e2e.app.slow", (f"t{i}", TASK_S))
        wait_for(lambda: len(broker.entries("finished")) == CAPPED_TASKS, timeout=90,
                 what="every capped task finished")
        [metrics] = broker.lib().metrics(["celery"])
        assert (metrics.ready, metrics.limits.in_flight) == (0, CAP)
    started, finished = broker.entries("started"), broker.entries("finished")
    assert sorted(e["label"] for e in started) == sorted(f"t{i}" for i in range(CAPPED_TASKS))
    assert max_overlap(started, finished) == CAP  # reached, never exceeded


def test_three_workers_hold_a_rate_of_20_per_second_between_them(
        broker: Broker, producer: Celery, log_dir: Path) -> None:
    workers = [Worker(broker, name=f"rated{i}", log_dir=log_dir) for i in (1, 2, 3)]
    with running(*workers):
        # The whole backlog is queued before the first start (paused meanwhile): a producer
        # slower than the rate (a loaded machine) must not thin out the measured window.
        assert celery_redis_lua.pause(producer, "celery", "filling the backlog")
        celery_redis_lua.limit(producer, "celery", rate=f"{RATE}/s")
        for i in range(RATED_TASKS):
            producer.send_task("celery_e2e.app.note", (f"r{i}",))
        assert celery_redis_lua.resume(producer, "celery")
        wait_for(lambda: len(broker.entries("ran")) >= RATE * WINDOW_S + 20, timeout=60,
                 what="the window filled")
        times = sorted(e["at"] for e in broker.entries("ran"))
        assert celery_redis_lua.clear_limits(producer, "celery") == celery_redis_lua.Limits()
        wait_for(lambda: len(broker.entries("ran")) == RATED_TASKS, timeout=30,
                 what="the rest ran once the rate was cleared")
    in_window = [t for t in times if times[0] <= t < times[0] + WINDOW_S]
    expected = RATE * WINDOW_S
    # Each worker alone could start 8 at once and hundreds per second: 3 x 20/s would be 600.
    assert expected * (1 - TOLERANCE) <= len(in_window) <= expected * (1 + TOLERANCE), len(in_window)
