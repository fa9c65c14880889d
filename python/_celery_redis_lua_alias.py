"""Makes ``broker_url = "redislua://..."`` work even where nothing imports celery_redis_lua.

Installed beside the package with a ``.pth`` file, this module runs at interpreter
start and costs almost nothing: it imports only ``sys`` and ``importlib``, and
waits for kombu to import ``kombu.transport``; right after that module has run,
it adds our URL schemes to kombu's ``TRANSPORT_ALIASES`` (which is what
``import celery_redis_lua`` does too). kombu itself is not imported early.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

# Our URL schemes, and what each means to redis-py: the one table of them (the transport and
# the CLI read it from here, because this module must not import the package).
SCHEMES = {"redislua": "redis", "redisluas": "rediss", "redislua+socket": "unix"}
TRANSPORT = "celery_redis_lua.kombu.transport:Transport"
# kombu takes "redislua+socket://" as the transport "redislua" with a socket:// host.
ALIASES = {scheme: TRANSPORT for scheme in SCHEMES if "+" not in scheme}


def register(module: Any) -> None:
    for scheme, target in ALIASES.items():
        module.TRANSPORT_ALIASES.setdefault(scheme, target)


class _KombuTransportHook:
    """A meta path finder that only wraps the loading of ``kombu.transport``."""

    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "kombu.transport":
            return None
        sys.meta_path.remove(cls)  # one shot; let the real finders locate the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            register(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if "kombu.transport" in sys.modules:
        register(sys.modules["kombu.transport"])
    elif _KombuTransportHook not in sys.meta_path:
        sys.meta_path.insert(0, _KombuTransportHook)


install()
