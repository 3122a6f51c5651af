"""The docs' own links: every relative link in README.md and docs/**/*.md reaches a file of the repo, and every
``#anchor`` a heading of its target (GitHub's slugs, as markdown-it's anchors plugin makes them); the README stays a
front door, and every page of docs/ can be reached from docs/README.md; every equation the notebooks teach is one hop from its code."""
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from mdit_py_plugins.anchors import anchors_plugin

from flowlib.infra.runs import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
README_MAX_BYTES = 10_240  # the front door: what it is, quick start, results at a glance; the rest lives in docs/
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


def test_the_readme_stays_a_front_door():
    size = len((REPO_ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail into docs/ "
                                      "and link it")
    headings = [t.content for t in _tokens(REPO_ROOT / "README.md") if t.type == "inline" and t.level == 1]
    for needed in ("Quick start", "Results at a glance", "Notebooks", "Layout"):
        assert needed in headings, f"README.md lacks its '{needed}' section"


def test_every_docs_page_is_reachable_from_the_docs_index():
    seen, todo = set(), [REPO_ROOT / "docs" / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo += [(page.parent / h.partition("#")[0]).resolve() for h in relative_links(page) if h.partition("#")[0]]
    orphans = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "docs").rglob("*.md") if p.resolve() not in seen)
    assert not orphans, f"link these from docs/README.md (or a page it links): {orphans}"


EQUATION_ROW = re.compile(r"^\| (\d\d) \|.*\| `(flowlib\.[\w.]+)` \|$")


def _is_module(dotted: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:  # a parent is not a package (flowlib.flows.models.ShortCut)
        return False


def test_every_equation_in_the_table_names_a_function_that_exists_and_its_notebook_names_it():
    """docs/architecture.md's equation -> code table: one hop from a notebook's equation to the code that computes it."""
    import importlib

    rows = [m.groups() for line in (REPO_ROOT / "docs" / "architecture.md").read_text().splitlines()
            if (m := EQUATION_ROW.match(line))]
    assert len(rows) >= 15, "the equation table in docs/architecture.md lost its rows"
    for notebook, name in rows:
        parts = name.split(".")
        i = next(i for i in range(len(parts), 0, -1) if _is_module(".".join(parts[:i])))
        obj = importlib.import_module(".".join(parts[:i]))  # the module that defines it, then attributes
        for a in parts[i:]:
            assert hasattr(obj, a), f"docs/architecture.md names {name}, which does not exist: fix the table"
            obj = getattr(obj, a)
        assert callable(obj), f"{name} is not a function or class"
        [path] = (REPO_ROOT / "notebooks").glob(f"{notebook}_*.py")
        assert f"`{name}`" in path.read_text(), f"{path.name} teaches the equation of {name} without naming it"


RESULTS_PAGES = [p for p in sorted((REPO_ROOT / "docs" / "results").glob("*.md")) if p.name != "README.md"]
GPU = re.compile(r"\b(H100|H200)")  # the kinds of GPU machine lent to this project (others are cited, not run)


def machine_problems(page: Path, lent: str) -> list[str]:
    """One truth per fact: ``page`` names its machines in a ``*Machines: ...*`` line within its first lines, names
    there every GPU it reports on, and each of those GPUs is in ``lent`` (the results index's list of lent
    machines); an undated 'no GPU was lent' is a claim some other page contradicts."""
    text, name = page.read_text(), page.relative_to(REPO_ROOT) if page.is_relative_to(REPO_ROOT) else page
    head = [line for line in text.splitlines()[:12] if line.startswith("*Machines:")]
    if not head:
        return [f"{name}: no '*Machines: ...*' line in its first 12 lines naming the machines its runs used"]
    problems = [f"{name}: reports on an {g} that its Machines line does not name"
                for g in sorted(set(GPU.findall(text)) - set(GPU.findall(head[0])))]
    problems += [f"{name}: its Machines line names an {g} that docs/results/README.md's list of lent machines does not"
                 for g in sorted(set(GPU.findall(head[0])) - set(GPU.findall(lent)))]
    problems += [f"{name}: '{m.group(0)}...' says no GPU was ever lent; date it ('no GPU was lent on 2026-12-04')"
                 for m in re.finditer(r"[Nn]o GPU (?:was|has been) lent(?!\s+on\s+\d{4}-\d\d-\d\d)", text)]
    return problems


@pytest.mark.parametrize("page", [*RESULTS_PAGES, REPO_ROOT / "docs" / "fast_tasks.md"],
                         ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_results_page_names_its_machines_as_the_results_index_lists_them(page):
    lent = (REPO_ROOT / "docs" / "results" / "README.md").read_text().partition("## Machines")[2]
    assert lent, "docs/results/README.md has no '## Machines' section listing the machines lent"
    assert machine_problems(page, lent) == []


def test_a_page_that_hides_a_gpu_or_says_none_was_ever_lent_is_caught(tmp_path):
    page = tmp_path / "docs" / "results" / "x.md"
    page.parent.mkdir(parents=True)
    page.write_text("# X\n\n*Machines: the 2-core CPU machine.*\n\nOn an H200 it took 3 s. No GPU was lent to this work.\n")
    problems = machine_problems(page, "one H100")
    assert any("H200 that its Machines line does not name" in p for p in problems)
    assert any("says no GPU was ever lent" in p for p in problems)
    page.write_text("# X\n\nno machines line\n")
    assert "no '*Machines: ...*' line" in machine_problems(page, "")[0]
    page.write_text("# X\n\n*Machines: the CPU machine; one lent H200.*\n\nOn an H200 it took 3 s.\n")
    assert machine_problems(page, "one H200 on 2026-12-04") == []
