"""mkdocs hooks (mkdocs.yml, `make docs`): links from docs/ to the rest of the repository.

A page may link to a file outside docs/ (``../lua/ack.lua``, ``../examples/compose/``) or to a
directory (``bench/``): on GitHub such a relative link opens the file or the folder, but the
site holds only docs/, so mkdocs would report each as a broken link. This hook rewrites such
a link only when its target exists in the repository: as its text and path, or, when
mkdocs.yml sets ``repo_url``, as a link to the file there. Any other link is left as it is,
so mkdocs' own validation reports a target that exists nowhere (``mkdocs build --strict``
fails on it), and checks links to pages and files inside docs/, anchors included.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def outside_target(text: str, target: str, page: Path, docs: Path, repo_url: str | None) -> str | None:
    """The replacement for a link to something outside the site, or None to leave it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None  # a URL, an anchor on this page, or an absolute path (mkdocs checks those)
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve()
    if resolved.is_relative_to(docs) and resolved.is_file():
        return None  # a page or a file of the site: mkdocs validates it
    root = docs.parent
    if not resolved.is_relative_to(root) or not resolved.exists():
        return None  # nowhere in the repository: mkdocs reports it
    relative = resolved.relative_to(root).as_posix() + ("/" if resolved.is_dir() else "")
    if repo_url:
        kind = "tree" if resolved.is_dir() else "blob"
        return f"[{text}]({repo_url.rstrip('/')}/{kind}/HEAD/{relative}{'#' + anchor if anchor else ''})"
    if relative.rstrip("/") in text:
        return text
    return f"{text} (`{relative}`)"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    source = Path(page.file.abs_src_path)
    docs = Path(config["docs_dir"]).resolve()
    repo_url = config.get("repo_url")
    out: list[str] = []
    fenced = False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        if not fenced:
            def replace(match: re.Match[str]) -> str:
                new = outside_target(match.group(1), match.group(2), source, docs, repo_url)
                return match.group(0) if new is None else new
            line = LINK.sub(replace, line)
        out.append(line)
    return "\n".join(out)
