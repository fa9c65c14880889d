"""celery-redis-lua: a Celery/kombu broker transport whose every protocol operation is a Lua script."""

from .calls import Consumed, DeadLetter, Delivery, QueueStats, Rejected, SweepReport
from .keys import Keyspace, KeyspaceError
from .library import ScriptLibrary
from .scripts import Call, Script, ScriptError, ScriptRunner, load_scripts

__version__ = "0.2.0.dev0"

# Importing the package registers our URL schemes with kombu, so that
# broker_url = "redislua://host:6379/0" (TLS: "redisluas://", Unix socket:
# "redislua+socket:///path") alone selects this transport.
from kombu.transport import TRANSPORT_ALIASES

from .transport import Transport

for _scheme in ("redislua", "redisluas"):
    TRANSPORT_ALIASES.setdefault(_scheme, "celery_redis_lua.transport:Transport")

__all__ = [
    "Call", "Consumed", "DeadLetter", "Delivery", "Keyspace", "KeyspaceError", "QueueStats",
    "Rejected", "Script", "ScriptError", "ScriptLibrary", "ScriptRunner", "SweepReport",
    "Transport", "load_scripts",
]
