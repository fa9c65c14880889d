"""An event receiver, as `celery events` runs one: it listens to the workers' task events
through the broker's fanout (Celery's event exchange) for the whole run, reconnecting
after broker faults, and records each ``task-succeeded`` in the ledger, so the verdict
can count the events lost."""

from __future__ import annotations

import threading
from typing import Any

from celery import Celery

from tools.chaos import ledger


class EventListener(threading.Thread):
    def __init__(self, broker_url: str, transport_options: dict[str, Any], ledger_url: str) -> None:
        super().__init__(name="chaos-events", daemon=True)
        self.app = Celery("chaos-events", broker=broker_url, set_as_current=False)
        self.app.conf.broker_transport_options = transport_options
        self.app.conf.broker_connection_retry_on_startup = True
        self.ledger_url = ledger_url
        self.received = 0
        self.receiver: Any = None

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("type") == "task-succeeded":
            self.received += 1
            ledger.record("event", self.ledger_url, id=event["uuid"], t=event.get("timestamp"),
                          worker=event.get("hostname"))

    def run(self) -> None:
        with self.app.connection_for_read() as connection:
            self.receiver = self.app.events.Receiver(connection, handlers={"*": self.on_event})
            # ConsumerMixin.run reconnects after connection errors (broker restarts, CLIENT
            # KILL) and checks should_stop between one-second polls.
            self.receiver.run()

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.join(30)
        self.app.close()
