"""Where is my task, and cancel in the broker: the task-id index publish keeps, each state
locate reports, the drops that take a message's index entries with it, cancel (ready,
delayed, in flight, missing), and the CLI commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from celery_redis_lua import ScriptLibrary
from celery_redis_lua.protocol.retry import DelayedRetry
from celery_redis_lua.tools.locate import cancel_task, locate_task
from helpers import server_now_ms, wait_for_server_time
from scripts.servers import Server


def envelope(task_id: str, retries: int = 0) -> str:
    return json.dumps({"body": "", "headers": {"id": task_id, "task": "tasks.add", "retries": retries},
                       "properties": {}})


def publish(lib: ScriptLibrary, queue: str, task_id: str, retries: int = 0, **kwargs: object) -> str:
    return lib.publish(queue, envelope(task_id, retries), task_id=task_id, **kwargs)  # type: ignore[arg-type]


def index_fields(lib: ScriptLibrary, queue: str) -> set[bytes]:
    return {f for f in lib.client.hkeys(lib.keys.state(queue)) if f.startswith((b"task:", b"tid:"))}


def test_each_state_is_reported(lib: ScriptLibrary) -> None:
    now = server_now_ms(lib.client)
    publish(lib, "w", "first", priority=1)
    publish(lib, "w", "second", priority=1)
    publish(lib, "w", "urgent", priority=9)
    publish(lib, "w", "later", eta_ms=now + 60_000)
    assert locate_task(lib, "second").state == "ready"
    assert locate_task(lib, "second").ahead == 2  # 'urgent' and 'first'
    assert locate_task(lib, "urgent").ahead == 0
    later = locate_task(lib, "later")
    assert (later.state, later.eta_ms, later.queue) == ("delayed", now + 60_000, "w")
    (held,) = lib.consume(["w"], 1).deliveries  # urgent
    running = locate_task(lib, "urgent")
    assert (running.state, running.message_id, running.delivery_count) == ("in_flight", held.id, 0)
    assert running.deadline_ms is not None and running.deadline_ms > now
    lib.ack("w", [held.id])
    assert locate_task(lib, "urgent").state == "absent"
    assert locate_task(lib, "never-sent").state == "absent"


def test_a_dead_letter_is_found_with_its_reason(lib: ScriptLibrary) -> None:
    publish(lib, "d", "doomed")
    (delivery,) = lib.consume(["d"], 1).deliveries
    lib.reject("d", [delivery.id], requeue=False)
    found = locate_task(lib, "doomed")
    assert (found.state, found.reason, found.queue) == ("dead", "rejected", "d")
    assert found.message_id == delivery.id
    (replayed,) = lib.dead_replay("d", entry_ids=[found.dead_entry or ""])
    back = locate_task(lib, "doomed")  # the replay indexes the new message under its task id
    assert (back.state, back.message_id) == ("ready", replayed)


def test_every_drop_takes_the_index_entries_with_it(lib: ScriptLibrary) -> None:
    """Acked, rejected, expired (consume and sweep), purged: no entry is left behind."""
    short = lib.with_policy(visibility_ms=30, delivery_limit=1)
    for name in ("acked", "rejected", "expired", "timed-out", "purged"):
        publish(short, "drops", name, ttl_ms=1 if name == "expired" else None)
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 5)
    by_task = {}
    for delivery in short.consume(["drops"], 10).deliveries:
        by_task[json.loads(delivery.payload)["headers"]["id"]] = delivery.id
    assert set(by_task) == {"acked", "rejected", "timed-out", "purged"}  # 'expired' was dropped
    short.ack("drops", [by_task["acked"]])
    short.reject("drops", [by_task["rejected"]], requeue=False)
    short.ack("drops", [by_task["purged"]])
    publish(short, "drops", "purged-ready")
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 40)
    short.sweep(["drops"])  # 'timed-out': its second attempt would exceed delivery_limit 1
    short.purge("drops")
    assert index_fields(lib, "drops") == set()
    states = [locate_task(lib, t).state for t in ("acked", "timed-out", "purged-ready")]
    assert states == ["absent", "dead", "absent"]


def states_of(lib: ScriptLibrary, queue: str) -> dict[str, str]:
    """The queue's state strings by message id (the task index's fields left out)."""
    fields = lib.client.hgetall(lib.keys.state(queue))
    return {k.decode(): v.decode() for k, v in fields.items() if not k.startswith(b"task:")}


def test_a_task_id_costs_one_field_and_rides_at_the_end_of_the_state(lib: ScriptLibrary) -> None:
    """The task index is 'task:<tid>' -> id beside each message's state, whose last word is
    the task id (a 'tid:<id>' field as well cost ~80 bytes per queued Celery message)."""
    ids = {task: publish(lib, "mem", task) for task in ("plain", "with spaces in it")}
    ids[""] = lib.publish("mem", "no task id")
    assert lib.client.hlen(lib.keys.state("mem")) == 3 + 2  # three states, two index entries
    states = states_of(lib, "mem")
    assert states[ids["plain"]] == "ready 0 0 - plain"
    assert states[ids["with spaces in it"]] == "ready 0 0 - with spaces in it"
    assert states[ids[""]] == "ready 0 0 -"
    assert locate_task(lib, "with spaces in it").message_id == ids["with spaces in it"]
    lib.ack("mem", [d.id for d in lib.consume(["mem"], 10).deliveries])
    assert lib.client.hlen(lib.keys.state("mem")) == 0


def test_the_task_id_moves_with_its_message_through_every_state(lib: ScriptLibrary) -> None:
    """Promoted, delivered, requeued, delivered again, restored by the sweep: each state
    string the scripts rewrite keeps the task id, so the message's drop still finds its entry."""
    short = lib.with_policy(visibility_ms=30)
    task = "walker"
    message_id = publish(short, "walk", task, eta_ms=server_now_ms(lib.client) + 20)
    seen = [states_of(lib, "walk")[message_id]]
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 25)
    (held,) = short.consume(["walk"], 1).deliveries  # promoted and delivered in one call
    seen.append(states_of(lib, "walk")[message_id])
    short.reject("walk", [held.id], requeue=True)
    seen.append(states_of(lib, "walk")[message_id])
    (claimed,) = short.consume(["walk"], 1).deliveries
    seen.append(states_of(lib, "walk")[message_id])
    wait_for_server_time(lib.client, server_now_ms(lib.client) + 40)
    assert short.sweep(["walk"]).requeued == 1  # the delivery timed out
    seen.append(states_of(lib, "walk")[message_id])
    assert seen == [f"delayed 0 0 - {task}", f"unacked 0 0 - {task}", f"ready 1 0 - {task}",
                    f"unacked 1 0 - {task}", f"ready 2 0 - {task}"]
    assert claimed.id == message_id and locate_task(lib, task).delivery_count == 2
    short.ack("walk", [d.id for d in short.consume(["walk"], 1).deliveries])
    assert index_fields(lib, "walk") == set() and locate_task(lib, task).state == "absent"


def test_one_ack_of_a_task_and_its_retry_takes_the_entry_once(lib: ScriptLibrary) -> None:
    """The entry goes with whichever message holds it; an ack of ids already gone is harmless."""
    publish(lib, "both", "twice")
    (first,) = lib.consume(["both"], 1).deliveries
    publish(lib, "both", "twice", retries=1)
    (second,) = lib.consume(["both"], 1).deliveries
    assert lib.ack("both", [second.id, first.id, "00000000000000"]) == 2
    assert index_fields(lib, "both") == set() and lib.client.hlen(lib.keys.state("both")) == 0


def test_a_retry_published_under_the_same_task_id_keeps_its_entry(lib: ScriptLibrary) -> None:
    """Celery's retry publishes the same task id before the first delivery is acked."""
    publish(lib, "r", "retried")
    (first,) = lib.consume(["r"], 1).deliveries
    second = publish(lib, "r", "retried", retries=1, eta_ms=server_now_ms(lib.client) + 60_000)
    lib.ack("r", [first.id])
    found = locate_task(lib, "retried")
    assert (found.state, found.message_id) == ("delayed", second)


def test_a_publish_sent_again_is_stored_once(lib: ScriptLibrary) -> None:
    """kombu retries a publish whose reply a dropped connection lost; the first copy may have
    landed: the same task id with the same payload is that copy, ready or in flight."""
    first = publish(lib, "again", "resent")
    assert publish(lib, "again", "resent") == first
    (held,) = lib.consume(["again"], 1).deliveries
    assert publish(lib, "again", "resent") == first  # in flight: still the same message
    assert lib.stats(["again"])[0].in_flight == 1 and lib.stats(["again"])[0].ready == 0
    other = publish(lib, "again", "resent", retries=1)  # another payload: a new message
    assert other != first
    lib.ack("again", [held.id])
    assert lib.stats(["again"])[0].ready == 1


def test_cancel_takes_ready_and_delayed_messages_and_leaves_deliveries(lib: ScriptLibrary) -> None:
    now = server_now_ms(lib.client)
    publish(lib, "c", "countdown", eta_ms=now + 60_000)
    publish(lib, "c", "queued")
    publish(lib, "c", "running", priority=9)
    (running,) = lib.consume(["c"], 1).deliveries
    assert cancel_task(lib, "running").outcome == "in_flight"
    assert lib.stats(["c"])[0].in_flight == 1  # untouched
    done = cancel_task(lib, "countdown")
    assert (done.outcome, done.was, done.queue) == ("cancelled", "delayed", "c")
    assert cancel_task(lib, "queued").was == "ready"
    assert cancel_task(lib, "queued").outcome == "missing"
    [stats] = lib.stats(["c"])
    assert (stats.ready, stats.delayed, stats.in_flight, stats.dead) == (0, 0, 1, 2)
    assert lib.client.exists(lib.keys.queue("c"), lib.keys.wake("c")) == 0  # nothing left to wake for
    assert {d.reason for d in lib.dead_list("c")} == {"cancelled"}
    assert lib.metrics(["c"])[0].dropped == {"cancelled": 2}
    lib.ack("c", [running.id])
    assert index_fields(lib, "c") == set()


@pytest.mark.parametrize("script", ["locate", "cancel"])
def test_a_bad_task_id_is_refused_by_name(lib: ScriptLibrary, script: str) -> None:
    from celery_redis_lua.protocol.call import ScriptError
    with pytest.raises(ScriptError, match="task_id must be a non-empty string of at most 256 bytes"):
        getattr(lib, script)("q", "x" * 257)
    with pytest.raises(ScriptError, match="publish: task_id must be at most 256 bytes, got 257"):
        lib.publish("q", "payload", task_id="x" * 257)
    assert lib.stats(["q"])[0].ready == 0  # nothing half-written


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery_redis_lua", *args], capture_output=True,
                          text=True, timeout=60)


def test_the_cli_where_and_cancel(valkey_server: Server) -> None:
    client = valkey_server.client()
    client.flushall()
    url = valkey_server.url
    published = cli("publish", "tasks.add", "--queue", "jobs", "--countdown", "600", "--url", url)
    assert published.returncode == 0, published.stderr
    task_id = published.stdout.strip()
    shown = cli("where", task_id, "--url", url)
    assert shown.returncode == 0 and f"{task_id}: delayed in 'jobs': due " in shown.stdout
    as_json = json.loads(cli("where", task_id, "--json", "--url", url).stdout)
    assert (as_json["state"], as_json["queue"]) == ("delayed", "jobs")
    cancelled = cli("cancel", task_id, "--url", url)
    assert cancelled.returncode == 0 and "cancelled (delayed in 'jobs')" in cancelled.stdout
    dead = cli("where", task_id, "--url", url)
    assert "dead-lettered in 'jobs': reason cancelled" in dead.stdout
    again = cli("cancel", task_id, "--json", "--url", url)
    assert again.returncode == 3 and json.loads(again.stdout)["outcome"] == "missing"
    bad = cli("where", "", "--url", url)
    assert bad.returncode == 1 and "TASK_ID must be 1 to 256 bytes" in bad.stderr


def test_the_cli_where_says_a_task_waits_to_retry(valkey_server: Server) -> None:
    client = valkey_server.client()
    client.flushall()
    lib = ScriptLibrary(client)
    lib.declare("retried", retry=DelayedRetry("failed", 600_000))
    message_id = lib.publish("retried", "task", task_id="t-retry")
    lib.consume(["retried"], 1)
    lib.reject("retried", [message_id], requeue=True, counts=[0])
    shown = cli("where", "t-retry", "--url", valkey_server.url)
    assert shown.returncode == 0, shown.stderr
    assert "t-retry: waiting to retry in 'retried' until " in shown.stdout
    assert "delivery 1 failed or was returned" in shown.stdout
    as_json = json.loads(cli("where", "t-retry", "--json", "--url", valkey_server.url).stdout)
    assert (as_json["state"], as_json["delivery_count"]) == ("retry", 1)


@pytest.mark.parametrize("command", [["where", "t"], ["cancel", "t"], ["status"]])
def test_a_bad_queue_name_is_one_line_naming_it(valkey_server: Server, command: list[str]) -> None:
    done = cli(*command, "--queue", "}x", "--url", valkey_server.url)
    assert done.returncode == 1
    expected = "celery-redis-lua: error: bad --queue value: queue name must not start with '}', got '}x'"
    asked = f" [asked the broker {valkey_server.url} (from --url)]"  # status connects before it checks
    assert done.stderr.strip() in (expected, expected + asked)
