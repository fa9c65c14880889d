"""The kombu transport: it makes connections and chooses the loop (kombu's ``drain_events``
or Celery's hub). The rounds and the sweep are the connection's :class:`~.poller.Poller`'s;
keeping deliveries, queues and bindings alive is the process's keeper's (:mod:`.keeper`).
"""

from __future__ import annotations

import logging
import socket
import ssl as ssl_module
import warnings
from typing import Any

import redis
from kombu.connection import Connection
from kombu.transport import virtual
from kombu.utils.objects import cached_property
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError

from _celery_redis_lua_alias import SCHEMES

from ..protocol.cluster import (
    ClusterConfigError,
    ClusterUrl,
    is_cluster_host,
    parse_cluster_host,
    remember_nodes,
    startup_nodes,
)
from ..protocol.durability import EARLY_CONFIRMATION
from ..protocol.eviction import Eviction, read_eviction
from ..protocol.fence import NoReplicasError
from ..protocol.liveness import ride_out, socket_params
from ..protocol.ops import Declared
from ..protocol.options import OptionError, TransportOptions, parse_options
from ..protocol.sentinel import (
    SentinelConfigError,
    SentinelUrls,
    explain_master_not_found,
    is_sentinel_url,
    master_pool,
    parse_sentinel_urls,
)
from ..protocol.shardmap import ShardMap
from .channel import Channel
from .poller import OVERDUE_GRACE_SECONDS, Poller

logger = logging.getLogger(__name__)

# How long a command waits for a free connection of the pool before it fails.
POOL_WAIT_SECONDS = 20.0
# URL schemes that mean TLS without certificate checks when no ssl options are given.
SECURE_SCHEMES = frozenset({"rediss", *(s for s, target in SCHEMES.items() if target == "rediss")})


# The servers (and their policies) already warned of: a worker opens several connections.
_warned_of_eviction: set[tuple[str, str]] = set()


def warn_of_eviction(eviction: Eviction, server: str) -> None:
    warning = eviction.warning(server)
    if warning is None or (server, str(eviction.policy)) in _warned_of_eviction:
        return
    _warned_of_eviction.add((server, str(eviction.policy)))
    logger.warning("celery-redis-lua: %s", warning)


class Transport(virtual.Transport):
    """kombu transport for Redis 7+ and Valkey on the celery-redis-lua scripts."""

    Channel = Channel
    # kombu's base Transport is unannotated, so mypy takes the types of its defaults (a float
    # polling interval, no default port) for the attributes' types.
    polling_interval = None  # type: ignore[assignment]  # never sleep between polls: the waits block on the server
    default_port = 6379  # type: ignore[assignment]  # kombu's base has None
    client: Connection  # kombu's base has None; a transport is always made for a connection
    driver_type = "redis"
    driver_name = "celery-redis-lua"
    connection_errors = (  # type: ignore[assignment]  # kombu's base infers a 1-tuple from its default
        *virtual.Transport.connection_errors,
        redis.ConnectionError, redis.AuthenticationError, redis.TimeoutError,
        redis.BusyLoadingError, redis.exceptions.TryAgainError, ConnectionError, socket.error,
        IOError, OSError, InterruptedError,
        # A primary fenced by min-replicas-to-write (no replica in reach) refuses every write
        # before running it, as a demoted one does with READONLY (through Sentinel, a
        # ConnectionError): a consume reconnects, a publish past fence_timeout is retried.
        NoReplicasError,
        # A cluster that lost a primary (until a replica is promoted), or whose slot map is
        # being rebuilt: reconnect and retry, as for a lost server.
        redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError,
        redis.exceptions.ClusterError,
        # No seed or remembered node answers (yet): the same, at connect time.
        redis.exceptions.RedisClusterException,
    )
    channel_errors = (  # type: ignore[assignment]  # kombu's base infers a 1-tuple from its default
        *virtual.Transport.channel_errors, redis.DataError, redis.exceptions.InvalidResponse,
        redis.ResponseError)
    # Only a lost connection is worth a reconnect and retry; a script refusing its input
    # (ScriptError, a channel error) must reach the caller once, as it is.
    recoverable_connection_errors = connection_errors
    recoverable_channel_errors = ()

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options: TransportOptions = parse_options(client.transport_options)
        super().__init__(client, **kwargs)
        self.polling_interval = None
        # What this connection knows of its queues, shared by its channels as kombu shares
        # its binding state: the arguments in force (from declare) and the fanout bindings.
        self.declared: dict[str, Declared] = {}
        # x-consumer-timeout (ms) of the declared queues that have one: the keeper stops
        # keeping a delivery of one alive after it (keeper.py)
        self.consumer_timeouts: dict[str, int] = {}
        self.fanout_queues: dict[str, tuple[str, str]] = {}  # queue -> (exchange, routing key)
        self.shards = ShardMap()  # the declared sharded queues (x-shards, protocol/shards.py)
        self._server_checked = False  # eviction and the durability setting, once per connection
        self.sentinel  # noqa: B018  (bad sentinel URLs or a missing master_name: an error now)
        self.cluster  # noqa: B018  (bad cluster URLs or options: an error now)
        # A wait's reply overdue by OVERDUE_GRACE_SECONDS drops its connection. Not longer:
        # after a network partition the reply the server sent into it comes back only at its
        # TCP's next retransmission (exponential backoff: 12 s after a 14 s cut), so waiting
        # out health_check_interval too (as before 2026-12-06) held a worker idle that long.
        self.poller = Poller(sweep_interval=self.options.sweep_interval, overdue_grace=OVERDUE_GRACE_SECONDS)

    def driver_version(self) -> str:
        return redis.__version__

    # -- connections ------------------------------------------------------------------------

    @cached_property
    def sentinel(self) -> SentinelUrls | None:
        """The sentinels of ``sentinel://`` or ``redislua+sentinel://`` URLs (one per sentinel,
        joined by ';')."""
        client = self.client
        urls = [url for url in client.alt if isinstance(url, str) and is_sentinel_url(url)]
        hostname = client.hostname or ""
        if not urls and is_sentinel_url(hostname):
            urls = [hostname]
        if not urls:
            if self.options.master_name is not None:
                warnings.warn("transport option 'master_name' is ignored: the broker URL is not a "
                              "sentinel:// one", RuntimeWarning, stacklevel=2)
            return None
        try:
            parsed = parse_sentinel_urls(urls)
        except SentinelConfigError as error:
            raise ValueError(f"bad broker URL: {error}") from None
        if self.options.master_name is None:
            raise OptionError("transport option 'master_name' is required with sentinel:// URLs "
                              "(the name the sentinels monitor the primary under)")
        # kombu's failover cycling would switch to the next URL after a failed connect (with
        # the class route, kombu's own Sentinel transport); the pool asks every sentinel.
        client.cycle = None
        return parsed

    @cached_property
    def cluster(self) -> ClusterUrl | None:
        """The seed nodes of a ``redislua+cluster://`` URL, or with the ``cluster`` option."""
        client, options = self.client, self.options
        host = client.hostname or ""
        if not (is_cluster_host(host) or options.cluster):
            if options.cluster_nodes:
                warnings.warn("transport option 'cluster_nodes' is ignored: the broker is not a "
                              "cluster (use redislua+cluster:// or the 'cluster' option)",
                              RuntimeWarning, stacklevel=2)
            return None
        if self.sentinel is not None:
            raise OptionError("a broker is either a cluster or behind sentinels, not both")
        if not is_cluster_host(host):  # the class route: a plain URL names the seed node
            credentials = ""
            if client.userid or client.password:
                credentials = f"{client.userid or ''}:{client.password or ''}@"
            host = f"cluster://{credentials}{host or '127.0.0.1'}:{client.port or self.default_port}/" \
                   f"{(client.virtual_host or '0').strip('/') or '0'}"
        try:
            return parse_cluster_host(host, options.cluster_nodes)
        except ClusterConfigError as error:
            raise ValueError(f"bad broker URL: {error}") from None

    @cached_property
    def db(self) -> int:
        if self.cluster is not None:
            return 0
        if self.sentinel is not None:
            return self.sentinel.db
        vhost = self.client.virtual_host or 0
        if isinstance(vhost, str):
            vhost = vhost.strip("/") or 0
        try:
            return int(vhost)
        except ValueError:
            raise ValueError(f"the broker URL's database must be a number, got {vhost!r}") from None

    def connection_params(self) -> dict[str, Any]:
        conninfo, options, sentinel = self.client, self.options, self.sentinel
        params: dict[str, Any] = {
            "host": conninfo.hostname or "127.0.0.1",
            "port": conninfo.port or self.default_port,
            "username": conninfo.userid or (sentinel.username if sentinel else None),
            "password": conninfo.password or (sentinel.password if sentinel else None),
            "db": self.db,
            "max_connections": options.max_connections,
            "socket_timeout": options.socket_timeout,
            # None: kombu's connect_timeout, so a connect sent into a partition is tried afresh
            "socket_connect_timeout": options.socket_connect_timeout or conninfo.connect_timeout,
            **socket_params(options),  # the partition detector (keepalive), or the user's own
            "health_check_interval": options.health_check_interval,
            # No retry_on_timeout: redis-py would resend a script whose reply timed out, and a
            # resent publish stores a message twice, a resent consume strands a batch in flight.
            "client_name": options.client_name,
        }
        if options.credential_provider is not None:
            params["credential_provider"] = options.credential_provider
            params.pop("username")
            params.pop("password")
        tls = conninfo.ssl or options.ssl
        secure_url = getattr(conninfo, "transport_cls", None) in SECURE_SCHEMES or (
            sentinel is not None and sentinel.tls)
        if not tls and secure_url:
            tls = {"ssl_cert_reqs": ssl_module.CERT_NONE}  # as kombu does for rediss://
        if tls:
            params["connection_class"] = redis.SSLConnection
            if isinstance(tls, dict):
                params.update(tls)
        if sentinel is not None or self.cluster is not None:  # the sentinels or the cluster say where
            del params["host"], params["port"]
            return params
        host = params["host"]
        if "://" in host:  # redislua+socket:///path/to/redis.sock
            scheme, _, path = host.partition("://")
            if scheme != "socket":
                raise ValueError(f"unsupported broker host {host!r}; use socket:///path for a Unix socket")
            for tcp_only in ("host", "port", "socket_connect_timeout", "socket_keepalive",
                             "socket_keepalive_options"):
                params.pop(tcp_only, None)
            params["connection_class"] = redis.UnixDomainSocketConnection
            params["path"] = "/" + path.lstrip("/")
        return params

    @cached_property
    def cluster_client(self) -> RedisCluster:
        """One client for the connection's channels, routing each command to the node of its
        keys (MOVED, ASK and TRYAGAIN come before anything runs). No retries after a lost
        connection: a resent publish would store its message twice."""
        cluster = self.cluster
        assert cluster is not None
        params = self.connection_params()
        for standalone_only in ("host", "port", "db", "connection_class", "path"):
            params.pop(standalone_only, None)
        secure = getattr(self.client, "transport_cls", None) in SECURE_SCHEMES
        if secure or self.client.ssl or self.options.ssl:
            params["ssl"] = True
        if cluster.username and "credential_provider" not in params:
            params["username"] = cluster.username
        if cluster.password and "credential_provider" not in params:
            params["password"] = cluster.password
        seeds = [ClusterNode(host, port) for host, port in startup_nodes(cluster)]
        client = RedisCluster(startup_nodes=seeds, retry=Retry(NoBackoff(), 0), **params)
        remember_nodes(cluster, client)
        return client

    @cached_property
    def pool(self) -> redis.ConnectionPool:
        """The connections commands share (acks come from many threads or greenlets): at most
        max_connections, a caller waits up to POOL_WAIT_SECONDS for one instead of failing
        (the blocking waits have their own, poller.py). Through Sentinel each connection asks
        for the primary when it connects, so a reconnect after a failover finds the new one."""
        if self.sentinel is not None:
            options = self.options
            assert options.master_name is not None
            return master_pool(self.sentinel, options.master_name, sentinel_kwargs=options.sentinel_kwargs,
                               min_other_sentinels=options.min_other_sentinels,
                               timeout=POOL_WAIT_SECONDS, **self.connection_params())
        return redis.BlockingConnectionPool(timeout=POOL_WAIT_SECONDS, **self.connection_params())

    def check_server(self, client: redis.Redis, *, eviction_warning: bool = True) -> None:
        """A new channel's first command: connection errors surface now, as kombu expects; an
        unknown master name or a durability the server cannot honour is a clear error; a server
        that may evict our keys is warned of (once per process and server; the CLI, which
        shows the policy in its own words, passes ``eviction_warning=False``)."""
        try:
            client.ping()
        except MasterNotFoundError as error:
            raise explain_master_not_found(self.pool, error) from None
        if self._server_checked:
            return
        if eviction_warning:
            warn_of_eviction(read_eviction(client), self.client.as_uri())
        durability = self.options.policy.durability
        replicas = durability.check_server(client) if durability is not None else 0
        self._server_checked = True  # not when check_server raised: the next channel asks again
        early = durability.early_confirmation(client) if durability is not None else None
        if durability is not None and early is not None:
            logger.warning("celery-redis-lua: " + EARLY_CONFIRMATION, durability.setting, early)
        if durability is not None and replicas < durability.replicas:
            logger.warning("celery-redis-lua: durability=%r asks for %d replica(s) but the primary "
                           "has %d connected; publishes fail (NotDurable) until enough are",
                           durability.setting, durability.replicas, replicas)

    def new_client(self) -> redis.Redis | RedisCluster:
        if self.cluster is not None:
            return self.cluster_client
        return redis.Redis(connection_pool=self.pool)

    def close_connection(self, connection: Any) -> None:
        self.poller.unregister()
        super().close_connection(connection)
        if "pool" in self.__dict__:
            self.pool.disconnect()
        if "cluster_client" in self.__dict__:
            assert self.cluster is not None
            remember_nodes(self.cluster, self.cluster_client)
            self.cluster_client.close()

    # -- which loop consumes ----------------------------------------------------------------

    def establish_connection(self) -> Any:
        """kombu's, riding out a broker reached before (Celery retries 2, 4, 6 ... s apart)."""
        return ride_out(super().establish_connection, self.client.as_uri(), self.options.reconnect_window)

    # kombu's base Transport takes **kwargs; its virtual Transport, which we extend, takes timeout.
    def drain_events(self, connection: Any, timeout: float | None = None) -> None:  # type: ignore[override]
        """Without an event loop (plain kombu, gevent, eventlet)."""
        self.poller.drain_events(timeout)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """In Celery's hub."""
        self.poller.register(loop)
