"""Transport options: names, defaults and validation (the reference API's, plus dead letters).

Plain configuration, no kombu: the Keyspace and Policy the scripts are called with
(protocol/), and the connection settings, beside cluster.py and sentinel.py.

Every option is checked when the transport is created; a wrong type or value raises
:class:`OptionError` naming it. An unknown one is ignored with a warning that names the
closest known one (or says it is kombu's stock Redis option); kombu's and Celery's own keys
(``max_retries``, ...), which pass through the same dictionary, are left alone in silence.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .bounds import MAX_DURATION_SECONDS, MAX_LIMIT, MAX_STREAM_LENGTH
from .durability import Durability
from .keys import (
    DEFAULT_MESSAGE_KEY_PREFIX,
    DEFAULT_SEPARATOR,
    Keyspace,
    KeyspaceError,
    fanout_prefix_for,
)
from .policy import Policy
from .retry import TYPES as RETRY_TYPES
from .retry import DelayedRetry


class OptionError(ValueError):
    """A transport option has a wrong type or value."""


def option(default: Any, doc: str) -> Any:
    """A field of :class:`TransportOptions`: its default and what it means, in Markdown. The
    options table of docs/configuration.md is generated from these (``make docs``,
    scripts/optionsdoc.py), so the page cannot drift from the code."""
    return field(default=default, metadata={"doc": doc})


_REDIS_PY = "passed to redis-py as with kombu's Redis transport"
_SENTINEL = "with `sentinel://` URLs, as kombu's stock Sentinel transport takes them"


@dataclass(frozen=True)
class TransportOptions:
    """Set in ``broker_transport_options``; each field's ``doc`` metadata says what it means."""

    visibility_timeout: float = option(
        300, "seconds an unacked message may stay with a consumer before it is redelivered "
        "(pushed forward every third of it while the consumer lives); at most 315,360,000 (10 years), "
        "as every duration")
    delivery_limit: int | None = option(
        20, "delivery attempts before a message is dead-lettered (at most 1,000,000); `None`: no limit")
    blocking_timeout: float = option(
        10, "seconds the server holds a BLPOP (on the queues' wake lists) or XREAD open per poll "
        "(a message is delivered the instant it arrives; the block is also cut short at the next ETA)")
    queue_expires: float | None = option(
        None, "seconds; default `x-expires` for queues declared without one; also a TTL on binding "
        "tables and fanout streams")
    global_keyprefix: str = option("", "prefix of every key")
    stream_maxlen: int = option(10_000, "approximate cap of each fanout stream (at most 10^9)")
    message_key_prefix: str = option(
        DEFAULT_MESSAGE_KEY_PREFIX, "names the hash of a queue's payloads, `P message:{Q}`")
    message_ttl: float = option(
        -1, "seconds a message may wait in its queue (-1: forever); counted while it waits, from its "
        "ETA when delayed; an expired message is dead-lettered with reason `expired`")
    socket_timeout: float | None = option(None, _REDIS_PY)
    socket_connect_timeout: float | None = option(
        None, "passed to redis-py; `None`: kombu's `connect_timeout` (Celery's `broker_connection_timeout`)")
    socket_keepalive: bool | None = option(None, _REDIS_PY)
    socket_keepalive_options: dict[int, int | bytes] | None = option(None, _REDIS_PY)
    partition_timeout: float | None = option(
        5, "seconds after which a connection whose peer's host acknowledged nothing (a partition, a dead "
        "host) is closed and kombu reconnects; a busy or stopped server is still waited for (TCP keepalive, "
        "`TCP_USER_TIMEOUT`, Linux; [Networks that partition](deployment.md#networks-that-partition)); "
        "`None`: off, or set `socket_keepalive*` yourself")
    reconnect_window: float = option(
        10, "seconds a connect to a broker this process reached before (on a cluster, also a publish to "
        "a slot with no primary yet) is tried again, every 0.25 s, before kombu's retries see it; 0: at once")
    max_connections: int = option(
        10, "connections commands share per connection object; a command waits (up to 20 s) for a "
        "free one. Outside it, per channel: the blocking waits (2), one held for the channel's single "
        "script calls (standalone and Sentinel), and with `confirm_publish=False` one for its "
        "publish batches")
    health_check_interval: float = option(25, _REDIS_PY)
    retry_on_timeout: bool | None = option(
        None, "accepted and ignored, with a warning: a script whose reply timed out is never sent "
        "again (a second publish would store the message twice); kombu reconnects and retries the "
        "operation as a whole")
    client_name: str | None = option(None, _REDIS_PY)
    credential_provider: Any = option(None, _REDIS_PY)
    ssl: bool | dict[str, Any] | None = option(None, _REDIS_PY)
    fanout_prefix: bool | str = option(
        True, "fanout stream keys are `/<db>.<exchange>` (a string replaces `/<db>.`, False removes it)")
    fanout_patterns: bool = option(
        True, "a fanout binding whose key is a pattern (`*`, `#`) receives only matching routing keys; "
        "other fanout bindings receive everything, as in AMQP")
    sep: str = option(DEFAULT_SEPARATOR, "separator inside binding members")
    dead_letter_maxlen: int = option(
        10_000, "approximate cap of each queue's dead-letter stream (at most 10^9); 0 deletes dropped "
        "messages outright")
    sweep_interval: float = option(
        60, "seconds between sweeps (timed-out deliveries back, due ETAs in, orphans out)")
    consume_batch: int = option(100, "most messages one consume call delivers (1..10000)")
    # Bindings of a queue with x-expires go stale max(x-expires, this) s after their last refresh.
    binding_lifetime_floor: float = option(
        300, "seconds; a binding of a queue with `x-expires` goes stale `max(x-expires, this)` after "
        "its last refresh (a consumer refreshes it three times per `x-expires`); lower it only to see "
        "stale routes go sooner")
    master_name: str | None = option(None, _SENTINEL)
    sentinel_kwargs: dict[str, Any] | None = option(None, _SENTINEL)
    min_other_sentinels: int = option(0, _SENTINEL)
    # Opt-in durable writes: 'replicas:N', 'aof' or 'aof+replicas:N' (protocol/durability.py);
    # a publish not confirmed within durability_timeout seconds raises NotDurable.
    durability: str | None = option(
        None, "`\"replicas:N\"`, `\"aof\"` or `\"aof+replicas:N\"`: publishes, acks and rejects wait "
        "for N replicas (`WAIT`) or the AOF on disk (`WAITAOF`); see "
        "[Durable writes](deployment.md#durable-writes-opt-in)")
    durability_timeout: float = option(
        1.0, "seconds a write waits for `durability` before a publish raises `NotDurable`")
    # A primary fenced by min-replicas-to-write refuses writes (NOREPLICAS, protocol/fence.py):
    # a publish, declare or bind tries again, backing off, for this long before it raises.
    fence_timeout: float = option(
        10.0, "seconds a publish, declare or bind waits, trying again, while a primary fenced by "
        "`min-replicas-to-write` refuses writes (`NOREPLICAS`) before it raises (a connection "
        "error: kombu's retry policy may go on); 0: at once; see "
        "[A fenced primary](deployment.md#a-fenced-primary-min-replicas-to-write)")
    # Acks are batched (protocol/outbox.py): one waits at most this long (seconds) for the next
    # consume to carry it, or for others to share its round trip; 0: at the keeper's next run.
    # 5 ms: a prefork refill comes within it, and it is all a killed worker can replay.
    ack_flush_delay: float = option(
        0.005, "seconds an ack may wait for the consumer's next consume to carry it, or for others "
        "to share its own round trip (0..1); acks are always sent in batches, one ack call per queue, "
        "with the consumer's next consume or from the keeper's thread")
    # False pipelines publishes (protocol/unconfirmed.py): publish_pipeline per write at most,
    # none waiting longer than publish_flush_delay seconds.
    confirm_publish: bool = option(
        True, "False: publishes are pipelined, returning before the broker has them (see "
        "\"Unconfirmed publishes\" in [What is promised](promises.md)); kombu's py-amqp transport "
        "has the same name for the opposite default")
    # True: confirmed publishes in flight at once from one process to one server ride one
    # script call per queue (protocol/group.py); a lone producer waits for nothing more.
    group_commit: bool = option(
        True, "with `confirm_publish` (the default): the confirmed publishes a process's threads or "
        "greenlets have in flight at once to one server go in one script call per queue, each "
        "caller still answered on its own (see [Performance](performance.md#group-commit)); "
        "False: one call per publish")
    publish_pipeline: int = option(
        100, "with `confirm_publish=False`: at most this many publishes go in one write; in a "
        "`confirm_together()` block, this many gathered publishes go at once (1..10,000)")
    publish_flush_delay: float = option(
        0.005, "with `confirm_publish=False`: seconds the oldest pending publish may wait before a "
        "thread sends the pipeline (0..1)")
    # Redis Cluster / Valkey Cluster (cluster.py): with the class route and a plain URL, or
    # implied by redislua+cluster:// URLs; more seed nodes as 'host:port' strings.
    cluster: bool = option(
        False, "a Redis Cluster or Valkey Cluster with a plain URL and the class route "
        "(`redislua+cluster://` URLs imply it)")
    cluster_nodes: tuple[str, ...] = option((), "more seed nodes of a cluster, `\"host:port\"` strings")
    # Delayed retry for queues declared without x-delayed-retry-* (protocol/retry.py):
    # 'disabled', 'all', 'failed' or 'returned'; the first delay and the cap in seconds.
    delayed_retry_type: str = option(
        "disabled", "redelivery backoff for queues declared without `x-delayed-retry-*` arguments: "
        "`\"all\"`, `\"failed\"` or `\"returned\"`; see "
        "[Redelivery backoff](operations.md#redelivery-backoff-delayed-retry)")
    delayed_retry_min: float | None = option(
        None, "the first delay of that redelivery backoff, in seconds")
    delayed_retry_max: float | None = option(None, "the cap of that redelivery backoff, in seconds")

    @property
    def policy(self) -> Policy:
        """What the scripts are called with (held by each channel's script library)."""
        return Policy(visibility_ms=int(self.visibility_timeout * 1000), delivery_limit=self.delivery_limit,
                      dead_letter_maxlen=self.dead_letter_maxlen, durability=self.durability_setting)

    @property
    def durability_setting(self) -> Durability | None:
        if self.durability is None:
            return None
        return Durability.parse(self.durability, int(self.durability_timeout * 1000))

    def keyspace(self, db: int) -> Keyspace:
        """Key names for this connection; a fanout stream is ``P/<db>.<exchange>`` unless
        fanout_prefix says otherwise (a string replaces ``/<db>.``, False removes it)."""
        return Keyspace(self.global_keyprefix, self.message_key_prefix,
                        fanout_prefix_for(self.fanout_prefix, db), self.sep)

    @property
    def delayed_retry(self) -> DelayedRetry | None:
        """The default a queue without its own x-delayed-retry-* is declared with (None:
        disabled, so a queue declared with arguments elsewhere keeps them)."""
        if self.delayed_retry_type == "disabled":
            return None
        def ms(seconds: float | None) -> int | None:
            return None if seconds is None else max(1, round(seconds * 1000))
        return DelayedRetry(self.delayed_retry_type, ms(self.delayed_retry_min), ms(self.delayed_retry_max))

    @property
    def message_ttl_ms(self) -> int | None:
        return None if self.message_ttl == -1 else int(self.message_ttl * 1000)

    @property
    def queue_expires_ms(self) -> int | None:
        return None if self.queue_expires is None else int(self.queue_expires * 1000)

    @property
    def binding_lifetime_floor_ms(self) -> int:
        return int(self.binding_lifetime_floor * 1000)


def _number(low: float, *, allow_none: bool = False, integer: bool = False,
            inclusive: bool = True, extra: tuple[Any, ...] = (),
            high: float | None = None, unit: str = "") -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if value is None and allow_none:
            return None
        if value in extra and not isinstance(value, bool):
            return value
        kind = int if integer else (int, float)
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if ok:
            ok = (value >= low if inclusive else value > low) and (high is None or value <= high)
        if not ok:
            what = ("an integer" if integer else "a number") + (f" of {unit}" if unit else "")
            bound = f"{'>=' if inclusive else '>'} {low}" + ("" if high is None else f" and <= {high}")
            also = "".join(f" or {e!r}" for e in extra) + (" or None" if allow_none else "")
            raise OptionError(f"transport option {name!r} must be {what} {bound}{also}, got {value!r}")
        return value
    return check


def _duration(*, allow_none: bool = False, extra: tuple[Any, ...] = ()) -> Callable[[str, Any], Any]:
    """Seconds the scripts get as ms: positive, and at most the longest duration they take
    (protocol/bounds.py), so the option's own name and unit are in the error, not the ms
    argument the scripts would have refused."""
    return _number(0, inclusive=False, allow_none=allow_none, extra=extra, high=MAX_DURATION_SECONDS,
                   unit="seconds")


def _typed(*types: type, allow_none: bool = True) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if value is None and allow_none:
            return None
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            names = " or ".join(t.__name__ for t in types) + (" or None" if allow_none else "")
            raise OptionError(f"transport option {name!r} must be {names}, got {value!r}")
        return value
    return check


def _non_empty_str(name: str, value: Any) -> Any:
    if not isinstance(value, str) or not value:
        raise OptionError(f"transport option {name!r} must be a non-empty string, got {value!r}")
    return value


def _node_list(name: str, value: Any) -> Any:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not all(
            isinstance(node, str) and node for node in value):
        raise OptionError(f"transport option {name!r} must be a list of 'host:port' strings, got {value!r}")
    return tuple(value)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "visibility_timeout": _duration(),
    "delivery_limit": _number(1, integer=True, allow_none=True, high=MAX_LIMIT),
    "blocking_timeout": _number(0),
    "queue_expires": _duration(allow_none=True),
    "global_keyprefix": _typed(str, allow_none=False),
    "stream_maxlen": _number(1, integer=True, high=MAX_STREAM_LENGTH),
    "message_key_prefix": _non_empty_str,
    "message_ttl": _duration(extra=(-1,)),
    "socket_timeout": _number(0, inclusive=False, allow_none=True),
    "socket_connect_timeout": _number(0, inclusive=False, allow_none=True),
    "socket_keepalive": _typed(bool),
    "socket_keepalive_options": _typed(dict),
    "partition_timeout": _number(1, high=3600, allow_none=True),
    "reconnect_window": _number(0, high=3600),
    "max_connections": _number(1, integer=True),
    "health_check_interval": _number(0),
    "retry_on_timeout": _typed(bool),
    "client_name": _typed(str),
    "credential_provider": lambda name, value: value,
    "ssl": _typed(bool, dict),
    "fanout_prefix": _typed(bool, str, allow_none=False),
    "fanout_patterns": _typed(bool, allow_none=False),
    "sep": _non_empty_str,
    "dead_letter_maxlen": _number(0, integer=True, high=MAX_STREAM_LENGTH),
    "sweep_interval": _number(0, inclusive=False),
    "consume_batch": _number(1, integer=True, high=10_000),  # the scripts' own cap
    "binding_lifetime_floor": _duration(),
    "master_name": _non_empty_str,
    "sentinel_kwargs": _typed(dict),
    "min_other_sentinels": _number(0, integer=True),
    "durability": _typed(str),
    "durability_timeout": _number(0.001, high=3600),
    "fence_timeout": _number(0, high=3600),
    "ack_flush_delay": _number(0, high=1),  # longer would stretch what a crash can replay
    "confirm_publish": _typed(bool, allow_none=False),
    "group_commit": _typed(bool, allow_none=False),
    "publish_pipeline": _number(1, integer=True, high=10_000),
    "publish_flush_delay": _number(0, high=1),  # longer would stretch what a crash can lose
    "cluster": _typed(bool, allow_none=False),
    "cluster_nodes": _node_list,
    "delayed_retry_type": _typed(str, allow_none=False),
    "delayed_retry_min": _duration(allow_none=True),
    "delayed_retry_max": _duration(allow_none=True),
}


# Keys kombu and Celery read from the same dictionary themselves (kombu's reconnect policy,
# its virtual channel, Celery's result backend on this broker): passed through in silence.
PASSED_THROUGH = frozenset({
    "max_retries", "interval_start", "interval_step", "interval_max", "connect_retries_timeout",
    "body_encoding", "deadletter_queue", "result_chord_ordered", "polling_interval",
    # the rest of kombu's retry policy: Producer.publish(retry=True) copies it in here
    "errback", "on_revive", "retry_errors",
})
# kombu's stock Redis transport's own options: they mean nothing here, for the reason given.
STOCK_ONLY = {
    "priority_steps": "priorities 0-255 are each their own band",
    "queue_order_strategy": "consume takes the highest priority first across its queues",
    "ack_emulation": "acks are always real",
    "unacked_key": "in-flight messages are indexed per queue",
    "unacked_index_key": "in-flight messages are indexed per queue",
    "unacked_mutex_key": "the sweep is a script, atomic without a mutex",
    "unacked_mutex_expire": "the sweep is a script, atomic without a mutex",
    "unacked_restore_limit": "the sweep restores a bounded batch per call",
    "unacked_restore_interval": "see 'sweep_interval'",
    "unacked_restore_throttle": "see 'sweep_interval'",
}


def warn_unknown(raw: Mapping[str, Any], known: set[str]) -> None:
    """A misspelt option would be ignored in silence: warn, naming the closest known one."""
    for name in raw:
        if name in known or name in PASSED_THROUGH:
            continue
        if name in STOCK_ONLY:
            why = f"it is an option of kombu's stock Redis transport ({STOCK_ONLY[name]})"
        else:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            why = f"did you mean {close[0]!r}?" if close else "no option of that name exists"
        warnings.warn(f"celery-redis-lua ignores transport option {name!r}: {why}", RuntimeWarning,
                      stacklevel=4)


def _check_delayed_retry(options: TransportOptions) -> None:
    """DelayedRetry's rules in the options' terms (their names, in seconds), not in the queue
    arguments' (x-delayed-retry-min, in ms) that DelayedRetry would name."""
    kind, low, high = options.delayed_retry_type, options.delayed_retry_min, options.delayed_retry_max
    if kind not in RETRY_TYPES:
        raise OptionError(f"transport option 'delayed_retry_type' must be one of {', '.join(RETRY_TYPES)}, "
                          f"got {kind!r}")
    if kind != "disabled" and low is None:
        raise OptionError(f"transport option 'delayed_retry_type' {kind!r} needs 'delayed_retry_min' "
                          "(the first delay, in seconds)")
    if low is not None and high is not None and high < low:
        raise OptionError(f"transport option 'delayed_retry_max' ({high} seconds) is below "
                          f"'delayed_retry_min' ({low} seconds)")


def parse_options(raw: Mapping[str, Any] | None) -> TransportOptions:
    """Validate the options this transport knows; ``polling_interval`` is read as
    ``blocking_timeout`` with a deprecation warning (there is no sleep between polls)."""
    raw = dict(raw or {})
    if "polling_interval" in raw:
        warnings.warn(
            "transport option 'polling_interval' is deprecated for celery-redis-lua: it is read as "
            "'blocking_timeout' (how long the server holds a blocking poll open); "
            "there is no sleep between polls", DeprecationWarning, stacklevel=3)
        _CHECKS["blocking_timeout"]("polling_interval", raw["polling_interval"])
        raw.setdefault("blocking_timeout", raw["polling_interval"])
    known = {f.name for f in fields(TransportOptions)}
    warn_unknown(raw, known)
    values = {name: _CHECKS[name](name, raw[name]) for name in known if name in raw}
    if values.get("retry_on_timeout"):
        warnings.warn(
            "transport option 'retry_on_timeout' is ignored by celery-redis-lua: a script whose "
            "reply timed out is never sent again (a second publish would store the message twice); "
            "kombu reconnects and retries the operation as a whole", RuntimeWarning, stacklevel=3)
    if "ssl" in values and values["ssl"] is False:
        values["ssl"] = None
    options = TransportOptions(**values)
    try:
        options.durability_setting  # noqa: B018  (its rules, reported as this option's error)
    except ValueError as error:
        raise OptionError(f"transport option 'durability': {error}") from None
    _check_delayed_retry(options)
    try:
        options.keyspace(0)  # the keyspace's rules, reported as this option's error
    except KeyspaceError as error:
        name, _, rest = str(error).partition(" ")
        raise OptionError(f"transport option {name!r} {rest}") from None
    return options
