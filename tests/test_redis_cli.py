"""The scripts run as they are from redis-cli: `redis-cli --eval lua/<op>.lua KEYS , ARGV`.

redis-cli exits 0 even when the server answers with an error, so these tests
read its output. With stdout not a terminal, redis-cli prints replies raw: one
line per array item, error replies as their bare text.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from celery_redis_lua import Keyspace
from celery_redis_lua.servers import Server

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


def publish_keys() -> list[str]:
    return [KS.queue(QUEUE), KS.delayed(QUEUE), KS.index(QUEUE), KS.meta(QUEUE)]


def assert_no_error(output: str) -> None:
    assert "(error)" not in output and "ERR" not in output, output


def test_publish_then_consume_with_redis_cli(redis_cli: str, scratch_server: Server) -> None:
    published = cli_eval(redis_cli, scratch_server, "publish", publish_keys(),
                         [KS.message_prefix, "hello from redis-cli", "7", "", "", "60000"])
    assert_no_error(published)
    message_id = published.strip()
    assert len(message_id) == 16 and int(message_id, 16) == 1

    client = scratch_server.client()
    stored = client.hgetall(KS.message(QUEUE, message_id))
    assert stored[b"payload"] == b"hello from redis-cli"
    assert stored[b"priority"] == b"7"

    consumed = cli_eval(redis_cli, scratch_server, "consume",
                        [KS.queue(QUEUE), KS.delayed(QUEUE), KS.index(QUEUE)],
                        ["10", "60000", "0", KS.message_prefix])
    assert_no_error(consumed)
    # wake_in_ms (-1: nothing delayed), then queue position, id, delivery count, payload
    assert consumed.splitlines() == ["-1", "1", message_id, "0", "hello from redis-cli"]

    assert client.zcard(KS.queue(QUEUE)) == 0  # delivered: no longer ready
    assert client.zscore(KS.index(QUEUE), message_id) is not None  # in flight
    client.close()


def test_bad_priority_prints_the_error_and_writes_nothing(redis_cli: str, scratch_server: Server) -> None:
    client = scratch_server.client()
    assert client.dbsize() == 0

    output = cli_eval(redis_cli, scratch_server, "publish", publish_keys(),
                      [KS.message_prefix, "payload", "high", "", "", "60000"])

    assert "ERR celery-redis-lua: publish: priority must be an integer in 0..255, got 'high'" in output
    assert client.dbsize() == 0
    client.close()
