"""The queue side of consuming: the channel methods of a consuming round (poller.py runs them).

A round consumes what is ready (the consume script, up to the QoS headroom, carrying the acks
gathered meanwhile), then blocks on the queues' wake lists (BLPOP, one wait per cluster slot)
and consumes again when woken. In Celery's hub the consume can go out without waiting for its
reply ("in flight"), read when the wait's socket is readable. Fanout streams are in fanout.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from ..protocol.envelope import BadEnvelope, delivered_envelope
from ..protocol.fence import NoReplicasError
from ..protocol.ops import Consumed, Delivery
from ..protocol.outbox import Batch
from ..protocol.reports import log_expired, log_sweep
from ..protocol.runner import Call
from ..protocol.settle import hand_back, reject
from ..protocol.waits import BlockingRead
from .keeper import KEEPER

logger = logging.getLogger(__name__)

# Server-side floor for a BLPOP/XREAD block, so a due-now hint never spins.
MIN_BLOCK_SECONDS = 0.005
# A slot freed while the channel holds more than half its prefetch window waits this long
# for others before the consume that refills it: the prefork pool frees its slots one at a
# time, and a refill each costs the hub a round trip per task.
REFILL_GATHER_SECONDS = 0.002


@dataclass(frozen=True)
class InFlight:
    """A consume sent without waiting for its reply: the acks in front of it, the queues and
    room it asked for, the calls as written."""

    acks: Batch | None
    group: list[str]
    room: int
    calls: list[Call[Any]]


class ConsumingMixin:
    """Mixed into :class:`~celery_redis_lua.kombu.channel.Channel`."""

    connection: Any
    client: Any
    lib: Any
    keys: Any
    options: Any
    outbox: Any
    qos: Any
    closed: bool
    is_cluster: bool
    queue_waits: dict[int | None, BlockingRead]
    stream_waits: dict[int | None, BlockingRead]
    on_stream_wait_readable: Any
    _active_queues: list[str]
    _no_ack_queues: set[str]
    _refill_due: float | None
    drained: list[list[str]]  # the slot groups the last consume_now found empty (sharding.py)
    turn_shards: Any
    note_drained: Any
    _undelivered: deque[tuple[Delivery, bool]]  # taken, not handed kombu yet (with their no_ack)

    # -- the round ----------------------------------------------------------------------------

    @property
    def queues_polled(self) -> list[str]:
        """Consumed queues that hold messages in ZSETs (fanout-bound ones read streams)."""
        fanout, shards = self.connection.fanout_queues, self.connection.shards
        return [m for q in dict.fromkeys(self._active_queues) if q not in fanout for m in shards.members(q)]

    def headroom(self) -> int:
        """How many messages QoS lets this channel take now. A QoS whose can_consume was
        replaced on the instance (Celery's worker_disable_prefetch wraps it with its free-slot
        check) is asked before each message: one per consume, or a batch would outrun it."""
        room = self.qos.can_consume_max_estimate()
        if "can_consume" in vars(self.qos):
            return 1 if room is None else min(room, 1)
        return self.options.consume_batch if room is None else min(room, self.options.consume_batch)

    def poll_queues(self) -> int:
        """Deliver what is ready in the consumed queues whose wait is not pending, then start
        their waits (one per slot group on a cluster). What a raising callback left undelivered
        goes first, and alone: it was taken within the window, and the round ends there."""
        if self._undelivered:
            return self._deliver_undelivered()
        if not self.queues_polled or not self.qos.can_consume():
            return 0
        waits = [(group, wait) for group in self.lib.slot_groups(self.queues_polled)
                 if not (wait := self._wait(self.queue_waits, self.keys.queue(group[0]))).refused]
        idle = [group for group, wait in waits if wait.pending is None]
        # A rate's next token is due (start_queue_wait): consume now, alongside the block.
        now = time.monotonic()
        due = [group for group, wait in waits if (wait.block_due or math.inf) <= now]
        if not idle and not due:
            self._refill_due = None  # the pending waits refill the window
            return 0
        if self._gathering():
            return 0
        if not due and self._consumes_in_flight(idle):
            self._send_consume(idle[0])
            return 0
        delivered, wake_in_ms, rate_in_ms, full = self.consume_now([q for group in idle + due for q in group])
        # A full take: more may be ready, consume again first; but the slots it found empty wait.
        for group in (idle + due if not full else self.drained) if self.qos.can_consume() else []:
            self.start_queue_wait(group, wake_in_ms, rate_in_ms)
        return delivered

    def refill_due(self) -> float | None:
        """When a refill held back, or a rate's next token, is due (monotonic): the loop must
        come back by then."""
        dues = [due for wait in self.queue_waits.values() if (due := wait.block_due) is not None]
        if dues and self.qos.can_consume():  # a full window: the rate waits for room first
            return min(dues) if self._refill_due is None else min(self._refill_due, *dues)
        return self._refill_due

    def _gathering(self) -> bool:
        """Hold the refill back while more than half the window is held and the first slot
        freed has waited less than REFILL_GATHER_SECONDS (a window of 1 or 2 never waits)."""
        window, room = self.qos.prefetch_count, self.qos.can_consume_max_estimate()
        if not window or room is None or 2 * room >= window:
            self._refill_due = None
            return False
        now = time.monotonic()
        if self._refill_due is None:
            self._refill_due = now + REFILL_GATHER_SECONDS
        if now < self._refill_due:
            return True
        self._refill_due = None
        return False

    def consume_now(self, queues: list[str] | None = None) -> tuple[int, int | None, int | None, bool]:
        """Deliver what is ready in ``queues`` (default: all); returns (delivered, wake_in_ms,
        rate_in_ms, whether every call took all it asked for)."""
        queues = self.turn_shards(self.queues_polled if queues is None else queues)  # sharding.py
        delivered, wake, rate, calls, short, self.drained = 0, None, None, 0, False, []
        for no_ack, group in ((True, [q for q in queues if q in self._no_ack_queues]),
                              (False, [q for q in queues if q not in self._no_ack_queues])):
            room = self.headroom()
            if not group or room <= 0:
                continue
            consumed = self.lib.consume(group, room, no_ack=no_ack, run=self._run_with_acks,
                                        refused=self._refusal)
            calls, short = calls + 1, short or len(consumed.deliveries) < room
            self.note_drained(group, consumed.deliveries)
            log_expired(consumed.expired, group)
            delivered += self._deliver_all(consumed.deliveries, no_ack)
            if consumed.wake_in_ms is not None:
                wake = consumed.wake_in_ms if wake is None else min(wake, consumed.wake_in_ms)
            if consumed.rate_in_ms is not None:
                rate = consumed.rate_in_ms if rate is None else min(rate, consumed.rate_in_ms)
        return delivered, wake, rate, calls > 0 and not short

    def _run_with_acks(self, call: Call[Consumed]) -> Consumed:
        """A consume carrying the gathered acks (outbox.py): no round trip of their own."""
        batch = self.outbox.take()
        if batch is None:
            return self.lib.run(call)
        (result,) = self.outbox.run(batch, [call])
        if isinstance(result, Exception):
            raise result
        return result

    def _deliver_all(self, deliveries: list[Delivery], no_ack: bool) -> int:
        """Hand kombu each delivery, held (keeper.py) from now: kombu takes them one at a time,
        and a solo task blocks inside the first. They wait in ``_undelivered`` until handed
        over: a callback that raises leaves the rest there, for the next round."""
        if not no_ack:
            KEEPER.take(self, self.lib, deliveries, self.connection.consumer_timeouts)
        self._undelivered.extend((delivery, no_ack) for delivery in deliveries)
        return self._deliver_undelivered()

    def _deliver_undelivered(self) -> int:
        """Hand kombu what was taken and not handed over yet, in the order taken. Each leaves
        the buffer before its callback runs (kombu's QoS holds it from then on); what is still
        in it is held by this channel, delivered by the next round (as kombu's own buffered
        messages are) or handed back when its queue is no longer consumed here."""
        delivered, undelivered = 0, self._undelivered
        while undelivered:
            delivery, no_ack = undelivered.popleft()
            payload = self._decode_or_reject(delivery, no_ack)
            if payload is None:
                continue
            try:
                # A shard's message goes to its logical queue's consumer (sharding.py).
                self.connection._deliver(payload, self.connection.shards.logical_of(delivery.queue))
            except Exception as error:
                # Raised before kombu's QoS took it (only its Message can: a body it cannot
                # decode), nobody would hold it: rejected as a payload that is no envelope is.
                if no_ack or payload["properties"]["delivery_tag"] in self.qos._delivered \
                        or not KEEPER.live(self.lib, delivery.queue, delivery.id):
                    raise
                self._reject_unreadable(delivery, no_ack, f"message {delivery.id} in queue "
                                        f"{delivery.queue!r}: kombu could not read it ({error!r})")
            else:
                delivered += 1
        return delivered

    def _hand_back_undelivered(self, consumed: list[str]) -> None:
        """Give back, unstarted and at once, what was taken for queues not in ``consumed`` but
        never handed kombu (a callback raised, then the channel closed or stopped consuming):
        else the keeper would extend it for as long as the channel lives. A no_ack one was
        removed when taken: there is nothing to give back."""
        back = [d for d, no_ack in self._undelivered if d.queue not in consumed and not no_ack]
        self._undelivered = deque(item for item in self._undelivered if item[0].queue in consumed)
        for queue in dict.fromkeys(d.queue for d in back):
            ids = [d.id for d in back if d.queue == queue]
            try:
                hand_back(self.lib, queue, ids, [d.delivery_count for d in back if d.queue == queue])
            except (redis.RedisError, OSError) as error:
                logger.warning("celery-redis-lua: could not hand back %d message(s) of queue %r never "
                               "delivered (%s); they come back after the visibility timeout",
                               len(ids), queue, error)
            finally:  # landed, or back after the visibility timeout: no longer extended
                KEEPER.release(self.lib, queue, ids)

    def _decode_or_reject(self, delivery: Delivery, no_ack: bool) -> dict[str, Any] | None:
        """A payload that is not a kombu envelope is rejected (dead-lettered) and logged."""
        try:
            return delivered_envelope(delivery)
        except BadEnvelope as error:
            self._reject_unreadable(delivery, no_ack, str(error))
            return None

    def _reject_unreadable(self, delivery: Delivery, no_ack: bool, why: str) -> None:
        """Every delivery of it would fail the same way: dead-letter it, logged."""
        logger.error("celery-redis-lua: rejected a message: %s", why)
        if not no_ack:
            KEEPER.release(self.lib, delivery.queue, [delivery.id])
            reject(self.lib, delivery.queue, [delivery.id], requeue=False, counts=[delivery.delivery_count])

    # -- consumes in flight (Celery's hub) -----------------------------------------------------

    def _consumes_in_flight(self, idle: list[list[str]]) -> bool:
        """Send this round's consume without waiting for its reply: in Celery's hub (it feeds
        the pool meanwhile), where consume and acks are one write (standalone or Sentinel, no
        durability wait), for queues with acks (a no_ack one unread at close would be lost)."""
        return (self.connection.poller.in_hub and len(idle) == 1 and self.lib.runner.batches_in_one_write
                and not any(queue in self._no_ack_queues for queue in idle[0]))

    def _send_consume(self, group: list[str]) -> None:
        """Send a consume for ``group``, the gathered acks in front, on the group's wait."""
        room = self.headroom()
        acks = self.outbox.take()
        calls = [*(self.outbox.calls(acks) if acks else []), self.lib.calls.consume(group, room)]
        sent = InFlight(acks, group, room, calls)
        self._wait(self.queue_waits, self.keys.queue(group[0])).send_batch(
            lambda connection: self.lib.runner.wire(connection, calls), len(calls), sent,
            timeout=max(self.options.blocking_timeout, 1.0))

    def _consume_arrived(self, wait: BlockingRead, *, closing: bool = False, then_wait: bool = True) -> int:
        """Settle the acks an in-flight consume carried, deliver what it took (hand it back when
        closing or no longer consumed here), and wait if it found fewer than it asked for."""
        replies, sent = wait.read_batch()  # a lost connection: the acks go back (_consume_lost)
        try:  # the calls that met NOSCRIPT (a flush, a failover) never ran: load, run them now
            results = self.lib.runner.rerun_noscript(sent.calls, replies, raise_on_error=False)
        except Exception as error:  # that run met a lost connection: the acks are sent again
            results = [error] * len(sent.calls)
        if sent.acks is not None:
            self.outbox.settle(sent.acks, results[:-1])
        consumed = results[-1]
        if isinstance(consumed, Exception):
            raise consumed
        log_expired(consumed.expired, sent.group)
        polled = [] if closing else self.queues_polled
        unwanted = [d for d in consumed.deliveries if d.queue not in polled]
        for queue in dict.fromkeys(d.queue for d in unwanted):
            back = [d for d in unwanted if d.queue == queue]
            hand_back(self.lib, queue, [d.id for d in back], [d.delivery_count for d in back])
        delivered = self._deliver_all([d for d in consumed.deliveries if d.queue in polled], False)
        if then_wait and not closing and len(consumed.deliveries) < sent.room and self.qos.can_consume():
            self.start_queue_wait([q for q in sent.group if q in polled], consumed.wake_in_ms,
                                  consumed.rate_in_ms)
        return delivered

    def _consume_lost(self, sent: InFlight) -> None:
        """An in-flight consume's replies are lost: its acks go back to the outbox; what it took
        comes back after the visibility timeout, counted."""
        if sent.acks is not None:
            lost = redis.ConnectionError("celery-redis-lua: the connection of an in-flight consume was lost")
            self.outbox.settle(sent.acks, [lost] * len(sent.acks.groups))

    # -- the blocking waits -----------------------------------------------------------------------

    def start_queue_wait(self, queues: list[str], wake_in_ms: int | None,
                         rate_in_ms: int | None = None) -> bool:
        """BLPOP on the wake lists of ``queues`` (one slot), bounded by blocking_timeout and the
        next ETA: it pops a token, never a message, so nothing is in limbo if this consumer
        dies. A rate's next token is timed here instead (the wait's ``due``; poll_queues
        consumes then, the block going on): the server ends a block up to 1/hz late, and a
        late consumer leaves its token unused. Returns whether a wait is now pending."""
        if not queues or self.headroom() <= 0:
            return False
        wait = self._wait(self.queue_waits, self.keys.queue(queues[0]))
        if wait.refused:
            return False
        if wait.pending is None:
            timeout = self.options.blocking_timeout
            if wake_in_ms is not None and (rate_in_ms is None or wake_in_ms < rate_in_ms):  # an ETA first
                timeout = min(timeout, wake_in_ms / 1000) if timeout else wake_in_ms / 1000
                timeout = max(timeout, MIN_BLOCK_SECONDS)
            wait.send("BLPOP", *[self.keys.wake(q) for q in queues], f"{timeout:.3f}", timeout=timeout)
        wait.due = None if rate_in_ms is None else time.monotonic() + rate_in_ms / 1000
        return True

    def on_wait_readable(self, wait: BlockingRead) -> int:
        """An in-flight consume's replies, or a woken (or timed-out) wait: consume now, wait again."""
        if not any(wait is w for w in self.queue_waits.values()):
            return self.on_stream_wait_readable(wait)
        if wait.batch is not None:
            return self._consume_arrived(wait)
        blocked_on = [self.keys.queue_of(key) for key in (wait.pending or ())[1:-1]]  # BLPOP's keys
        try:
            wait.read()  # the token (or None: the block timed out); consume decides what is there
        except NoReplicasError as error:
            if self._refusal is None:
                raise  # the one primary: kombu reconnects (through Sentinel, to the new one)
            self._refusal(blocked_on, error)
        return self.poll_queues()

    @property
    def _refusal(self) -> Callable[[list[str], NoReplicasError], None] | None:
        """On a cluster, what a fenced primary's refusal of a slot does: the slot waits a moment
        (its wait's ``refuse``), the other primaries' go on; on one primary, None: it is raised,
        and kombu reconnects (through Sentinel, to the new primary)."""
        return self._refused if self.is_cluster else None

    def _refused(self, queues: list[str], error: NoReplicasError) -> None:
        self._wait(self.queue_waits, self.keys.queue(queues[0])).refuse(queues, error)

    def _wait(self, waits: dict[int | None, BlockingRead], key: str) -> BlockingRead:
        """The wait for ``key``'s slot (on a cluster, to the node that owns it); else the one."""
        slot = key_slot(key.encode()) if self.is_cluster else None
        wait = waits.get(slot)
        if wait is None:
            if self.is_cluster:
                client: RedisCluster = self.client
                wait = BlockingRead(
                    lambda: client.get_redis_connection(client.get_node_from_key(key)).connection_pool,
                    on_redirect=client.nodes_manager.initialize)
            else:
                wait = BlockingRead(self.client.connection_pool, on_lost=self._consume_lost)
            waits[slot] = wait
        return wait

    @property
    def queue_wait(self) -> BlockingRead:
        """The wait of the first queue group (the only one when not on a cluster)."""
        groups = self.lib.slot_groups(self.queues_polled)
        return self._wait(self.queue_waits, self.keys.queue(groups[0][0]) if groups else "")

    def waits(self) -> list[BlockingRead]:
        return [*self.queue_waits.values(), *self.stream_waits.values()]

    def _restart_waits(self, *, closing: bool = False) -> None:
        """End the pending waits: the consumed queues changed (the waits name the old keys, so
        the next round blocks on the new set at once instead of after blocking_timeout), or the
        channel closes. An in-flight consume's replies come within ms: they are read now."""
        if self.closed:
            return
        self._hand_back_undelivered([] if closing else self.queues_polled)
        for wait in list(self.queue_waits.values()):
            if wait.batch is not None and closing:  # what it took goes back, counted
                with contextlib.suppress(redis.RedisError, OSError):  # lost: see _consume_lost
                    self._consume_arrived(wait, closing=True)
            elif wait.batch is not None:
                self._consume_arrived(wait, then_wait=False)
            elif woken := wait.cancel():
                # It had just taken a wake token: give it back (lost, it would cost the other
                # consumers one blocking_timeout).
                with contextlib.suppress(redis.RedisError, OSError):
                    self.lib.unpop(self.keys.queue_of(woken[0]))
        for wait in list(self.stream_waits.values()):
            wait.cancel()

    def sweep(self) -> None:
        """The consumed queues' sweep; a slot a fenced primary refuses (cluster) goes next time."""
        queues = self.queues_polled
        if queues:
            log_sweep(self.lib.sweep(queues, refused=self._refusal), self.lib.policy, queues)
