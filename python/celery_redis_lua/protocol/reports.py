"""What a consumer logs of the scripts' reports: messages that expired while they waited,
and what a sweep dropped or restored (the kombu channel's consuming round)."""

from __future__ import annotations

import logging

from .ops import SweepReport
from .policy import Policy

logger = logging.getLogger("celery_redis_lua.kombu.consuming")  # the name operators filter on


def log_expired(expired: int, queues: list[str]) -> None:
    if expired:
        logger.warning("celery-redis-lua: %d message(s) of queue(s) %s had expired (message TTL) "
                       "while they waited and were dead-lettered instead of delivered",
                       expired, ", ".join(queues))


def log_sweep(report: SweepReport, policy: Policy, queues: list[str]) -> None:
    where = "dead-lettered" if policy.dead_letter_maxlen else "deleted"
    for dropped in report.dropped_messages:
        if dropped.reason == "expired":
            logger.warning("celery-redis-lua: message %s of queue %r expired (message TTL) "
                           "while it waited and was %s", dropped.id, dropped.queue, where)
        elif dropped.reason == "revoked":
            logger.info("celery-redis-lua: message %s of queue %r came back after Celery revoked "
                        "its task and was %s, not run again", dropped.id, dropped.queue, where)
        else:
            logger.error("celery-redis-lua: message %s of queue %r reached delivery_limit=%s "
                         "(x-delivery-count %s) and was %s", dropped.id, dropped.queue,
                         policy.delivery_limit, dropped.delivery_count, where)
    unreported = report.limit_reached + report.expired + report.revoked - len(report.dropped_messages)
    if unreported > 0:
        logger.warning("celery-redis-lua: the sweep also %s %d more message(s) (TTL or "
                       "delivery limit) of queues %s", where, unreported, ", ".join(queues))
    if report.requeued or report.unclaimed:
        logger.info("celery-redis-lua: sweep restored %d timed-out and %d unclaimed messages",
                    report.requeued, report.unclaimed)
