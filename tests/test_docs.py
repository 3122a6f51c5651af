"""The docs' own links: every relative link in README.md and docs/*.md reaches a file of the repo, and every
``#anchor`` a heading of its target (GitHub's slugs, as markdown-it's anchors plugin makes them)."""
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from mdit_py_plugins.anchors import anchors_plugin

from flowlib.runs import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
MD = MarkdownIt("commonmark").enable("table").use(anchors_plugin, max_level=6)


def _tokens(path: Path):
    return MD.parse(path.read_text())


def anchors(path: Path) -> set[str]:
    return {t.attrs["id"] for t in _tokens(path) if t.type == "heading_open"}


def relative_links(path: Path) -> list[str]:
    inline = [c for t in _tokens(path) if t.type == "inline" for c in (t.children or [])]
    hrefs = [str(c.attrs["href"]) for c in inline if c.type == "link_open"]
    return [h for h in hrefs if "://" not in h and not h.startswith("mailto:")]


def broken_links(path: Path) -> list[str]:
    broken = []
    for href in relative_links(path):
        target, _, anchor = href.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{href}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{href}: no heading with anchor #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_reach_a_file_and_a_heading(path):
    broken = broken_links(path)
    assert not broken, f"{path.name} has broken links (fix the link or the heading it names): {broken}"


def test_a_renamed_heading_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## The run: 0.91 (5 seeds)\n\nSee [it](b.md#the-run-091-5-seeds).\n")
    (tmp_path / "b.md").write_text("## The run: 0.91 (5 seeds)\n\n[back](a.md#title) [gone](a.md#old-name)\n")
    assert broken_links(tmp_path / "a.md") == []
    assert broken_links(tmp_path / "b.md") == ["a.md#old-name: no heading with anchor #old-name in a.md"]
    (tmp_path / "b.md").unlink()
    assert broken_links(tmp_path / "a.md")[0].startswith("b.md#the-run-091-5-seeds: no file")
