"""The documentation: the site builds without a warning, and the README's links all land.

MkDocs checks the pages under docs/ (mkdocs.yml's ``validation``: pages left out of the nav,
links to missing files or anchors); the README is outside its docs_dir, so its links are
checked here: each relative one names a file that exists and, with ``#anchor``, a heading of
that file whose slug is the anchor on GitHub and on the site alike. The settings page's table
is held to the settings classes by tests/unit/test_settings.py.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIG = ROOT / "mkdocs.yml"

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\n]|\n(?!\n))*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without code blocks or code spans, where a link is only an example."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def heading_text(raw: str) -> str:
    """A heading as both renderers see it before slugging: no code marks, link text only."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"[`*_]", "", text)


def github_slug(heading: str) -> str:
    """GitHub's anchor: lower case, punctuation dropped, each space a hyphen (not folded)."""
    kept = "".join(c for c in heading.lower()
                   if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors that reach a heading of ``path`` both on GitHub and on the MkDocs site."""
    texts = [heading_text(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))]
    return {github_slug(t) for t in texts} & {slugify(t, "-") for t in texts}


def nav_pages(nav: list[object]) -> list[str]:
    pages: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages.extend(nav_pages(value) if isinstance(value, list) else [str(value)])
    return pages


def test_site_builds_strict_without_a_warning(tmp_path: Path) -> None:
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("mkdocs").addHandler(handler)
    try:
        build(load_config(str(CONFIG), strict=True, site_dir=str(tmp_path / "site")))
    except Abort as abort:
        pytest.fail(f"mkdocs build --strict: {abort}: {warnings}")
    finally:
        logging.getLogger("mkdocs").removeHandler(handler)
    assert warnings == []
    assert (tmp_path / "site" / "settings" / "index.html").is_file()


def test_every_page_is_in_the_nav_and_linked_from_the_readme() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    docs = ROOT / config["docs_dir"]
    pages = nav_pages(config["nav"])
    on_disk = {p.relative_to(docs).as_posix() for p in docs.glob("*.md")}
    assert sorted(pages) == sorted(on_disk)
    linked = {target.split("#", 1)[0] for target in links(README.read_text())}
    assert {f"docs/{page}" for page in pages} - linked == set()


def test_every_relative_link_of_the_readme_resolves() -> None:
    text = README.read_text()
    targets = [t for t in links(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
    assert len(targets) > 20  # the walk found the links
    broken = []
    for target in targets:
        file, _, anchor = target.partition("#")
        path = (README.parent / file) if file else README
        if not path.is_file():
            broken.append(f"{target}: no file {path.relative_to(ROOT)}")
        elif anchor and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor in {path.name}")
    assert broken == []


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    assert links("[a](x.md) `[b](y.md)`\n```\n[c](z.md)\n```\n![d](e.png)") == ["x.md", "e.png"]
    page = tmp_path / "p.md"
    page.write_text("# Results: the `paper`'s regime\n## 8 -> 2 -> 12\n```\n# not one\n```\n")
    assert anchors(page) == {"results-the-papers-regime"}  # "8 -> 2" differs: 8---2 vs 8-2
    assert nav_pages([{"A": "a.md"}, {"B": [{"C": "c.md"}, "d.md"]}]) == ["a.md", "c.md", "d.md"]
