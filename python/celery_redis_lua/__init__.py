"""celery-redis-lua: a Celery/kombu broker transport whose every protocol operation is a Lua script."""

from kombu.transport import TRANSPORT_ALIASES

from _celery_redis_lua_alias import ALIASES

from .kombu.transport import Transport
from .protocol.call import Call, ScriptError
from .protocol.contract import Script, load_scripts
from .protocol.dedup import BadDedup, Dedup
from .protocol.fairness import BadFairnessKey
from .protocol.keys import Keyspace, KeyspaceError
from .protocol.library import ScriptLibrary
from .protocol.ops import (
    Acked,
    Consumed,
    DeadLetter,
    Declared,
    Deleted,
    Delivery,
    Dropped,
    Limits,
    Published,
    QueueStats,
    Rejected,
    SweepReport,
)
from .protocol.policy import Policy
from .protocol.runner import ScriptRunner
from .protocol.together import confirm_groups, confirm_together
from .protocol.unconfirmed import UnconfirmedPublishError
from .tools.flow import clear_limits, limit, pause, resume
from .tools.locate import cancel, where

__version__ = "0.2.0.dev0"

# Importing the package registers our URL schemes with kombu, so that
# broker_url = "redislua://host:6379/0" (TLS: "redisluas://", Unix socket:
# "redislua+socket:///path") alone selects this transport (the .pth hook does the same
# where nothing imports the package).
for _scheme, _target in ALIASES.items():
    TRANSPORT_ALIASES.setdefault(_scheme, _target)

__all__ = [
    "Acked", "BadDedup", "BadFairnessKey", "Call", "Consumed", "DeadLetter", "Declared", "Dedup", "Deleted",
    "Delivery", "Dropped", "Keyspace", "KeyspaceError", "Limits", "Policy", "Published", "QueueStats",
    "Rejected", "Script", "ScriptError", "ScriptLibrary", "ScriptRunner", "SweepReport", "Transport",
    "UnconfirmedPublishError", "cancel", "clear_limits", "confirm_groups", "confirm_together", "limit",
    "load_scripts", "pause", "resume", "where",
]
