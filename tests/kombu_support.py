"""The kombu side of the tests: a broker under test (a server and a key prefix), and
helpers that drain and consume through a real kombu Connection."""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass
from typing import Any

import redis
from kombu import Connection, Consumer, Queue
from kombu.message import Message

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.servers import Cluster, Server


@dataclass
class Broker:
    server: Server | Cluster
    prefix: str
    client: redis.Redis  # a RedisCluster for a cluster

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.server, Cluster)

    def connection(self, db: int = 0, **options: Any) -> Connection:
        if isinstance(self.server, Cluster):
            url = f"redislua+cluster://127.0.0.1:{self.server.nodes[0].port}/{db}"
        else:
            url = f"redislua://127.0.0.1:{self.server.port}/{db}"
        return Connection(url, transport_options={"global_keyprefix": self.prefix, **options})

    def blocked_clients(self) -> int:
        """Clients in a blocking command now (on every node of a cluster)."""
        if isinstance(self.server, Cluster):
            return sum(node.client(socket_timeout=5).info("clients")["blocked_clients"]
                       for node in self.server.running())
        return int(self.client.info("clients")["blocked_clients"])

    @property
    def keys(self) -> Keyspace:
        """The transport's keyspace on db 0 (fanout streams are ``P/0.<exchange>``)."""
        return Keyspace(self.prefix, fanout_prefix="/0.")

    @property
    def lib(self) -> ScriptLibrary:
        return ScriptLibrary(self.client, self.keys)

    def queue_keys(self, queue: str) -> set[str]:
        if isinstance(self.server, Cluster):  # KEYS goes to one node unless told otherwise
            return {k.decode() for k in self.client.keys(f"*{{{queue}}}*",
                                                         target_nodes=self.client.PRIMARIES)}
        return {k.decode() for k in self.client.keys(f"*{{{queue}}}*")}


def drain(conn: Connection, got: list[Any], count: int, timeout: float = 10.0) -> None:
    """drain_events until ``got`` holds ``count`` items (fails after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while len(got) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"got {len(got)} of {count} messages within {timeout}s")
        with contextlib.suppress(socket.timeout):
            conn.drain_events(timeout=remaining)


def consume(conn: Connection, queues: list[Queue], count: int, *, ack: bool = True,
            **consumer_args: Any) -> list[Message]:
    got: list[Message] = []

    def on_message(body: Any, message: Message) -> None:
        got.append(message)
        if ack and not consumer_args.get("no_ack"):
            message.ack()

    with Consumer(conn, queues, callbacks=[on_message], **consumer_args):
        drain(conn, got, count)
    return got
