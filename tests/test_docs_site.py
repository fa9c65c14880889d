"""The README is a front door and docs/ a site (mkdocs.yml; `make docs` builds it with
--strict, CI runs that): what can be checked without mkdocs is checked here. The README
stays short, its relative links lead to files of the repository, every page of docs/ is in
the site's nav, and the flow-control table the README keeps is the one the operations page
shows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
GENERATED_TEMPLATES = {"scripts.header.md"}  # docs/scripts.md is made from it (exclude_docs)


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, title
    return match.group(1)


def table(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_the_readme_is_at_most_250_lines() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_the_readme_s_relative_links_lead_to_files_of_the_repository() -> None:
    targets = [t for t in LINK.findall(README.read_text()) if not re.match(r"^[a-z]+:", t)]
    assert targets
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert missing == []


def test_every_page_is_in_the_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w.-]+\.md)$", config.split("\nnav:", 1)[1], re.M))
    pages = {p.name for p in DOCS.glob("*.md")} - GENERATED_TEMPLATES
    assert pages == nav
    assert "docs_dir: docs" in config and "strict: true" in config


def test_the_flow_control_table_is_the_same_in_the_readme_and_the_docs() -> None:
    title = "Flow control in the broker, compared"
    readme = table(section(README.read_text(), title))
    docs = table(section((DOCS / "operations.md").read_text(), title))
    assert len(readme) == 7 and readme == docs
    assert "RabbitMQ 4.3 quorum queues" in readme[0] and "celery-redis-lua" in readme[0]
