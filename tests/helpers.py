"""Small helpers shared by the tests: server time, polling, slot-aware queue names."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from redis.crc import key_slot

from celery_redis_lua import Keyspace

T = TypeVar("T")


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
