"""Small helpers shared by the tests: server time, polling, slot-aware queue names, the
transport's wake pipe in a kombu hub, and a bash session for replaying documented shell
sessions."""

from __future__ import annotations

import itertools
import os
import re
import select
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from redis.crc import key_slot

from celery_redis_lua import Keyspace

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]


def server_now_ms(client: Any) -> int:
    """The server's clock in unix ms (the only clock the scripts use)."""
    seconds, micros = client.time() if not hasattr(client, "get_primaries") else client.time(
        target_nodes=client.get_random_node())
    return int(seconds) * 1000 + int(micros) // 1000


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s (last value {value!r})")
        time.sleep(interval)


def wait_for_server_time(client: Any, at_ms: int) -> None:
    """Poll the server's clock until it reaches ``at_ms``."""
    wait_until(lambda: server_now_ms(client) >= at_ms, timeout=30, interval=0.005)


def same_slot_names(count: int, keys: Keyspace, stem: str = "q") -> list[str]:
    """``count`` queue names whose keys share one cluster slot (for multi-queue calls)."""
    by_slot: dict[int, list[str]] = {}
    for i in itertools.count():
        name = f"{stem}{i}"
        names = by_slot.setdefault(key_slot(keys.queue(name).encode()), [])
        names.append(name)
        if len(names) == count:
            return names
    raise AssertionError("unreachable")


def names_on_each_node(client: Any, keys: Keyspace, stem: str = "node") -> list[str]:
    """One queue name per cluster primary, so a test touches every node."""
    primaries = client.get_primaries()
    found: dict[str, str] = {}
    for i in itertools.count():
        name = f"{stem}{i}"
        node = client.get_node_from_key(keys.queue(name))
        found.setdefault(node.name, name)
        if len(found) == len(primaries):
            return list(found.values())
    raise AssertionError("unreachable")


def message_state(client: Any, keys: Keyspace, queue: str,
                  message_id: str) -> tuple[str, int, int, str] | None:
    """(state, delivery_count, priority, expires_at) of one message, from ``state:{Q}`` (whose
    line ends with the Celery task id, when the message has one)."""
    raw = client.hget(keys.state(queue), message_id)
    if raw is None:
        return None
    state, count, priority, expires_at = raw.decode().split(" ", 4)[:4]
    return state, int(count), int(priority), expires_at


def message_exists(client: Any, keys: Keyspace, queue: str, message_id: str) -> bool:
    """Whether the queue still holds the message's payload or state."""
    return bool(client.hexists(keys.message(queue), message_id)
                or client.hexists(keys.state(queue), message_id))


# A message id as publish returns it: 13 hex digits of the server's unix microseconds, then
# 1 of a counter within that microsecond.
MESSAGE_ID = r"[0-9a-f]{14}"


def is_message_id(value: str) -> bool:
    return re.fullmatch(MESSAGE_ID, value) is not None


def id_microseconds(message_id: str) -> int:
    """The server's unix microseconds at publish, read off a message id."""
    return int(message_id[:13], 16)


# In documented expected output: an integer (a time, a score, a count of ms), a message
# id and a stream entry id.
PLACEHOLDERS = {"<ms>": r"\d+", "<id>": MESSAGE_ID, "<stream-id>": r"\d+-\d+"}


def matches(expected: str, actual: str) -> bool:
    """Whether an output line is the documented one, placeholders standing for their kind."""
    pattern = "".join(PLACEHOLDERS.get(part, re.escape(part))
                      for part in re.split(r"(<ms>|<id>|<stream-id>)", expected))
    return re.fullmatch(pattern, actual) is not None


class Shell:
    """One bash for a whole documented session, run from the repository root, so shell
    variables carry from command to command; ``redis-cli`` is the one on PATH pointed at
    ``port``."""

    def __init__(self, port: int) -> None:
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "LC_ALL": "C"})
        self.run(f'redis-cli() {{ command redis-cli -p {port} "$@"; }}')

    def run(self, command: str, timeout: float = 30) -> tuple[list[str], int]:
        """Run one command line; return its output lines (stdout and stderr) and status."""
        assert self.process.stdin is not None and self.process.stdout is not None
        marker = f"@@{uuid.uuid4().hex}@@"
        self.process.stdin.write(f"{{ {command}\n}} </dev/null\nprintf '\\n{marker} %d\\n' $?\n".encode())
        self.process.stdin.flush()
        output, deadline = b"", time.monotonic() + timeout
        end = re.compile(rb"\n" + marker.encode() + rb" (\d+)\n$")
        while not (found := end.search(output)):
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.process.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                raise AssertionError(f"no end of output of {command!r} (so far: {output!r})")
            output += chunk
        text = output[:found.start()].decode()
        return (text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")) if text else [], \
            int(found[1])

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(10)

    def __enter__(self) -> Shell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ScriptCalls:
    """Counts, with MONITOR, the script calls clients send to one server, by script name
    (the commands scripts run inside are not counted). ``stop()`` returns the counts."""

    def __init__(self, client: Any) -> None:
        from celery_redis_lua.protocol.contract import load_scripts

        self.counts: dict[str, int] = {}
        self._by_sha = {script.sha1: name for name, script in load_scripts().items()}
        self._client = client
        self._monitor = client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        for command in self._monitor.listen():
            if command["command"] == "ECHO end-of-count":
                return
            words = command["command"].split()
            if command["client_type"] != "lua" and words[0] == "EVALSHA":
                name = self._by_sha.get(words[1], words[1])
                self.counts[name] = self.counts.get(name, 0) + 1

    def stop(self) -> dict[str, int]:
        self._client.echo("end-of-count")
        self._thread.join(10)
        assert not self._thread.is_alive()
        self._monitor.__exit__(None, None, None)
        return self.counts


class Placement:
    """Which primaries a suite's tests left keys on, by suite and cluster kind. The suite's
    queues must use every primary; that is checked once every cluster test of the suite that
    was collected has run (a ``-k`` subset is not held to it)."""

    def __init__(self) -> None:
        self.expected: dict[tuple[str, str], int] = {}
        self.ran: dict[tuple[str, str], int] = {}
        self.ports: dict[tuple[str, str], set[int]] = {}

    def expect(self, suite: str, kind: str) -> None:
        self.expected[suite, kind] = self.expected.get((suite, kind), 0) + 1

    def record(self, suite: str, kind: str, cluster: Any) -> None:
        """After a test: the primaries of ``cluster`` holding any key now."""
        self.ran[suite, kind] = self.ran.get((suite, kind), 0) + 1
        self.ports.setdefault((suite, kind), set()).update(
            node.port for node in cluster.primaries() if node.client(socket_timeout=5).dbsize())

    def unmet(self, suite: str) -> list[str]:
        return [f"the {suite} suite's queues on {kind} used only the primaries {sorted(ports)}"
                for (name, kind), ports in self.ports.items()
                if name == suite and len(ports) < 3
                and self.ran[name, kind] == self.expected.get((name, kind))]


PLACEMENT = Placement()


def hub_wake_fd(hub: Any) -> int:
    """The read end of the pipe the transport writes to make a kombu hub's poll return."""
    [fd] = [fd for fd, (callback, _) in hub.readers.items() if callback.__name__ == "on_wake"]
    return fd


def hub_readable(hub: Any) -> set[int]:
    """The descriptors a kombu hub's poll would report readable now."""
    return {fd for fd, _ in hub.poller.poll(0) or ()}
