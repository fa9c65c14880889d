"""Fresh clusters, each started one test ahead (CI's budget).

A new cluster spends about 2 s waiting, not working: a primary that has just started keeps
the cluster's state `fail` for 2 s (Redis's and Valkey's CLUSTER_WRITABLE_DELAY). A test
that needs a cluster nobody else used (a Celery run, a failover) takes one started in the
background while an earlier test ran, and another like it is started for the next one.

The spares are started by threads that live as long as the test session (an executor's
threads wait for work until it shuts down): a server process dies with the thread that
started it (``PR_SET_PDEATHSIG`` in scripts/servers.py), so that must not be one that ends.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from scripts.servers import Cluster

# Several at once: tests alternate kinds (valkey, redis), and one kind's spare must not wait
# behind the other's start.
_STARTER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="spare-cluster")
_SPARES: dict[tuple[Any, ...], Future[Cluster]] = {}


def fresh_cluster(kind: str, **options: Any) -> Cluster:
    """A started cluster of ``kind`` (``options`` as ``Cluster``'s) that no test used; the
    caller stops it. One like it is started in the background for the next caller."""
    spare = _SPARES.pop(_key(kind, options), None)
    cluster = None
    if spare is not None:
        with contextlib.suppress(Exception):  # it did not start: one is started here, and says why
            cluster = spare.result()
    if cluster is None:
        cluster = Cluster(kind, **options).start()
    start_ahead(kind, **options)
    return cluster


def start_ahead(kind: str, **options: Any) -> None:
    """Start, in the background, the cluster the next ``fresh_cluster`` call like this takes."""
    key = _key(kind, options)
    if key not in _SPARES:
        _SPARES[key] = _STARTER.submit(lambda: Cluster(kind, **options).start())


def _key(kind: str, options: dict[str, Any]) -> tuple[Any, ...]:
    return (kind, *sorted(options.items()))


def stop_spares() -> None:
    """At the session's end: the spares nobody took are stopped, and their thread ends."""
    for spare in _SPARES.values():
        with contextlib.suppress(Exception):
            spare.result().stop()
    _SPARES.clear()
    _STARTER.shutdown()
