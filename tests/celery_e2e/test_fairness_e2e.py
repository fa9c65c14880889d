"""Fair queues through Celery itself: the task option ``fairness_key`` (apply_async/send_task,
or a task's route in task_routes) and the header ``x-fairness-key`` reach the publish script,
so a quiet tenant's task is taken before a flooding tenant's backlog; a bad key raises and
publishes nothing."""

from __future__ import annotations

from celery import Celery

from celery_redis_lua import Keyspace, ScriptLibrary

from .harness import Broker


def test_a_tenant_s_task_is_taken_ahead_of_another_s_backlog(broker: Broker, producer: Celery) -> None:
    producer.conf.task_routes = {"celery_e2e.app.add": {"fairness_key": "routed"}}
    flood = [producer.send_task("celery_e2e.app.note", (f"flood-{n}",), fairness_key="flood")
             for n in range(4)]
    quiet = producer.send_task("celery_e2e.app.note", ("quiet",), fairness_key="quiet")
    headed = producer.send_task("celery_e2e.app.note", ("headed",), headers={"x-fairness-key": "headed"})
    routed = producer.send_task("celery_e2e.app.add", (2, 2))
    client = broker.client()
    try:
        fields = {k.decode() for k in client.hkeys(Keyspace().meta("celery")) if k.startswith(b"fair")}
        assert fields == {"fair", "fair:flood", "fair:quiet", "fair:headed", "fair:routed"}
        lib = ScriptLibrary(client, Keyspace(), visibility_ms=60_000)
        taken = [d.id for d in lib.consume(["celery"], 8).deliveries]
        by_message = {client.hget(Keyspace().state("celery"), i).decode().rsplit(" ", 1)[-1]: n
                      for n, i in enumerate(taken)}
        order = [by_message[r.id] for r in (flood[0], quiet, headed, routed, flood[1])]
        assert order == sorted(order), "each key's first task before the flood's second"
        lib.ack("celery", taken)
        try:
            producer.send_task("celery_e2e.app.note", ("bad",), fairness_key="k" * 257, queue="bad")
        except Exception as error:  # whichever kombu wraps it in, the message names the key
            assert "fairness_key" in str(error) and "1..256 bytes" in str(error), error
        else:
            raise AssertionError("a 257-byte fairness key was published")
        assert not client.exists(Keyspace().message("bad"))
    finally:
        client.close()
