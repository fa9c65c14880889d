"""The transports under test: a name, a kombu URL and optionally a transport class.

Default peers, all in the same run: ours (``redislua://``), kombu's stock Redis
transport (``redis://``) and celery-redis-plus (``redis://`` with its transport class)
on one throwaway server of the same kind (never 6379), and RabbitMQ through py-amqp
when it answers on ``--amqp-url``. ``--peer NAME=URL[,CLASS]`` points the benchmark at
any other kombu transport instead.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from kombu import Connection, Exchange, Queue
from redis.cluster import RedisCluster

import celery_redis_lua  # noqa: F401  (registers the redislua:// schemes with kombu)

ROOT = Path(__file__).resolve().parents[2]
PLUS_TRANSPORT = "celery_redis_plus.transport:Transport"
STOCK_SCHEMES = {"redis", "rediss", "valkey", "valkeys"}  # kombu's own transport
REDIS_SCHEMES = {*STOCK_SCHEMES, "redislua", "redisluas", "redislua+cluster"}
BASELINE = "stock"  # ratios are to kombu's stock Redis transport


@dataclass(frozen=True)
class Peer:
    name: str
    url: str
    transport: str | None = None  # "module:Class"; None: the URL's scheme decides
    # Another checkout of celery-redis-lua (e.g. the previous commit): its jobs run in a
    # subprocess whose package (and its workers') comes from <checkout>/python.
    checkout: str | None = None
    # Transport options for the connection (e.g. {"durability": "replicas:1"}), and a
    # message count that overrides --kombu-n for this peer's kombu-level jobs.
    options: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    n: int | None = None
    # A variant of another peer's publish path (confirms on or off): it runs the kombu and
    # Celery throughput phases, not the broker mechanics or the shutdown timing.
    publish_variant: bool = False
    # Ours with each run's publishes in one confirm_together() block (a Celery group's way).
    together: bool = False

    def block(self) -> contextlib.AbstractContextManager[None]:
        """What a run's publishing loop goes in: a confirm_together() block, or nothing."""
        if not self.together:
            return contextlib.nullcontext()
        from celery_redis_lua import confirm_together
        return confirm_together()

    @property
    def is_redis(self) -> bool:
        return urlsplit(self.url).scheme in REDIS_SCHEMES

    @property
    def is_standalone_redis(self) -> bool:
        return self.is_redis and not urlsplit(self.url).scheme.endswith("+cluster")

    @property
    def is_ours(self) -> bool:
        """Our transport, on one server or a cluster."""
        return self.transport is None and urlsplit(self.url).scheme.startswith("redislua")

    @property
    def is_stock(self) -> bool:
        """kombu's own Redis transport."""
        return self.transport is None and urlsplit(self.url).scheme in STOCK_SCHEMES

    @property
    def is_ours_standalone(self) -> bool:
        """Our transport on one server (not a cluster, not another broker's transport)."""
        return self.is_ours and not urlsplit(self.url).scheme.endswith("+cluster")

    def redis_client(self) -> redis.Redis | RedisCluster | None:
        """A plain client to the peer's server (for INFO), or None for non-Redis brokers."""
        if not self.is_redis:
            return None
        parts = urlsplit(self.url)
        if parts.scheme.endswith("+cluster"):  # snapshots sum over its primaries (server_cost.py)
            return RedisCluster.from_url(parts._replace(scheme="redis").geturl())
        scheme = "rediss" if parts.scheme in {"rediss", "redisluas", "valkeys"} else "redis"
        return redis.Redis.from_url(parts._replace(scheme=scheme).geturl())

    def connection(self) -> Connection:
        kwargs: dict[str, Any] = {"transport_options": dict(self.options)} if self.options else {}
        if self.transport:
            kwargs["transport"] = self.transport
        return Connection(self.url, **kwargs)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "transport": self.transport, "checkout": self.checkout,
                "options": self.options, "n": self.n}


def parse_peer(text: str) -> Peer:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--peer wants NAME=URL[,module:Class], got {text!r}")
    url, _, transport = rest.partition(",")
    return Peer(name.strip(), url.strip(), transport.strip() or None)


def parse_checkout(text: str, port: int, db: int) -> Peer:
    """``NAME=DIR``: our transport from another checkout, on the run's server, db ``db``."""
    name, sep, directory = text.partition("=")
    if not sep or not name or not (Path(directory) / "python" / "celery_redis_lua").is_dir():
        raise ValueError(f"--checkout wants NAME=DIR of a celery-redis-lua checkout, got {text!r}")
    return Peer(name.strip(), f"redislua://127.0.0.1:{port}/{db}", checkout=str(Path(directory).resolve()))


def plus_available() -> str | None:
    """None when celery-redis-plus imports, else why not."""
    try:
        importlib.import_module("celery_redis_plus.transport")
    except Exception as error:  # ImportError, or a SyntaxError on a too-old Python
        return f"celery-redis-plus not importable ({type(error).__name__}: {error})"
    return None


def amqp_available(url: str) -> str | None:
    """None when a RabbitMQ answers on ``url`` (a real AMQP handshake), else why not."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=1):
            pass
        with Connection(url, connect_timeout=3) as conn:
            conn.connect()
    except Exception as error:
        return f"no RabbitMQ at {url} ({type(error).__name__}: {error})"
    return None


def default_peers(port: int, amqp_url: str, wanted: list[str]) -> tuple[list[Peer], dict[str, str]]:
    """The default peers that are available here, and why the others were skipped."""
    # One server, one database each: the transports disagree on key types (kombu's stock
    # binding tables are SETs, ours and celery-redis-plus's ZSETs), so they cannot share a db.
    base = f"127.0.0.1:{port}"
    candidates = {
        "lua": (Peer("lua", f"redislua://{base}/0"), None),
        # the opt-in pipelined publish (confirm_publish=False): like RabbitMQ's default
        "lua-unconfirmed": (Peer("lua-unconfirmed", f"redislua://{base}/3",
                                 options={"confirm_publish": False}, publish_variant=True), None),
        # confirmed, each run's publishes in one confirm_together() block (as a Celery group)
        "lua-together": (Peer("lua-together", f"redislua://{base}/4", publish_variant=True, together=True),
                         None),
        "stock": (Peer("stock", f"redis://{base}/1"), None),
        "plus": (Peer("plus", f"redis://{base}/2", PLUS_TRANSPORT), plus_available),
        "rabbit": (Peer("rabbit", amqp_url), lambda: amqp_available(amqp_url)),
        # py-amqp waits for the broker's confirm of each publish (what our publish always does)
        "rabbit-confirm": (Peer("rabbit-confirm", amqp_url, options={"confirm_publish": True},
                                publish_variant=True),
                           lambda: amqp_available(amqp_url)),
    }
    peers, skipped = [], {}
    for name in wanted:
        if name not in candidates:
            raise ValueError(f"unknown peer {name!r}; expected some of {sorted(candidates)}")
        peer, check = candidates[name]
        reason = check() if check else None
        if reason:
            skipped[name] = reason
        else:
            peers.append(peer)
    return peers, skipped


def unique_queue(kind: str) -> str:
    """A queue (and exchange) name nobody else uses: bench-<kind>-<random>."""
    return f"bench-{kind}-{uuid.uuid4().hex[:10]}"


def bind_queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def delete_queue(peer: Peer, name: str) -> None:
    """Delete our queue and exchange (RabbitMQ keeps them otherwise; on Redis, the keys)."""
    with peer.connection() as conn:
        channel = conn.channel()
        queue = bind_queue(name)(channel)
        queue.delete()
        queue.exchange.delete()
        channel.close()


def body_of_size(size: int = 300, **fields: Any) -> dict[str, Any]:
    """A JSON body of about ``size`` bytes (a small task's arguments)."""
    body: dict[str, Any] = {"args": [1, 2], "kwargs": {}, **fields, "pad": ""}
    body["pad"] = "x" * max(0, size - len(json.dumps(body)))
    return body
