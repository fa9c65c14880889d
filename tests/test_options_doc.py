"""docs/configuration.md's options table: generated from TransportOptions (scripts/optionsdoc.py)
and current, one row per option of the code, and nothing else. No mkdocs needed: the site
itself is built by `make docs` (CI runs it)."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from celery_redis_lua.protocol.options import TransportOptions
from scripts import optionsdoc


def page() -> str:
    return optionsdoc.PAGE.read_text()


def region(text: str) -> str:
    return text.split(optionsdoc.START, 1)[1].split(optionsdoc.END, 1)[0]


def rows(text: str) -> dict[str, list[str]]:
    """option name -> its row's cells, from the generated region's table."""
    found: dict[str, list[str]] = {}
    for line in region(text).splitlines():
        match = re.fullmatch(r"\| `([a-z_]+)` \| (.*) \|", line)
        if match:
            assert match.group(1) not in found, f"{match.group(1)} has two rows"
            found[match.group(1)] = match.group(2).split(" | ")
    return found


def test_the_options_table_is_what_the_generator_writes_now() -> None:
    assert page() == optionsdoc.updated(page()), \
        "docs/configuration.md's options table is stale: run make docs"


def test_every_option_of_the_code_has_a_row_and_nothing_else_does() -> None:
    documented = rows(page())
    assert list(documented) == [f.name for f in fields(TransportOptions)]


def test_each_row_says_the_code_s_type_default_and_meaning() -> None:
    documented = rows(page())
    for f in fields(TransportOptions):
        kind, default, meaning = documented[f.name]
        assert kind == optionsdoc.type_text(str(f.type)), f.name
        assert default == optionsdoc.default_text(f.default), f.name
        assert meaning == f.metadata["doc"] and meaning.strip(), f.name
    assert documented["visibility_timeout"][1] == "`300`"
    assert documented["sep"][1] == '`"\\x06\\x16"`'
    assert documented["delivery_limit"][0] == "`int` or `None`"


def test_no_option_row_outside_the_generated_table() -> None:
    text = page()
    outside = text.replace(region(text), "")
    assert not re.search(r"^\| `[a-z_]+` \|", outside, flags=re.M), \
        "an options row outside the generated table"


def test_a_stale_page_is_caught() -> None:
    """A renamed row, and a row of an option the code no longer has, are both rewritten."""
    fresh = optionsdoc.updated(page())
    renamed = fresh.replace("| `visibility_timeout` |", "| `visibility_timeout_s` |")
    extra = fresh.replace(optionsdoc.END, "| `no_such_option` | `int` | `1` | gone |\n\n" + optionsdoc.END)
    for stale in (renamed, extra):
        assert stale != fresh and optionsdoc.updated(stale) == fresh


def test_an_option_without_a_description_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    f = next(f for f in fields(TransportOptions) if f.name == "sep")
    monkeypatch.setattr(f, "metadata", {})
    with pytest.raises(ValueError, match=r"TransportOptions\.sep needs a default and a doc"):
        optionsdoc.table()
