"""An event receiver, as `celery events` runs one: it listens to the workers' task events
through the broker's fanout (Celery's event exchange) for the whole run, reconnecting
after broker faults, and records each ``task-succeeded`` in the ledger, so the verdict
can count the events lost."""

from __future__ import annotations

import threading
import time
from typing import Any

from celery import Celery

from scripts.chaos import ledger


class EventListener(threading.Thread):
    def __init__(self, broker_url: str, transport_options: dict[str, Any], ledger_url: str) -> None:
        super().__init__(name="chaos-events", daemon=True)
        self.app = Celery("chaos-events", broker=broker_url, set_as_current=False)
        self.app.conf.broker_transport_options = transport_options
        self.app.conf.broker_connection_retry_on_startup = True
        self.ledger_url = ledger_url
        self.received = self.crashes = 0
        self.receiver: Any = None
        self.halt = threading.Event()

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("type") == "task-succeeded":
            self.received += 1
            ledger.record("event", self.ledger_url, id=event["uuid"], t=event.get("timestamp"),
                          worker=event.get("hostname"))

    def run(self) -> None:
        # ConsumerMixin.run reconnects after connection errors (broker restarts, CLIENT
        # KILL) and checks should_stop between one-second polls. Any other exception ends
        # it (with durability on, a NotDurable from the heartbeat broadcast the receiver
        # sends when it starts consuming): it is recorded, and the receiver started again
        # on a new connection, as a supervisor would restart `celery events`.
        while not self.halt.is_set():
            try:
                with self.app.connection_for_read() as connection:
                    self.receiver = self.app.events.Receiver(connection, handlers={"*": self.on_event})
                    if self.halt.is_set():
                        return
                    self.receiver.run()
                return
            except Exception as error:  # recorded, then the receiver is started again
                self.crashes += 1
                ledger.record("listener_error", self.ledger_url, t=time.time(), error=repr(error)[:300])
                self.halt.wait(1)  # before a restart, not a sync

    def stop(self) -> None:
        self.halt.set()
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.join(30)
        self.app.close()
