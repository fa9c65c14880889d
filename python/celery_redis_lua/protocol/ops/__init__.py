"""One typed definition per script: the arguments it takes, the :class:`Call` it makes, and
the reply it decodes. No protocol logic lives here; the scripts validate their input.

Every operation takes the keyspace and the policy first, so :class:`ScriptLibrary` binds
them all the same way (``lib.ack(queue, ids)``, or ``lib.calls.ack(queue, ids)`` for a
pipeline). A new script needs its Lua file and one function, marked ``@operation``, in the
module of its family (below). This package is where they are all found (``ops.publish``,
``ops.Delivery``, :data:`OPERATIONS`): importing any of its modules imports this one first,
so every family is registered before anyone reads :data:`OPERATIONS`.

- :mod:`.delivery`: publish, consume, ack, reject, extend, sweep (the delivery path)
- :mod:`.admin`: declare, purge, delete, exists, size, migrated (a queue's life)
- :mod:`.flow`: pause, resume, limit (flow control)
- :mod:`.metrics`: stats, metrics (what queues hold)
- :mod:`.tasks`: locate, cancel (one task's message, by its task id)
- :mod:`.dead`: dead_list, dead_replay, dead_purge (dead letters)
- :mod:`.exchanges`: bind, unbind, lookup, rerouted, fanout_* (bindings, fanout streams)
- :mod:`.base`: the registry and the marshalling they share
"""

from .admin import Declared, Deleted, declare, delete, exists, migrated, purge, size
from .base import OPERATIONS, Operation, Payload, operation
from .dead import DeadLetter, dead_list, dead_purge, dead_replay
from .delivery import (
    EMPTY_SWEEP,
    SWEEP_BATCH,
    Acked,
    Consumed,
    Delivery,
    Dropped,
    Outgoing,
    Published,
    Rejected,
    SweepReport,
    ack,
    consume,
    extend,
    fenced,
    publish,
    publish_many,
    reject,
    sweep,
    unpop,
)
from .exchanges import (
    FanoutBatch,
    FanoutBound,
    Routes,
    StaleRoute,
    bind,
    fanout_bind,
    fanout_consume,
    fanout_leave,
    fanout_publish,
    fanout_unbind,
    lookup,
    rerouted,
    unbind,
)
from .flow import RATE_PERIOD_SECONDS, Limits, limit, pause, resume
from .metrics import QueueMetrics, QueueStats, metrics, stats
from .tasks import Cancelled, Located, cancel, locate

__all__ = [
    "EMPTY_SWEEP", "OPERATIONS", "RATE_PERIOD_SECONDS", "SWEEP_BATCH", "Acked", "Cancelled", "Consumed",
    "DeadLetter", "Declared", "Deleted", "Delivery", "Dropped", "FanoutBatch", "FanoutBound", "Limits",
    "Located", "Operation", "Outgoing", "Payload", "Published", "QueueMetrics", "QueueStats", "Rejected",
    "Routes", "StaleRoute", "SweepReport", "ack", "bind", "cancel", "consume", "dead_list", "dead_purge",
    "dead_replay", "declare", "delete", "exists", "extend", "fanout_bind", "fanout_consume", "fanout_leave",
    "fanout_publish", "fanout_unbind", "fenced", "limit", "locate", "lookup", "metrics", "migrated",
    "operation", "pause", "publish", "publish_many", "purge", "reject", "rerouted", "resume", "size", "stats",
    "sweep", "unbind", "unpop",
]
