"""A warm shutdown begins at once: Celery's SIGTERM handler only sets a flag that its hub reads
after the poll returns, and Python resumes an interrupted poll, so an idle worker sat out the
rest of its 1 s tick (threads pool: 1.2 s from SIGTERM to exit against stock kombu's 0.2 s).
The transport makes the hub's poll return when Celery announces the shutdown."""

from __future__ import annotations

from celery import signals
from kombu import Connection
from kombu.asynchronous import Hub

from helpers import hub_readable, hub_wake_fd
from scripts.servers import Server


def test_worker_shutting_down_makes_the_hub_poll_return(valkey_server: Server) -> None:
    hub = Hub()
    receivers = len(signals.worker_shutting_down.receivers)
    try:
        with Connection(f"redislua://127.0.0.1:{valkey_server.port}/0") as conn:
            conn.default_channel  # noqa: B018  (the transport is made)
            conn.transport.register_with_event_loop(conn.connection, hub)
            fd = hub_wake_fd(hub)
            assert fd not in hub_readable(hub)
            signals.worker_shutting_down.send(sender="test@host", sig="SIGTERM", how="Warm", exitcode=0)
            assert fd in hub_readable(hub)
            conn.transport.poller.unregister()
        # Unregistered (the connection closed): the receiver is gone with its pipe.
        assert len(signals.worker_shutting_down.receivers) == receivers
    finally:
        hub.close()
