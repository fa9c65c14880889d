"""Routes cached per channel: a publish to a named exchange without a lookup round trip.

kombu routes every publish through the exchange's binding table (``get_table``). A channel
keeps each table it looked up while the first of its bindings lives (``Routes.stale_in_ms``),
at most :data:`MAX_AGE_SECONDS`; a publish through a cached table carries (exchange, the
lookup's server time) to the publish script.

Why a stale table is never used silently:
- **Unbind, anywhere.** Whoever unbinds (this transport, in any process) then runs the
  ``rerouted`` script on the queue it unbound, with the binding table server's time, before
  the call returns; publish refuses a route to that queue looked up before then (and any
  route to a queue that no longer exists). The channel looks the table up again and
  publishes where it now routes, skipping queues that already stored the message.
- **Bind, anywhere.** A bind that adds a member runs ``rerouted`` on every queue of the
  exchange, so a cached table without the new queue is refused at its next publish to any
  of the others; a routing key the cached table does not route at all is looked up again
  before kombu would call the message undeliverable.
- **Bindings that go stale** (an expiring queue's) are dropped from the cache when the
  first of them would; a table edited behind the transport's back is seen within
  :data:`MAX_AGE_SECONDS`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..protocol import together
from ..protocol.library import ScriptLibrary
from ..protocol.ops import Outgoing, Routes
from ..protocol.unconfirmed import Send, UnconfirmedPublishError

logger = logging.getLogger(__name__)

MAX_AGE_SECONDS = 10.0
MAX_TABLES = 1024  # exchanges a channel keeps tables of (beyond it, it starts over)


@dataclass
class Publishing:
    """One basic_publish to a named exchange: the table its route came from, and the queues
    that already stored the message (a refused route is retried only for the others)."""

    looked_up_ms: int | None = None  # the cached table's lookup time; None: looked up just now
    fresh: bool = False  # after a refusal: look the table up again, publish without the check
    stored: set[str] = field(default_factory=set)


class RouteCache:
    def __init__(self, lib: ScriptLibrary,
                 members: Callable[[str], list[str]] = lambda queue: [queue]) -> None:
        self.lib = lib
        self.members = members  # a queue's, a sharded one's shards with it (sharding.py)
        self._tables: dict[str, tuple[Routes, float]] = {}  # exchange -> (table, until: monotonic)
        # exchange -> the time this channel recorded a change at (rerouted): a table looked up
        # in that very millisecond would be refused at its next publish, so it is not kept.
        self._recorded: dict[str, int] = {}
        self.redeliver: Callable[[list[Send]], None] | None = None  # a block's (put_later)

    def get(self, exchange: str, publishing: Publishing | None = None) -> Routes:
        """The table of ``exchange``: cached unless expired or ``publishing`` asks for a fresh
        one. ``publishing`` learns which (a cached one's publishes carry its lookup time)."""
        cached, until = self._tables.get(exchange, (None, 0.0))
        if cached is not None and time.monotonic() < until and not (publishing and publishing.fresh):
            if publishing is not None:
                publishing.looked_up_ms = cached.looked_up_ms
            return cached
        routes = self.refresh(exchange)
        if publishing is not None:
            publishing.looked_up_ms = None
        return routes

    def refresh(self, exchange: str) -> Routes:
        routes = self.lib.lookup(exchange)
        if routes.looked_up_ms <= self._recorded.get(exchange, -1):
            self._tables.pop(exchange, None)
            return routes  # good for this publish (sent without the check), not for later ones
        self._recorded.pop(exchange, None)
        life = MAX_AGE_SECONDS
        if routes.stale_in_ms is not None:
            life = min(life, routes.stale_in_ms / 1000)
        if len(self._tables) >= MAX_TABLES:
            self._tables.clear()
            self._recorded.clear()
        self._tables[exchange] = (routes, time.monotonic() + life)
        return routes

    def changed(self, exchange: str, queues: Iterable[str] | None = None) -> None:
        """This process just bound or unbound in ``exchange``: record it on ``queues`` (default:
        every queue the table routes to) with the server's time, so every cached copy of the
        old table is refused; ours goes too (none looked up in that millisecond is kept)."""
        self._tables.pop(exchange, None)
        routes = self.lib.lookup(exchange)
        self._recorded[exchange] = routes.looked_up_ms
        names = dict.fromkeys(member for queue in ((b.queue for b in routes) if queues is None else queues)
                              for member in self.members(queue))
        calls = [self.lib.calls.rerouted(queue, exchange, routes.looked_up_ms) for queue in names]
        if calls:
            self.lib.run_many(calls)


def close_unconfirmed(channel: Any, deadline: float) -> UnconfirmedPublishError | None:
    """A closing channel sends its unconfirmed publishes; what was refused (or lost) is
    returned, for the close to raise once closed."""
    if channel.unconfirmed is None:
        return None
    try:
        channel.settle_unconfirmed(timeout=max(0.0, deadline - time.monotonic()))
    except UnconfirmedPublishError as error:
        return error
    except Exception as error:  # a lost connection: the flush recorded what it took
        logger.warning("celery-redis-lua: unconfirmed publishes at close: %s", error)
        try:
            channel.unconfirmed.check()
        except UnconfirmedPublishError as refused:
            return refused
    finally:
        channel.unconfirmed.close()
    return None


def put_later(channel: Any, queue: str, outgoing: Outgoing) -> bool:
    """A publish stored (or refused) when it goes, not now: unconfirmed (the channel's
    pipeline, protocol/unconfirmed.py) or in a confirm_together() block (protocol/together.py,
    which publishes again at its end what a stale route refused). False: publish it now."""
    send = channel._send  # set by basic_publish for these only
    if send is None:
        return False
    if channel.unconfirmed is not None:
        channel.unconfirmed.add(send, queue, outgoing.call(channel.lib.keys, channel.lib.policy, queue))
    else:
        routes = channel.routes
        if routes.redeliver is None:  # made once, at the channel's first gathered publish
            routes.redeliver = partial(redeliver, channel.connection.client, channel.state)
        together.gather(channel.lib, (channel.options.publish_pipeline, channel.options.fence_timeout), send,
                        queue, outgoing, routes.redeliver)
    return True


def redeliver(client: Any, state: Any, sends: list[Send]) -> None:
    """A confirm_together() block's publishes that a stale route refused, published again
    (confirmed, a fresh lookup) on a connection of its own: the channel that sent them may be
    another thread's by now. It is told the exchanges' types the sender's state knew."""
    with client.clone() as connection:
        channel = connection.default_channel
        for send in sends:
            if send.exchange in state.exchanges:
                channel.state.exchanges[send.exchange] = state.exchanges[send.exchange]
            channel._deliver(send.message, send.exchange, send.routing_key,
                             Publishing(fresh=True, stored=send.stored), **send.kwargs)
