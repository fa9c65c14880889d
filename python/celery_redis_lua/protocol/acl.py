"""Least-privilege ACL users: the exact commands the transport sends, on its keys only.

Redis checks a script's ``redis.call``s against the calling user's ACL too, so a user
needs the commands inside the scripts it runs as well as the ones Python sends. Both are
read off the code here (the scripts' sources, and the list of direct commands below), so
the documented ``ACL SETUSER`` lines cannot drift from what the transport does: docs/deployment.md
shows ``celery-redis-lua acl`` output, and a test runs the transport as those users.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from .contract import Script, load_scripts

ROLES = ("worker", "producer", "exporter")
# What Python sends itself, by role: CLIENT SETNAME only with client_name, SELECT only for a
# db other than 0; CLIENT ID and UNBLOCK end a blocking wait at once (without UNBLOCK the
# wait's connection is closed instead). Not CLIENT SETINFO: redis-py sends it on connect and
# ignores a refusal, and Redis 7.0 does not know it (ACL SETUSER would fail there); granting
# it on 7.2+ keeps those refusals out of ACL LOG. INFO: the eviction guard reads maxmemory_policy
# (protocol/eviction.py); refused, the policy reads as unknown.
DIRECT: Mapping[str, tuple[str, ...]] = {
    "worker": ("ping", "info", "evalsha", "script|load", "select", "client|setname", "blpop", "xread",
               "client|id", "client|unblock"),
    "producer": ("ping", "info", "evalsha", "script|load", "select", "client|setname"),
    # celery-redis-lua exporter: the metrics script, and SCAN and ZRANGE to discover queues.
    "exporter": ("ping", "info", "evalsha", "script|load", "select", "client|setname", "scan", "zrange"),
}
DURABILITY_COMMANDS = ("wait", "waitaof")
# The scripts a producer runs: kombu declares the queue (declare, and its size), binds it,
# looks the route up and publishes (fanout exchanges: fanout_publish); a passive declare
# asks exists. Remote control replies and result polling through the broker consume:
# a producer doing those (celery inspect, control) needs the worker role.
PRODUCER_SCRIPTS = ("declare", "size", "exists", "bind", "lookup", "rerouted", "publish", "fanout_publish")
_CALL = re.compile(r"""(?:rcall|redis\.p?call)\(\s*['"]([A-Za-z]+)['"]""")


def script_commands(scripts: Mapping[str, Script], names: Iterable[str] | None = None) -> set[str]:
    """The commands the named scripts (default: all) call, lower-case."""
    chosen = scripts if names is None else {name: scripts[name] for name in names}
    return {m.lower() for s in chosen.values() for m in _CALL.findall(s.source.decode())}


def commands_for(role: str, *, durability: bool = False, unblock: bool = True,
                 scripts: Mapping[str, Script] | None = None) -> list[str]:
    """Every command ``role`` needs, direct ones first (as listed), then the scripts'."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    scripts = scripts if scripts is not None else load_scripts()
    direct = [c for c in DIRECT[role] if unblock or c != "client|unblock"]
    if durability:
        direct += DURABILITY_COMMANDS
    names = {"worker": None, "producer": PRODUCER_SCRIPTS, "exporter": ("metrics",)}[role]
    inside = script_commands(scripts, names)
    return direct + sorted(inside - set(direct))


def setuser(user: str, role: str, prefix: str, *, password: str = "PASSWORD", durability: bool = False,
            unblock: bool = True) -> list[str]:
    """The ``ACL SETUSER`` arguments for ``user``: only ``role``'s commands, only keys that
    start with ``prefix`` (the transport's global_keyprefix), no Pub/Sub channels."""
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]+", user or ""):
        raise ValueError(f"user must be letters, digits and _.:@- only, got {user!r}")
    if not prefix:
        raise ValueError("a least-privilege user needs a global_keyprefix: with one, every key the "
                         "transport writes starts with it and one key pattern covers them")
    if any(c in prefix for c in " *?[]\\"):
        raise ValueError(f"the prefix must not hold spaces or glob characters, got {prefix!r}")
    return ["ACL", "SETUSER", user, "reset", "on", f">{password}", f"~{prefix}*", "resetchannels",
            "-@all", *(f"+{c}" for c in commands_for(role, durability=durability, unblock=unblock))]
