"""Transport options: the reference API's names and defaults, validation that names the
option, errors at connection time, polling_interval, and unknown options."""

from __future__ import annotations

import re
import socket
import ssl
import warnings
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection

import celery_redis_lua  # noqa: F401  (registers redislua://)
from celery_redis_lua import Keyspace, Policy
from celery_redis_lua.kombu.transport import Transport
from celery_redis_lua.protocol.bounds import MAX_DURATION_SECONDS, MAX_LIMIT, MAX_STREAM_LENGTH
from celery_redis_lua.protocol.options import OptionError, TransportOptions, parse_options
from scripts.servers import Server

# The reference API's options and defaults, plus the dead-letter and sweep options.
DOCUMENTED: dict[str, Any] = {
    "visibility_timeout": 300,
    "delivery_limit": 20,
    "blocking_timeout": 10,
    "queue_expires": None,
    "global_keyprefix": "",
    "stream_maxlen": 10_000,
    "message_key_prefix": "message:",
    "message_ttl": -1,
    "socket_timeout": None,
    "socket_connect_timeout": None,
    "socket_keepalive": None,
    "socket_keepalive_options": None,
    "max_connections": 10,
    "health_check_interval": 25,
    "retry_on_timeout": None,
    "client_name": None,
    "credential_provider": None,
    "ssl": None,
    "fanout_prefix": True,
    "fanout_patterns": True,
    "sep": "\x06\x16",
    "dead_letter_maxlen": 10_000,
    "sweep_interval": 60,
}

BAD: list[tuple[str, Any]] = [
    ("visibility_timeout", 0), ("visibility_timeout", -1), ("visibility_timeout", "x"),
    ("visibility_timeout", True), ("visibility_timeout", None), ("visibility_timeout", float("nan")),
    ("delivery_limit", 0), ("delivery_limit", 1.5), ("delivery_limit", "3"), ("delivery_limit", True),
    ("blocking_timeout", -1), ("blocking_timeout", "10"), ("blocking_timeout", None),
    ("queue_expires", 0), ("queue_expires", -1), ("queue_expires", "60"),
    ("global_keyprefix", 1), ("global_keyprefix", None), ("global_keyprefix", "{x}"),
    ("global_keyprefix", "a}"),
    ("stream_maxlen", 0), ("stream_maxlen", 1.5), ("stream_maxlen", "100"),
    ("message_key_prefix", ""), ("message_key_prefix", 1), ("message_key_prefix", "m{"),
    ("message_ttl", 0), ("message_ttl", -5), ("message_ttl", "x"), ("message_ttl", True),
    ("socket_timeout", 0), ("socket_timeout", "x"), ("socket_connect_timeout", -1),
    ("socket_keepalive", "yes"), ("socket_keepalive", 1), ("socket_keepalive_options", [1]),
    ("partition_timeout", 0), ("partition_timeout", 0.5), ("partition_timeout", "5"),
    ("partition_timeout", 3601), ("partition_timeout", True),
    ("reconnect_window", -1), ("reconnect_window", None), ("reconnect_window", "10"),
    ("max_connections", 0), ("max_connections", 2.5), ("max_connections", None),
    ("health_check_interval", -1), ("health_check_interval", "x"),
    ("retry_on_timeout", "no"), ("client_name", 5),
    ("ssl", "yes"), ("ssl", 1),
    ("fanout_prefix", 3), ("fanout_prefix", None), ("fanout_patterns", "yes"), ("fanout_patterns", None),
    ("group_commit", "yes"), ("group_commit", None), ("group_commit", 1),
    ("sep", ""), ("sep", 5),
    ("dead_letter_maxlen", -1), ("dead_letter_maxlen", 1.5),
    ("sweep_interval", 0), ("sweep_interval", "60"),
    # Issue 38: durations the scripts get as ms are at most 10 years.
    ("visibility_timeout", MAX_DURATION_SECONDS + 1), ("queue_expires", 1e19),
    ("message_ttl", MAX_DURATION_SECONDS + 0.5), ("binding_lifetime_floor", 10**19),
    ("delayed_retry_min", MAX_DURATION_SECONDS + 1), ("delayed_retry_max", float("inf")),
    # Counts: a delivery limit at most the limits' 1,000,000; a stream cap at most 10^9 (XADD
    # MAXLEN refuses 2^63 mid-script).
    ("delivery_limit", MAX_LIMIT + 1), ("stream_maxlen", 10**14),
    ("dead_letter_maxlen", MAX_STREAM_LENGTH + 1),
]

GOOD: list[tuple[str, Any]] = [
    ("visibility_timeout", 0.5), ("delivery_limit", None), ("delivery_limit", 1),
    ("blocking_timeout", 0), ("blocking_timeout", 2.5), ("queue_expires", 60),
    ("global_keyprefix", "app:"), ("message_ttl", 3600), ("message_ttl", 0.5),
    ("socket_timeout", 30), ("socket_keepalive", True), ("socket_keepalive_options", {1: 2}),
    ("partition_timeout", None), ("partition_timeout", 1), ("partition_timeout", 30.5),
    ("reconnect_window", 0), ("reconnect_window", 2.5),
    ("max_connections", 1), ("health_check_interval", 0), ("retry_on_timeout", False),
    ("client_name", "worker-1"), ("ssl", True), ("ssl", {"ssl_cert_reqs": ssl.CERT_REQUIRED}),
    ("fanout_prefix", False), ("fanout_prefix", "custom."), ("fanout_patterns", False),
    ("group_commit", False),
    ("sep", "|"), ("dead_letter_maxlen", 0), ("sweep_interval", 0.1),
    ("visibility_timeout", MAX_DURATION_SECONDS), ("queue_expires", MAX_DURATION_SECONDS),
    ("message_ttl", MAX_DURATION_SECONDS), ("binding_lifetime_floor", MAX_DURATION_SECONDS),
    ("delivery_limit", MAX_LIMIT), ("stream_maxlen", MAX_STREAM_LENGTH),
    ("dead_letter_maxlen", MAX_STREAM_LENGTH),
]


@pytest.fixture
def server(valkey_server: Server) -> Iterator[Server]:
    client = valkey_server.client(socket_timeout=10)
    client.flushall()
    client.close()
    yield valkey_server


def url(server: Server) -> str:
    return f"redislua://127.0.0.1:{server.port}/0"


def test_defaults_are_the_documented_ones() -> None:
    options = parse_options({})
    assert {name: getattr(options, name) for name in DOCUMENTED} == DOCUMENTED
    assert options == TransportOptions()


def test_every_documented_option_is_accepted_with_its_default() -> None:
    assert parse_options(dict(DOCUMENTED)) == parse_options({})


@pytest.mark.parametrize(("name", "value"), GOOD, ids=[f"{n}={v!r}" for n, v in GOOD])
def test_valid_values_are_kept(name: str, value: Any) -> None:
    assert getattr(parse_options({name: value}), name) == value


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_value_raises_naming_the_option(name: str, value: Any) -> None:
    with pytest.raises(OptionError) as error:
        parse_options({name: value})
    assert repr(name) in str(error.value)
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize("name", ["visibility_timeout", "queue_expires", "message_ttl",
                                  "binding_lifetime_floor", "delayed_retry_min", "delayed_retry_max"])
def test_a_duration_past_ten_years_is_refused_in_the_option_s_name_and_unit(name: str) -> None:
    with pytest.raises(OptionError) as error:
        parse_options({name: MAX_DURATION_SECONDS + 1})
    assert str(error.value).startswith(f"transport option {name!r} must be a number of seconds > 0 and "
                                       f"<= {MAX_DURATION_SECONDS}"), str(error.value)
    assert "315360001" in str(error.value)


def test_ssl_false_means_no_tls() -> None:
    assert parse_options({"ssl": False}).ssl is None


def test_derived_values_follow_the_options() -> None:
    options = parse_options({"visibility_timeout": 1.5, "message_ttl": 2, "queue_expires": 30})
    assert (options.policy.visibility_ms, options.message_ttl_ms, options.queue_expires_ms) == (
        1500, 2000, 30_000)
    assert options.policy.heartbeat_seconds == 0.5
    assert parse_options({}).policy == Policy(visibility_ms=300_000, delivery_limit=20,
                                              dead_letter_maxlen=10_000)
    assert parse_options({"delivery_limit": None, "dead_letter_maxlen": 0}).policy == Policy(
        visibility_ms=300_000, delivery_limit=None, dead_letter_maxlen=0)
    assert parse_options({"global_keyprefix": "app:", "sep": "|"}).keyspace(3) == Keyspace(
        "app:", "message:", "/3.", "|")
    assert parse_options({}).message_ttl_ms is None
    assert parse_options({}).queue_expires_ms is None


@pytest.mark.parametrize("entry", ["connect", "channel", "default_channel"])
@pytest.mark.parametrize(("name", "value"), [("visibility_timeout", 0), ("ssl", "yes"),
                                             ("global_keyprefix", "{x}"), ("max_connections", 0)])
def test_the_error_happens_at_connection_time(server: Server, entry: str, name: str, value: Any) -> None:
    connection = Connection(url(server), transport_options={name: value})  # nothing checked yet
    try:
        with pytest.raises(OptionError, match=repr(name)):
            thing = getattr(connection, entry)
            if callable(thing):
                thing()
    finally:
        connection.release()


def test_options_reach_the_redis_connections(server: Server) -> None:
    options = {"client_name": "crl-options-test", "socket_timeout": 30, "max_connections": 7,
               "health_check_interval": 5}
    with Connection(url(server), transport_options=options) as connection:
        channel = connection.channel()
        pool = channel.client.connection_pool
        assert pool.max_connections == 7
        assert pool.connection_kwargs["socket_timeout"] == 30
        assert pool.connection_kwargs["health_check_interval"] == 5
        names = [c["name"] for c in server.client().client_list()]
        assert "crl-options-test" in names
        channel.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="no TCP_USER_TIMEOUT on this platform")
@pytest.mark.parametrize(("options", "user_timeout_ms", "idle"), [
    ({}, 5000, 2),  # the default: partition_timeout 5 s
    ({"partition_timeout": 12}, 12000, 6),
    ({"partition_timeout": None}, 0, None),  # off: the socket's defaults
    ({"socket_keepalive": False}, 0, None),  # the user's own keepalive setting wins
    ({"socket_keepalive": True, "socket_keepalive_options": {socket.TCP_KEEPIDLE: 30}}, 0, 30),
])
def test_the_partition_detector_is_set_on_every_socket(server: Server, options: dict[str, Any],
                                                       user_timeout_ms: int, idle: int | None) -> None:
    """protocol/liveness.py: keepalive with TCP_USER_TIMEOUT on the connections a channel
    uses, read back off the sockets themselves; and kombu's connect_timeout reaches redis-py."""
    with Connection(url(server), transport_options=options, connect_timeout=3) as connection:
        channel = connection.channel()
        pool = channel.client.connection_pool
        assert pool.connection_kwargs["socket_connect_timeout"] == 3
        held = pool.get_connection()
        try:
            sock = held._sock
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == user_timeout_ms
            assert bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)) == (idle is not None)
            if idle is not None:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
        finally:
            pool.release(held)
        channel.close()


def test_polling_interval_is_read_as_blocking_timeout_with_a_warning(server: Server) -> None:
    with pytest.warns(DeprecationWarning, match="polling_interval"):
        assert parse_options({"polling_interval": 2}).blocking_timeout == 2
    with pytest.warns(DeprecationWarning):
        both = parse_options({"polling_interval": 2, "blocking_timeout": 4})
    assert both.blocking_timeout == 4
    with pytest.warns(DeprecationWarning), Connection(
            url(server), transport_options={"polling_interval": 3}) as connection:
        transport = connection.transport
        assert transport.options.blocking_timeout == 3
        assert transport.polling_interval is None  # never a sleep between polls


def test_a_bad_polling_interval_names_polling_interval() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(OptionError, match="polling_interval"):
            parse_options({"polling_interval": "soon"})


def test_no_sleep_between_polls() -> None:
    assert Transport.polling_interval is None
    assert parse_options({}) == parse_options({"blocking_timeout": 10})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no polling_interval given: no warning either
        parse_options({"blocking_timeout": 1})


def test_unknown_options_are_ignored(server: Server) -> None:
    unknown = {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "no_such_option": object()}
    with pytest.warns(RuntimeWarning, match="'no_such_option'"):
        assert parse_options(unknown) == TransportOptions()
    with pytest.warns(RuntimeWarning, match="'no_such_option'"), \
            Connection(url(server), transport_options=unknown) as connection:
        simple = connection.SimpleQueue("opts")
        simple.put("ok")
        message = simple.get(timeout=5)
        message.ack()
        assert message.payload == "ok"
        simple.close()


def test_the_docs_document_every_option() -> None:
    """Every field of TransportOptions appears, as `name`, in docs/configuration.md's Options
    section (its table is generated from them: tests/test_options_doc.py)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    section = page[page.index("## Options"):page.index("## Queue arguments")]
    documented = set(re.findall(r"`([a-z_]+)`", section))
    assert [f.name for f in fields(TransportOptions) if f.name not in documented] == []


@pytest.mark.parametrize(("name", "said"), [
    ("visiblity_timeout", "did you mean 'visibility_timeout'?"),
    ("blocking_timout", "did you mean 'blocking_timeout'?"),
    ("priority_steps",
     "it is an option of kombu's stock Redis transport (priorities 0-255 are each their own band)"),
    ("frobnicate", "no option of that name exists"),
])
def test_an_unknown_option_is_ignored_with_a_warning_that_names_the_closest(name: str, said: str) -> None:
    with pytest.warns(RuntimeWarning, match=re.escape(f"ignores transport option {name!r}: {said}")):
        options = parse_options({name: 1})
    assert options == parse_options({})


def test_kombu_s_and_celery_s_own_keys_pass_in_silence() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_options({"max_retries": 3, "interval_start": 0, "interval_step": 1, "interval_max": 2,
                       "result_chord_ordered": True, "visibility_timeout": 60})


def test_a_retry_policy_kombu_copies_into_the_options_passes_in_silence(server: Server) -> None:
    """kombu's ``Producer.publish(retry=True, retry_policy=...)`` copies the policy into
    ``transport_options`` (kombu/messaging.py), errback and all: every transport made from the
    connection afterwards (a reconnect, a clone) must not warn about options the user never set."""
    policy = {"max_retries": 3, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.2,
              "errback": lambda exc, interval: None}
    with Connection(url(server)) as connection:
        connection.Producer().publish({"n": 1}, routing_key="opts-retry", retry=True, retry_policy=policy)
        assert "errback" in connection.transport_options  # what kombu did
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with connection.clone() as again:
                again.connect()
