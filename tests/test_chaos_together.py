"""The chaos producer's ``--together N`` (scripts/chaos/producer.py): its tasks go in
confirm_together() blocks, each recorded as submitted only once its block has ended, and a
task its block's end names as refused recorded as a submit error (outcome unknown: delivered
anyway, it counts as recovered), the rest of the block as submitted."""

from __future__ import annotations

from celery_redis_lua import Keyspace, ScriptLibrary
from scripts.chaos import ledger
from scripts.chaos.producer import Producer
from scripts.chaos.profiles import PROFILES
from scripts.servers import Server


def producer(broker: Server, book: Server, together: int, **options: object) -> Producer:
    return Producer(f"redislua://127.0.0.1:{broker.port}/0", options, book.url, PROFILES["smoke"], seed=1,
                    together=together)


def test_a_block_is_recorded_once_it_ended_and_its_tasks_are_stored(valkey_server: Server) -> None:
    with Server("valkey") as broker:
        sender = producer(broker, valkey_server, 5)
        try:
            assert sender.send_block() == 5
        finally:
            sender.app.close()
        submits = ledger.read(valkey_server.url)["submit"]
        assert len(submits) == 5 and all(s["sent"] >= s["t"] for s in submits)
        queues = {s["queue"] for s in submits}
        stats = ScriptLibrary(broker.client(), Keyspace()).stats(sorted(queues))
        assert sum(s.ready + s.delayed for s in stats) == 5
    valkey_server.client().delete("chaos:submit", "chaos:submit_error")


def test_what_the_blocks_end_refused_is_a_submit_error(valkey_server: Server) -> None:
    with Server("valkey") as broker:
        sender = producer(broker, valkey_server, 5, fence_timeout=0)  # a refusal not waited out
        try:
            sender.send_block()  # the queues declared (a declare is not gathered: it would raise at once)
            broker.client().config_set("min-replicas-to-write", 1)  # every write refused now
            assert sender.send_block() == 5
        finally:
            sender.app.close()
        book = ledger.read(valkey_server.url)
        assert len(book["submit"]) == 5 and len(book["submit_error"]) == 5, book["submit_error"]
        assert all(e["error"].startswith("UnconfirmedPublishError(") and "NOREPLICAS" in e["error"]
                   for e in book["submit_error"]), book["submit_error"]
    valkey_server.client().delete("chaos:submit", "chaos:submit_error")
