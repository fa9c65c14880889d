"""A rotating credential provider with a real Celery worker (ElastiCache IAM tokens expire
after 12 h; kombu re-authenticates its long-lived connections since celery/kombu#2563): the
worker's user gets a new password, the old one is removed (ACL SETUSER ... resetpass) and
every connection of that user is cut, as an expired token's would be; the worker reconnects
with what the provider gives now and runs the next task, without a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery import Celery
from redis.cluster import RedisCluster

from .harness import Broker, Worker, running, wait_for

ON_CLUSTERS = True  # also on a three-primary cluster (conftest.py): ACLs are per node
USER = "rotor"


def on_every_node(client: Any, *command: str) -> list[Any]:
    """A server command on the one server, or on every primary of a cluster."""
    if isinstance(client, RedisCluster):
        return list(client.execute_command(*command, target_nodes=RedisCluster.PRIMARIES).values())
    return [client.execute_command(*command)]


def test_the_worker_goes_on_after_its_password_is_rotated(broker: Broker, producer: Celery,
                                                           log_dir: Path, tmp_path: Path) -> None:
    admin = broker.client()  # the default user: the producer's, never rotated
    on_every_node(admin, "ACL", "SETUSER", USER, "on", ">first-secret", "~*", "&*", "+@all")
    credentials = tmp_path / "credentials"
    credentials.write_text(f"{USER}\nfirst-secret\n")
    worker = Worker(broker, name="rotated", env={"CRL_CREDENTIALS_FILE": str(credentials)}, log_dir=log_dir)
    with running(worker):
        producer.send_task("celery_e2e.app.note", ("before",))
        wait_for(lambda: broker.entries("ran"), timeout=30, what="the worker runs a task")
        pid = worker.process.pid if worker.process else None

        credentials.write_text(f"{USER}\nsecond-secret\n")
        on_every_node(admin, "ACL", "SETUSER", USER, "resetpass", ">second-secret")
        cut = sum(on_every_node(admin, "CLIENT", "KILL", "USER", USER))
        assert cut >= 2, cut  # its blocking wait and its other connections were open

        producer.send_task("celery_e2e.app.note", ("after",))
        wait_for(lambda: len(broker.entries("ran")) == 2, timeout=60, what="the task after the rotation runs")
        assert worker.process is not None and worker.process.pid == pid and worker.process.poll() is None
        clients = [c for listed in on_every_node(admin, "CLIENT", "LIST") for c in _parsed(listed)]
        assert any(c.get("user") == USER for c in clients), "the worker is connected again, as its user"
    assert [e["label"] for e in broker.entries("ran")] == ["before", "after"]


def _parsed(listed: Any) -> list[dict[str, str]]:
    """CLIENT LIST as dicts (redis-py parses it for a plain client, not for execute_command)."""
    if isinstance(listed, list):
        return listed
    text = listed.decode() if isinstance(listed, bytes) else str(listed)
    return [dict(field.split("=", 1) for field in line.split() if "=" in field) for line in text.splitlines()]
