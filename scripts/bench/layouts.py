"""Candidate keyspace layouts for queued messages, measured with raw commands (issue 15).

The transport's memory per queued message with a Celery task id misses 1.2x stock, and its
consume+ack slows by more than 10% a million messages deep. Both come from the layout
(docs/decisions.md, "Memory per queued message"). Before a redesign, this measures candidate
layouts without writing their scripts:

1. The rows the real ``publish`` script stores: 30,000 kombu messages with a task id each,
   published through the transport, read back (payload, state string, priority, ids).
2. The same rows written again into an empty server in each candidate layout, with plain
   commands. ``used_memory`` delta per message, beside stock kombu's own (LPUSH through
   kombu).
3. The ready structure's pop cost by depth: ``ZPOPMIN`` of a ZSET against ``LPOP`` of a list,
   100 ids per call, at 1,000, 100,000 and 1,000,000 deep, in server µs per call
   (INFO commandstats).

``python -m scripts.bench.layouts [--count 30000] [--kind redis]`` on a throwaway server.
It prints markdown tables and writes nothing else.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kombu import Connection

from celery_redis_lua import Keyspace
from scripts.servers import Server, server_version

from .peers import bind_queue, body_of_size

PRIORITY_FACTOR = 10_000_000_000_000  # as in publish.lua: (255 - priority) * 10^13 + ready_at_ms
QUEUE = "mem"
KEYS = Keyspace().queue_keys(QUEUE)


def ready_key(level: int) -> str:
    """A candidate key, not in the keyspace: one list of ready messages per priority level."""
    return KEYS.queue.replace("queue:", "ready:", 1) + f":{level}"


@dataclass(frozen=True)
class Row:
    """One queued message as ``publish`` stored it."""

    id: str
    score: int  # its queue:{Q} score
    payload: str
    state: str  # 'ready 0 PRIORITY EXPIRES_AT TASK_ID'

    @property
    def task_id(self) -> str:
        return self.state.split(" ", 4)[4]

    @property
    def priority(self) -> int:
        return 255 - self.score // PRIORITY_FACTOR


def flush(client: Any) -> None:
    """Empty the server and free the memory now (Valkey frees a plain FLUSHALL's memory in the
    background, lazyfree-lazy-user-flush, so a used_memory read after it would be too high)."""
    client.execute_command("FLUSHALL", "SYNC")


def publish(url: str, count: int, size: int) -> None:
    """``count`` kombu messages of a ~``size``-byte body, each with its own Celery task id."""
    queue = bind_queue(QUEUE)
    body = body_of_size(size)
    with Connection(url) as connection:
        producer = connection.Producer()
        for i in range(count):
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue],
                             headers={"id": str(uuid.UUID(int=i))})


def published_rows(server: Server, count: int, size: int) -> list[Row]:
    """``count`` kombu messages with task ids, through the transport; what it stored."""
    client = server.client(decode_responses=True)
    flush(client)
    publish(f"redislua://127.0.0.1:{server.port}/0", count, size)
    payloads = client.hgetall(KEYS.message)
    states = client.hgetall(KEYS.state)
    scores = dict(client.zrange(KEYS.queue, 0, -1, withscores=True))
    rows = [Row(id, int(scores[id]), payload, states[id]) for id, payload in sorted(payloads.items())]
    flush(client)
    client.close()
    return rows


def task_id_in_state(rows: list[Row]) -> Iterable[tuple[Any, ...]]:
    """0.2.0 from 12-03 until the wake list: payload and state hashes (the task id the state's
    last word, and 'task:<tid>' -> id beside it), ready ZSET, and an index entry per ready message."""
    for r in rows:
        yield "HSET", KEYS.message, r.id, r.payload
        yield "HSET", KEYS.state, r.id, r.state, f"task:{r.task_id}", r.id
        yield "ZADD", KEYS.queue, r.score, r.id
        yield "ZADD", KEYS.index, r.score % PRIORITY_FACTOR + 300_000, r.id


def tid_field(rows: list[Row]) -> Iterable[tuple[Any, ...]]:
    """0.2.0 until 2026-12-03: the task id in a 'tid:<id>' field of its own, not in the state."""
    for command in task_id_in_state(rows):
        if command[1] != KEYS.state:
            yield command
            continue
        _, key, id, state, *index = command
        without_task, task_id = state.rsplit(" ", 1)
        yield "HSET", key, id, without_task, *index, f"tid:{id}", task_id


def today(rows: list[Row]) -> Iterable[tuple[Any, ...]]:
    """The layout of 0.2.0 now: as above, but a ready message has no index entry (only in-flight
    and TTL'd ones have), and the queue's one wake token (consumers block on it with BLPOP)."""
    for command in task_id_in_state(rows):
        if command[1] != KEYS.index:
            yield command
    yield "RPUSH", KEYS.wake, "1"


def ready_lists(rows: list[Row]) -> Iterable[tuple[Any, ...]]:
    """As above, with the ready ids in one list per priority level instead of a ZSET."""
    for command in today(rows):
        if command[1] != KEYS.queue:
            yield command
    for r in rows:
        yield "RPUSH", ready_key(r.priority), r.id


def message_in_list(rows: list[Row]) -> Iterable[tuple[Any, ...]]:
    """A ready message wholly in its priority's list ('ID STATE', its task id last, newline, payload); only
    the task index outside it. Consume would move it into the hashes as it goes in flight."""
    for r in rows:
        yield "RPUSH", ready_key(r.priority), f"{r.id} {r.state}\n{r.payload}"
        yield "HSET", KEYS.state, f"task:{r.task_id}", r.id


def message_in_list_no_task_index(rows: list[Row]) -> Iterable[tuple[Any, ...]]:
    """As above without the task index: the floor of any layout that keeps one list element."""
    for command in message_in_list(rows):
        if command[0] == "RPUSH":
            yield command


LAYOUTS: dict[str, Callable[[list[Row]], Iterable[tuple[Any, ...]]]] = {
    "0.2.0 until 12-03 (task id also in a 'tid:<id>' field)": tid_field,
    "0.2.0 from 12-03 (the task id in the state string)": task_id_in_state,
    "today (0.2.0, and no index entry while ready)": today,
    "... and ready ids in a list per priority": ready_lists,
    "ready message wholly in its priority's list, task index beside": message_in_list,
    "ready message wholly in its list, no task index": message_in_list_no_task_index,
}


def memory_per_message(client: Any, commands: Iterable[tuple[Any, ...]], count: int) -> float:
    flush(client)
    before = int(client.info("memory")["used_memory"])
    pipe = client.pipeline(transaction=False)
    for i, command in enumerate(commands, 1):
        pipe.execute_command(*command)
        if i % 2000 == 0:
            pipe.execute()
    pipe.execute()
    delta = (int(client.info("memory")["used_memory"]) - before) / count
    flush(client)
    return delta


def stock_memory(server: Server, count: int, size: int) -> float:
    """kombu's stock Redis transport, the same messages (task ids included)."""
    client = server.client()
    flush(client)
    before = int(client.info("memory")["used_memory"])
    publish(f"redis://127.0.0.1:{server.port}/0", count, size)
    delta = (int(client.info("memory")["used_memory"]) - before) / count
    flush(client)
    return delta


def pop_cost(client: Any, depth: int, calls: int = 30, per_call: int = 100) -> dict[str, float]:
    """Server µs per call of ZPOPMIN and of LPOP, ``per_call`` ids each, ``depth`` deep (the
    popped ids are pushed back behind, so the depth holds)."""
    flush(client)
    pipe = client.pipeline(transaction=False)
    for first in range(0, depth, 10_000):
        ids = [f"{i:014x}" for i in range(first, min(depth, first + 10_000))]
        pipe.zadd("z", {id: PRIORITY_FACTOR * 255 + i for i, id in enumerate(ids, first)})
        pipe.rpush("l", *ids)
        pipe.execute()
    cost = {}
    for command in ("zpopmin", "lpop"):
        client.config_resetstat()
        for i in range(calls):
            if command == "zpopmin":
                popped = [member for member, _ in client.zpopmin("z", per_call)]
                client.zadd("z", {member: PRIORITY_FACTOR * 255 + depth + i * per_call + j
                                  for j, member in enumerate(popped)})
            else:
                client.rpush("l", *client.lpop("l", per_call))
        stats = client.info("commandstats")[f"cmdstat_{command}"]
        cost[command] = stats["usec"] / stats["calls"]
    flush(client)
    return cost


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=30_000)
    parser.add_argument("--size", type=int, default=300)
    parser.add_argument("--kind", default="redis")
    parser.add_argument("--depths", default="1000,100000,1000000")
    args = parser.parse_args(argv)
    with Server(args.kind) as server:
        client = server.client()
        version = server_version(client)
        rows = published_rows(server, args.count, args.size)
        stock = stock_memory(server, args.count, args.size)
        print(f"## Memory per queued message, {args.count:,} with task ids, "
              f"{version} (stock kombu: {stock:,.0f} B; 1.2x: {1.2 * stock:,.0f} B)\n")
        print("| layout | bytes per message | over stock |\n|---|---:|---:|")
        for name, layout in LAYOUTS.items():
            used = memory_per_message(client, layout(rows), args.count)
            print(f"| {name} | {used:,.0f} | {used / stock:.2f}x |")
        print(f"\n## Ready structure, server µs per pop of 100 ids, {version}\n")
        print("| depth | ZPOPMIN (ZSET) | LPOP (list) |\n|---:|---:|---:|")
        for depth in (int(d) for d in args.depths.split(",")):
            cost = pop_cost(client, depth)
            print(f"| {depth:,} | {cost['zpopmin']:.1f} | {cost['lpop']:.1f} |")


if __name__ == "__main__":
    main()
