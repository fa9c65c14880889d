"""The README is a front door and docs/ a site (mkdocs.yml; `make docs` builds it with
--strict, CI runs that): what can be checked without mkdocs is checked here. The README
stays short, its relative links lead to files of the repository, every page of docs/ is in
the site's nav, and the flow-control table the README keeps is the one the operations page
shows, and the mkdocs hook (scripts/mkdocs_hooks.py) turns only links to files that exist
in the repository into text."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

from scripts import mkdocs_hooks

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


def without_docstring(tree: ast.Module) -> str:
    body = tree.body[1:] if tree.body and isinstance(tree.body[0], ast.Expr) \
        and isinstance(tree.body[0].value, ast.Constant) else tree.body
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def test_the_readme_s_app_is_the_example_s_code_and_says_where_it_reads_its_urls() -> None:
    """Issue 42 §1.8: the README showed a broker URL with port 6390 hard-coded, while
    examples/minimal/tasks.py reads CELERY_BROKER_URL (only its docstring said so)."""
    app = section(README.read_text(), "A Celery app")
    [code] = re.findall(r"```python\n(.*?)```", app, flags=re.S)
    example = (ROOT / "examples" / "minimal" / "tasks.py").read_text()
    assert without_docstring(ast.parse(code)) == without_docstring(ast.parse(example)), \
        "the README's app is not examples/minimal/tasks.py's code"
    getting_started = section((DOCS / "getting-started.md").read_text(), "A first run, start to end")
    for text in (app, getting_started):
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        assert "`CELERY_BROKER_URL`" in prose and "`CELERY_RESULT_BACKEND`" in prose
        assert re.search(r"^export CELERY_BROKER_URL=redislua://\S+$", text, flags=re.M)
        assert re.search(r"^export CELERY_RESULT_BACKEND=redis://\S+$", text, flags=re.M)


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
    assert len(readme) == 12 and readme == docs
    assert "RabbitMQ 4.3 quorum queues" in readme[0] and "celery-redis-lua" in readme[0]


def test_the_scripts_table_of_the_internals_page_names_every_script() -> None:
    """A script added to lua/ must reach the overview a reader meets first (it once lacked
    eight); the full contract is the generated docs/scripts.md."""
    listed = set(re.findall(r"`(\w+)`", "\n".join(table(section((DOCS / "internals.md").read_text(),
                                                                 "The scripts")))))
    assert sorted(p.stem for p in (ROOT / "lua").glob("*.lua") if p.stem not in listed) == []


def test_links_out_of_docs_become_text_only_when_their_target_exists() -> None:
    page = DOCS / "scripts.md"

    def rewrite(text: str, target: str, repo_url: str | None = None) -> str | None:
        return mkdocs_hooks.outside_target(text, target, page, DOCS, repo_url)

    assert rewrite("`lua/ack.lua`", "../lua/ack.lua") == "`lua/ack.lua`"
    assert rewrite("the example", "../examples/compose/") == "the example (`examples/compose/`)"
    assert rewrite("records", "bench/") == "records (`docs/bench/`)"  # a folder of the site
    assert rewrite("ack", "../lua/ack.lua", "https://example.org/crl") == \
        "[ack](https://example.org/crl/blob/HEAD/lua/ack.lua)"
    # Left to mkdocs, which validates them (or reports them as broken):
    assert rewrite("ops", "operations.md#flower") is None
    assert rewrite("gone", "../lua/no_such.lua") is None
    assert rewrite("outside", "../../shared/x.md") is None
    assert rewrite("site", "https://example.org/") is None


def test_the_hook_leaves_code_blocks_alone() -> None:
    page = SimpleNamespace(file=SimpleNamespace(abs_src_path=str(DOCS / "index.md"), src_path="index.md"))
    markdown = "See [`lua/ack.lua`](../lua/ack.lua).\n\n```sh\necho '[x](../lua/ack.lua)'\n```\n"
    done = mkdocs_hooks.on_page_markdown(markdown, page, {"docs_dir": str(DOCS), "repo_url": None}, None)
    assert done == "See `lua/ack.lua`.\n\n```sh\necho '[x](../lua/ack.lua)'\n```\n"
