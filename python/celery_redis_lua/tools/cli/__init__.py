"""``celery-redis-lua``: inspect and load the scripts, publish a task, show queues, handle dead letters.

Every command takes ``--url`` (default: ``$CELERY_BROKER_URL``, else the broker of the
Celery app ``-A`` names, else redis://127.0.0.1:6379/0) and ``--prefix`` (the transport's
``global_keyprefix``; ``-A``'s by default); Sentinel URLs (``sentinel://h1:26379;...``
or ``redislua+sentinel://...``) take ``--master-name`` too. stderr names the server asked
and where its URL came from. Failures end with one line on stderr and a non-zero exit; a
password in a URL is never printed.
"""

from . import dead, exporter, migrate, queues, scripts, tasks  # noqa: F401  (each adds its commands)
from .root import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
