"""Tested versions (issue 42 §1.10): one record (docs/compat.json), and the README's paragraph
and docs/getting-started.md's table written from it by scripts/compatdoc.py, current, and
saying the same; the matrix noxfile.py runs is the record's; a compat session's run, pass or
fail, lands in the record and both pages (a real pytest run's --junitxml report)."""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import compatdoc

VERSIONS = {"kombu": "5.7.0", "celery": "5.7.0", "redis": "8.2.0", "hiredis": None, "python": "3.11.7"}


def region(text: str) -> str:
    return text.split(compatdoc.START, 1)[1].split(compatdoc.END, 1)[0]


def prose(text: str) -> str:
    return " ".join(text.split())


def test_both_pages_are_what_the_generator_writes_from_the_record_now() -> None:
    for page, content in compatdoc.pages(compatdoc.load()).items():
        assert page.read_text() == content, f"{page.name}'s tested versions are stale: run make docs"


def test_the_readme_and_the_getting_started_page_say_the_same_of_what_ran() -> None:
    """The two had come to contradict each other: the README said 12 of the 32 had run and
    'the others were not run', the getting-started page that all 32 had."""
    said = prose(compatdoc.summary(compatdoc.load()))
    readme = prose(region(compatdoc.README.read_text()))
    getting_started = prose(region(compatdoc.GETTING_STARTED.read_text()))
    assert said in readme and said in getting_started
    for text in (readme, getting_started):
        assert "were not run" not in text and "12 of the 32" not in text


def test_the_record_holds_a_run_of_every_combination_with_its_versions() -> None:
    runs = {run.session: run for run in compatdoc.load()}
    assert sorted(runs) == sorted(c.session for c in compatdoc.combinations())
    assert len(runs) == 32
    for c in compatdoc.combinations():
        run = runs[c.session]
        assert run.kombu.startswith(c.kombu_celery + ".") and run.celery.startswith(c.kombu_celery + ".")
        assert (run.redis + ".").startswith(c.redis_id + "."), c.session
        assert (run.hiredis is not None) == c.hiredis, c.session
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", run.date), c.session
        assert re.fullmatch(r"[0-9a-f]{7}(-dirty)?", run.commit), c.session
        assert run.ok, c.session
    # What is known of the runs of 2026-12-04 (git log -S: 073cb12, c236fc5).
    assert sum(run.commit == "fd991d2" for run in runs.values()) == 12
    assert {run.passed for run in runs.values() if run.commit == "ccda64a"} == {393}


def test_the_table_has_one_row_per_combination_and_no_row_outside_it() -> None:
    text = compatdoc.GETTING_STARTED.read_text()
    rows = [line for line in region(text).splitlines() if re.match(r"^\| 5\.", line)]
    assert len(rows) == len(compatdoc.combinations())
    outside = text.replace(region(text), "")
    assert not re.search(r"^\| 5\.\d", outside, flags=re.M)


def test_noxfile_runs_the_record_s_matrix() -> None:
    nox = pytest.importorskip("nox")
    assert nox
    sys.path.insert(0, str(compatdoc.ROOT))
    import noxfile

    ids = [p.id for p in noxfile._params()]  # type: ignore[attr-defined]
    assert ids == [c.session for c in compatdoc.combinations()]
    assert noxfile.REDIS is compatdoc.REDIS and noxfile.KOMBU_CELERY is compatdoc.KOMBU_CELERY


def test_a_stale_page_and_a_bad_record_are_caught(tmp_path: Path) -> None:
    runs = compatdoc.load()
    fresh = compatdoc.pages(runs)[compatdoc.GETTING_STARTED]
    stale = fresh.replace("| 5.7.0 | 5.7.0 | 8.2.0 | no | pass", "| 5.7.0 | 5.7.0 | 8.2.0 | no | fail")
    assert stale != fresh
    assert compatdoc.updated(stale, "getting-started.md",
                             compatdoc.getting_started_region(runs)) == fresh
    with pytest.raises(ValueError, match="must hold the markers"):
        compatdoc.updated("no markers", "README.md", "x")
    record = tmp_path / "compat.json"
    data = json.loads(compatdoc.RECORD.read_text())
    data["runs"].append(dict(data["runs"][0]))
    record.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"two runs of '5\.4-redis6-hiredis'|two runs of '5\.4-redis5\.0'"):
        compatdoc.load(record)
    data["runs"][-1]["session"] = "5.3-redis5.0"
    record.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"'5\.3-redis5\.0', which is no combination of the matrix"):
        compatdoc.load(record)


def junit_of(tmp_path: Path, body: str) -> Path:
    """A real pytest run's --junitxml report of the test module ``body``."""
    module = tmp_path / "test_probe.py"
    module.write_text(body)
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    "--rootdir", str(tmp_path), str(module)], cwd=tmp_path, capture_output=True, timeout=120)
    return junit


def copies(tmp_path: Path) -> tuple[Path, Path, Path]:
    paths = []
    for source in (compatdoc.RECORD, compatdoc.README, compatdoc.GETTING_STARTED):
        paths.append(tmp_path / source.name)
        shutil.copy(source, paths[-1])
    return paths[0], paths[1], paths[2]


def test_a_session_s_run_replaces_its_combination_s_row_and_both_pages_say_it(tmp_path: Path) -> None:
    record, readme, getting_started = copies(tmp_path)
    junit = junit_of(tmp_path, "import pytest\n\ndef test_a(): pass\n\ndef test_b(): pass\n\n"
                               "@pytest.mark.skip\ndef test_c(): pass\n")
    run = compatdoc.record_run("5.7-redis8", VERSIONS, junit, "abcdef1", record, readme, getting_started,
                               today=datetime.date(2026, 12, 5))
    assert (run.passed, run.failed, run.errors, run.skipped, run.ok) == (2, 0, 0, 1, True)
    runs = compatdoc.load(record)
    assert len(runs) == 32 and runs[-1] == run  # replaced, not added
    row = "| 5.7.0 | 5.7.0 | 8.2.0 | no | pass: 2 passed, 1 skipped"
    assert row in getting_started.read_text() and row + " (" in getting_started.read_text()
    assert "`abcdef1` |" in getting_started.read_text()
    said = prose(compatdoc.summary(runs))
    assert "1 at `abcdef1` (2026-12-05)" in said and "31 at" not in said
    assert said in prose(readme.read_text()) and said in prose(getting_started.read_text())


def test_a_failing_run_is_recorded_as_failed_and_named_on_both_pages(tmp_path: Path) -> None:
    record, readme, getting_started = copies(tmp_path)
    junit = junit_of(tmp_path, "def test_a(): pass\n\ndef test_b(): assert False\n")
    run = compatdoc.record_run("5.4-redis5.0", VERSIONS | {"kombu": "5.4.2", "celery": "5.4.0",
                                                            "redis": "5.0.8"},
                               junit, "abcdef1-dirty", record, readme, getting_started,
                               today=datetime.date(2026, 12, 5))
    assert not run.ok and (run.passed, run.failed) == (1, 1)
    assert "| 5.4.2 | 5.4.0 | 5.0.8 | no | fail: 1 failed, 1 passed (" in getting_started.read_text()
    for page in (readme, getting_started):
        assert "failed: `5.4-redis5.0`." in prose(page.read_text())


def test_a_combination_without_a_run_is_said_not_run(tmp_path: Path) -> None:
    runs = [run for run in compatdoc.load() if run.session != "5.5-redis7-hiredis"]
    said = prose(compatdoc.summary(runs))
    assert said.startswith("31 of the 32 have run") and "not run: `5.5-redis7-hiredis`" in said
    assert "| 5.5.x | 5.5.x | 7.* | yes | not run | |" in compatdoc.table(runs)


def test_the_commit_a_run_names_is_head_marked_dirty_only_by_code_changes() -> None:
    commit = compatdoc.current_commit()
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=compatdoc.ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert commit in (head, head + "-dirty")
