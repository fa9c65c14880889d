"""celery-redis-lua: a Celery/kombu broker transport whose every protocol operation is a Lua script."""

from .calls import Consumed, DeadLetter, Delivery, QueueStats, Rejected, SweepReport
from .keys import Keyspace, KeyspaceError
from .library import ScriptLibrary
from .scripts import Call, Script, ScriptError, ScriptRunner, load_scripts

__version__ = "0.1.0"

__all__ = [
    "Call", "Consumed", "DeadLetter", "Delivery", "Keyspace", "KeyspaceError", "QueueStats",
    "Rejected", "Script", "ScriptError", "ScriptLibrary", "ScriptRunner", "SweepReport",
    "load_scripts",
]
