"""``exporter``: serve Prometheus metrics of the queues."""

from __future__ import annotations

import contextlib
import signal
import threading

import click

from .broker import connect, connection_options
from .output import CliError, _asked
from .root import main


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), default=9808, show_default=True,
              help="HTTP port of /metrics (celery-exporter's).")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface, e.g. in a container).")
@click.option("--queue", "queues", multiple=True,
              help="Repeatable. Default: every queue (meta keys and binding tables, rediscovered).")
@click.option("--discover-interval", type=click.FloatRange(min=1), default=30, show_default=True,
              help="Seconds between queue discoveries (SCAN).")
@connection_options
def exporter(port: int, address: str, queues: tuple[str, ...], discover_interval: float, url: str,
             prefix: str) -> None:
    """Serve Prometheus metrics of the queues (celery_queue_length and celery_redis_lua_*)."""
    from .. import exporter as metrics_exporter  # prometheus_client only when serving

    lib = connect(url, prefix)
    # Before the first scrape can be answered: a SIGTERM that comes as soon as /metrics
    # answers must stop the exporter cleanly, not kill it (CI met that race once).
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        server, _ = metrics_exporter.serve(lib, port=port, address=address, queues=queues,
                                                discover_interval=discover_interval)
    except OSError as error:
        raise CliError(f"cannot listen on {address}:{port}: {error.strerror or error}") from None
    click.echo(f"serving metrics of the {_asked[-1]} on http://{address}:{port}/metrics", err=True)
    with contextlib.suppress(KeyboardInterrupt):
        while not stop.wait(3600):
            pass
    server.shutdown()
