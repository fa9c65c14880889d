"""``celery-redis-lua status --watch``: a live table of the queues, redrawn every interval.

Each redraw is one metrics call per slot group (the same snapshot the exporter serves) and
shows, beside the counts, what moved since the last one, per second: redeliveries and drops
(the scripts' counters) and the net change of the ready and delayed messages. Ctrl-C ends it
and leaves the terminal as it was (rich's Live restores the cursor and the screen).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ..protocol import logical
from ..protocol.library import ScriptLibrary
from ..protocol.ops import QueueMetrics

COLUMNS = ("queue", "ready", "delayed", "retrying", "in flight", "dead", "paused", "limits",
           "ready/s", "redelivered/s", "dropped/s")


def watch_status(lib: ScriptLibrary, queues: Sequence[str], interval: float, *,
                 console: Console | None = None, rounds: int | None = None) -> None:
    """Redraw until Ctrl-C (or ``rounds`` redraws, for tests)."""
    console = console or Console()
    before: dict[str, QueueMetrics] = {}
    drawn = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while rounds is None or drawn < rounds:
                names = [m for q in queues for m in logical.members_of(lib, q)] or lib.queue_names()
                found = [m for q, shards in logical.fold(lib.metrics(names)) for m in (q, *shards)]
                live.update(render(found, before), refresh=True)
                before = {m.queue: m for m in found}
                drawn += 1
                if rounds is None or drawn < rounds:
                    time.sleep(interval)
        except KeyboardInterrupt:
            pass


def render(found: Sequence[QueueMetrics], before: dict[str, QueueMetrics]) -> Table:
    """One redraw: a row per queue; the rates are blank on the first one."""
    table = Table(title=f"celery-redis-lua queues ({len(found)})", title_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("queue", "paused", "limits") else "right")
    for m in found:
        last = before.get(m.queue)
        table.add_row(m.queue, str(m.ready), str(m.delayed), str(m.retrying), str(m.in_flight), str(m.dead),
                      "no" if m.paused is None else f"yes: {m.paused}" if m.paused else "yes", str(m.limits),
                      *rates(m, last))
    return table


def rates(now: QueueMetrics, last: QueueMetrics | None) -> tuple[str, str, str]:
    """Per second since ``last`` (server clock): net ready change, redeliveries, drops."""
    if last is None or now.now <= last.now:
        return "", "", ""
    seconds = (now.now - last.now) / 1000
    dropped = sum(now.dropped.values()) - sum(last.dropped.values())
    redelivered = now.redelivered - last.redelivered
    return (f"{(now.ready - last.ready) / seconds:+.1f}", f"{redelivered / seconds:.1f}",
            f"{dropped / seconds:.1f}")
