"""Running scripts: EVALSHA with NOSCRIPT recovery, alone or in pipelines.

Scripts are a cache on the server, not state: a restart, a failover or SCRIPT FLUSH
empties it. Every path that runs a script (single call or pipeline, standalone or
cluster) loads the script and retries once when the server answers NOSCRIPT; a call that
met NOSCRIPT never ran, so nothing takes effect twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from redis.exceptions import NoScriptError, ResponseError

from .contract import Script, load_scripts

ERROR_PREFIX = "celery-redis-lua:"
T = TypeVar("T")


class ScriptError(ResponseError):
    """A script refused its input (``ERR celery-redis-lua: <script>: <problem>``)."""

    def __init__(self, script: str, message: str) -> None:
        super().__init__(message)
        self.script = script


def _as_is(reply: Any) -> Any:
    return reply


@dataclass(frozen=True)
class Call(Generic[T]):
    """One script invocation, ready to run alone or in a pipeline; ``decode`` turns the
    server's reply into ``T``."""

    script: str
    keys: Sequence[str]
    args: Sequence[str | int | bytes]
    decode: Callable[[Any], T] = field(default=_as_is)


def to_script_error(script: str, error: ResponseError) -> ResponseError:
    """Turn our scripts' error replies into :class:`ScriptError`; leave others alone."""
    message = str(error)
    if message.startswith("ERR "):
        message = message[4:]
    if message.startswith(ERROR_PREFIX):
        return ScriptError(script, message.split(" script: ")[0])
    return error


class ScriptRunner:
    """Runs :class:`Call` objects on a redis-py client (standalone or cluster)."""

    def __init__(self, client: Any, scripts: dict[str, Script] | None = None) -> None:
        self.client = client
        self.scripts = scripts if scripts is not None else load_scripts()

    def load(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """SCRIPT LOAD the named scripts (default: all); returns name -> SHA1."""
        loaded = {}
        for name in names if names is not None else sorted(self.scripts):
            loaded[name] = self.client.script_load(self.scripts[name].source)
        return loaded

    def run(self, call: Call[T]) -> T:
        script = self.scripts[call.script]
        try:
            reply = self._evalsha(self.client, script, call)
        except NoScriptError:
            self.client.script_load(script.source)
            try:
                reply = self._evalsha(self.client, script, call)
            except ResponseError as error:
                raise to_script_error(call.script, error) from None
        except ResponseError as error:
            raise to_script_error(call.script, error) from None
        return call.decode(reply)

    def run_many(self, calls: Sequence[Call[Any]], *, raise_on_error: bool = True) -> list[Any]:
        """Run ``calls`` in one pipeline; calls that met NOSCRIPT are loaded and re-run.

        Only the calls that failed with NOSCRIPT run again (the server did not run
        them), so no call takes effect twice. With ``raise_on_error=False`` the
        result list holds the exception in place of a failed call's reply.
        """
        if not calls:
            return []
        replies = self._pipeline(calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            self.load(sorted({calls[i].script for i in missing}))
            for i, reply in zip(missing, self._pipeline([calls[i] for i in missing]), strict=True):
                replies[i] = reply
        results: list[Any] = []
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, ResponseError):
                error = to_script_error(call.script, reply)
                if raise_on_error:
                    raise error
                results.append(error)
            elif isinstance(reply, Exception):
                if raise_on_error:
                    raise reply
                results.append(reply)
            else:
                results.append(call.decode(reply))
        return results

    def _pipeline(self, calls: Sequence[Call[Any]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            self._evalsha(pipe, self.scripts[call.script], call)
        return list(pipe.execute(raise_on_error=False))

    @staticmethod
    def _evalsha(target: Any, script: Script, call: Call[Any]) -> Any:
        # execute_command, not .evalsha(): redis-py's ClusterPipeline blocks the
        # evalsha method, while the raw command is routed by its first key.
        return target.execute_command("EVALSHA", script.sha1, len(call.keys), *call.keys, *call.args)
