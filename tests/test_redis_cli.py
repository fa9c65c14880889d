"""The scripts run as they are from redis-cli: `redis-cli --eval lua/<op>.lua KEYS , ARGV`.

redis-cli exits 0 even when the server answers with an error, so these tests
read its output. With stdout not a terminal, redis-cli prints replies raw: one
line per array item, error replies as their bare text.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from celery_redis_lua import Keyspace
from helpers import id_microseconds, is_message_id, server_now_ms
from scripts.servers import Server

ROOT = Path(__file__).resolve().parents[1]
KS = Keyspace("cli:")
QUEUE = "cli-q"


def cli_eval(redis_cli: str, server: Server, script: str, keys: list[str], args: list[str]) -> str:
    """Run one script through redis-cli from the checkout, as a user would; return stdout."""
    result = subprocess.run(
        [redis_cli, "-h", "127.0.0.1", "-p", str(server.port), "--eval", f"lua/{script}.lua",
         *keys, ",", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def queue_keys() -> list[str]:
    """The eight keys every queue script takes, in order."""
    return list(KS.queue_keys(QUEUE))


def assert_no_error(output: str) -> None:
    assert "(error)" not in output and "ERR" not in output, output


def test_publish_then_consume_with_redis_cli(redis_cli: str, scratch_server: Server) -> None:
    client = scratch_server.client()
    before = server_now_ms(client)
    published = cli_eval(redis_cli, scratch_server, "publish", queue_keys(),
                         ["hello from redis-cli", "7", "", "", "60000"])
    assert_no_error(published)
    message_id = published.strip()
    # 13 hex digits of the server's unix microseconds, then 1 of a counter (0: the queue's first id)
    assert is_message_id(message_id), message_id
    assert before * 1000 <= id_microseconds(message_id) <= (server_now_ms(client) + 1) * 1000
    assert message_id[13:] == "0"

    assert client.hget(KS.message(QUEUE), message_id) == b"hello from redis-cli"
    assert client.hget(KS.state(QUEUE), message_id) == b"ready 0 7 -"

    consumed = cli_eval(redis_cli, scratch_server, "consume", queue_keys(), ["10", "60000", "0", "10000"])
    assert_no_error(consumed)
    # wake_in_ms (-1: nothing delayed), expired, then queue position, id, delivery count, payload
    assert consumed.splitlines() == ["-1", "0", "1", message_id, "0", "hello from redis-cli"]

    assert client.zcard(KS.queue(QUEUE)) == 0  # delivered: no longer ready
    assert client.zscore(KS.index(QUEUE), message_id) is not None  # in flight
    assert client.hget(KS.state(QUEUE), message_id) == b"unacked 0 7 -"

    acked = cli_eval(redis_cli, scratch_server, "ack", queue_keys(), [message_id])
    assert acked.splitlines() == ["1"]
    assert client.keys() == [KS.meta(QUEUE).encode()]  # every trace gone; the queue stays declared
    client.close()


def test_bad_priority_prints_the_error_and_writes_nothing(redis_cli: str, scratch_server: Server) -> None:
    client = scratch_server.client()
    assert client.dbsize() == 0

    output = cli_eval(redis_cli, scratch_server, "publish", queue_keys(),
                      ["payload", "high", "", "", "60000"])

    assert "ERR celery-redis-lua: publish: priority must be an integer in 0..255, got 'high'" in output
    assert client.dbsize() == 0
    client.close()


def test_a_call_with_the_old_four_keys_is_refused_by_name(redis_cli: str, scratch_server: Server) -> None:
    """A producer written against the old contract (4 keys, message key prefix) gets a clear error."""
    client = scratch_server.client()
    output = cli_eval(redis_cli, scratch_server, "publish", queue_keys()[:4],
                      ["cli:message:", "payload", "0", "", "", "60000"])

    assert ("ERR celery-redis-lua: publish: expected 8 keys (queue, delayed, index, meta, dead, "
            "message, state, wake), got 4") in output
    assert client.dbsize() == 0
    client.close()
