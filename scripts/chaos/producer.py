"""The producer: one thread sending ``chaos.work`` at a fixed rate with a seeded mix of
fast, slow, countdown and high-priority tasks; each accepted submission goes to the ledger
with its eligibility time (the ETA for a countdown). With ``together`` (``--together N``) the
tasks go in confirm_together() blocks of N, each confirmed when its block ends."""

from __future__ import annotations

import random
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from celery import Celery

from celery_redis_lua import UnconfirmedPublishError, confirm_together
from scripts.chaos import flow, ledger, switch
from scripts.chaos.app import main_queues
from scripts.chaos.profiles import Profile

RETRY_POLICY = {"max_retries": 40, "interval_start": 0.1, "interval_step": 0.2, "interval_max": 0.5}


class Producer(threading.Thread):
    def __init__(self, broker_url: str, transport_options: dict[str, Any], ledger_url: str,
                 profile: Profile, seed: int, with_flow: bool = False, shards: int | None = None,
                 together: int = 0, netns: str | None = None) -> None:
        super().__init__(name="chaos-producer", daemon=True)
        self.app = Celery("chaos-producer", broker=broker_url, set_as_current=False)
        self.app.conf.broker_transport_options = transport_options
        # the routes the workers bind, declared as they declare them (flow queues with --flow)
        self.app.conf.task_queues = (*main_queues(shards), *(flow.queues() if with_flow else ()))
        self.mix = {**profile.mix, **flow.mix(profile.rate)} if with_flow else profile.mix
        self.app.conf.broker_connection_retry_on_startup = True
        self.ledger_url, self.profile = ledger_url, profile
        self.rng = random.Random(seed * 7919 + 1)
        self.halt = threading.Event()
        self.sent = self.errors = 0
        self.together = together  # > 0: tasks go in confirm_together() blocks of this many
        self.netns = netns  # a namespace of its own on the switch (partition_producer on a switch)

    def next_task(self) -> tuple[str, float, int, float]:
        """(kind, seconds the task runs, priority, countdown)."""
        p, rng = self.profile, self.rng
        kind = rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        if kind in flow.KINDS:
            return kind, *flow.next_task(rng, kind), 0.0  # seconds, failures (in the priority's place)
        if kind == "slow":
            return kind, rng.uniform(*p.slow_seconds), 0, 0.0
        if kind == "countdown":
            return kind, rng.uniform(0.005, 0.05), 0, rng.uniform(*p.countdown_seconds)
        if kind == "priority":
            return kind, rng.uniform(0.005, 0.05), 9, 0.0
        return kind, rng.uniform(0.005, 0.05), 0, 0.0

    def send(self, kind: str, seconds: float, priority: int, countdown: float) -> dict[str, Any] | None:
        """Send one task; its ledger entry, to record once confirmed (None: refused, recorded)."""
        task_id = str(uuid.uuid4())
        now = time.time()
        eligible = now + countdown
        options: dict[str, Any] = {"task_id": task_id, "retry": True, "retry_policy": RETRY_POLICY}
        name, args, extra = "chaos.work", [kind, seconds], {}
        if kind in flow.KINDS:  # a flow task: ``priority`` holds how many deliveries fail
            name, args, extra = "chaos.flow", [kind, seconds, priority], {"failures": priority}
            options["queue"] = flow.CAPPED if kind == "capped" else flow.RETRYING
            priority = 0
        elif priority:
            options["priority"] = priority
        if kind == "routed":  # through the topic exchange to the queue with x-expires
            options.update(queue="expiring", routing_key=f"jobs.{task_id[:8]}")
        if countdown:
            options["eta"] = datetime.fromtimestamp(eligible, tz=UTC)
        submit = {"id": task_id, "t": now, "kind": kind, "priority": priority, "eligible": eligible,
                  "seconds": seconds, "queue": options.get("queue", "celery"), **extra}
        try:
            self.app.send_task(name, args=args, **options)
        except Exception as error:
            self.failed(submit, error)
            return None
        return submit

    def confirmed(self, submit: dict[str, Any]) -> None:
        self.sent += 1
        ledger.record("submit", self.ledger_url, sent=time.time(), **submit)

    def failed(self, submit: dict[str, Any], error: BaseException) -> None:
        """Its outcome unknown (or refused): delivered anyway, it counts as recovered."""
        self.errors += 1
        ledger.record("submit_error", self.ledger_url, id=submit["id"], t=time.time(), kind=submit["kind"],
                      error=repr(error)[:300])

    def send_block(self) -> int:
        """``together`` tasks in one confirm_together() block (a Celery group's way): each is
        confirmed when the block ends, or named by its UnconfirmedPublishError."""
        tasks = [self.next_task() for _ in range(self.together)]
        gathered: list[dict[str, Any]] = []
        try:
            with confirm_together():
                gathered = [s for s in (self.send(*task) for task in tasks) if s is not None]
        except UnconfirmedPublishError as error:
            refused = set(error.task_ids)
            for submit in gathered:
                (self.failed(submit, error) if submit["id"] in refused else self.confirmed(submit))
            return len(tasks)
        except Exception as error:  # the block's end itself failed: every outcome unknown
            for submit in gathered:
                self.failed(submit, error)
            return len(tasks)
        for submit in gathered:
            self.confirmed(submit)
        return len(tasks)

    def run(self) -> None:
        if self.netns:  # before its first connection: every socket it opens is the namespace's
            switch.enter(self.netns)
        began, n = time.monotonic(), 0
        while not self.halt.is_set():
            if self.together:
                n += self.send_block()
            else:
                submit = self.send(*self.next_task())
                if submit is not None:
                    self.confirmed(submit)
                n += 1
            delay = began + n / self.profile.rate - time.monotonic()
            if delay > 0:
                self.halt.wait(delay)  # pacing, not synchronisation

    def stop(self) -> None:
        self.halt.set()
        self.join(120)
        self.app.close()
