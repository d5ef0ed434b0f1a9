"""README.md stays a front page: short, every relative link it makes leads somewhere, no commit
hashes; and no tracked Markdown page grows past 40 KB (history and measurements belong in
experiments/results/<name>/results.json, not in pages a reader scrolls)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
MAX_MARKDOWN_BYTES = 40 * 1024
# [text](target) and ![alt](target); a target may be followed by a "title".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*(?:<([^>]+)>|([^)\s]+))(?:\s+\"[^\"]*\")?\s*\)")
# The reference pages are written at build time (the mkdocs hook tools/docs_reference.py and its
# modules), not kept: a link to one counts where tools/ names the page.
TOOLS = ROOT / "tools"


def relative_links(text: str) -> list[str]:
    targets = [m.group(1) or m.group(2) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_links_are_found():
    text = 'See [a](docs/a.md#x), ![b](img/b.png "t"), [c](https://x.org/c.md), [d](#top), [e](<f g.md>).'
    assert relative_links(text) == ["docs/a.md#x", "img/b.png", "f g.md"]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_every_relative_link_of_the_readme_exists():
    generated = "\n".join(p.read_text(encoding="utf-8") for p in TOOLS.rglob("*.py"))
    missing = []
    for target in relative_links(README.read_text(encoding="utf-8")):
        path = unquote(target.split("#", 1)[0])
        if not path or (README.parent / path).exists():
            continue
        rel = Path(path)
        if rel.parts[:2] == ("docs", "reference") and f'"{rel.relative_to("docs")}"' in generated:
            continue  # a page `make docs` writes
        missing.append(target)
    assert not missing, f"README.md links to what does not exist: {missing}"


def test_readme_names_no_commit():
    hashes = [
        h
        for h in re.findall(r"\b[0-9a-f]{7,40}\b", README.read_text(encoding="utf-8"))
        if re.search(r"[a-f]", h) and re.search(r"[0-9]", h)
    ]
    assert not hashes, f"README.md names commits: {hashes}"


def test_no_tracked_markdown_page_is_over_40_kb():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(
        ["git", "ls-files", "-z", "*.md"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    big = {}
    for name in filter(None, (n.decode() for n in names)):
        path = ROOT / name
        if "data" in Path(name).parts or not path.is_file():
            continue
        if (size := path.stat().st_size) > MAX_MARKDOWN_BYTES:
            big[name] = size
    assert not big, f"Markdown pages over {MAX_MARKDOWN_BYTES // 1024} KB: {big}"


def results_rows(text: str) -> list[tuple[str, list[str]]]:
    """The rows of the README's Results table: (what the row says, the pages it links to)."""
    section = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "](" in line]
    return [(row, relative_links(row)) for row in rows]


def test_every_headline_figure_is_on_its_page():
    """Each number of a Results row is quoted from a page the row links to."""
    rows = results_rows(README.read_text(encoding="utf-8"))
    assert 4 <= len(rows) <= 6, f"{len(rows)} headline rows"
    unquoted = {}
    for row, pages in rows:
        assert pages, row
        texts = [(README.parent / p).read_text(encoding="utf-8") for p in pages]
        cells = row.split(" | ")[:2]  # what the row says; the last cell holds the links
        figures = re.findall(r"\d+(?:,\d{3})*(?:\.\d+)?", " ".join(cells))
        if missing := [f for f in figures if not any(f in t for t in texts)]:
            unquoted[cells[0].strip("| ")] = missing
    assert not unquoted, f"figures not found on the linked pages: {unquoted}"
