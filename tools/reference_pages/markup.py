"""The Markdown every reference page uses: the generated-page note, table cells, inline code and
help texts as paragraphs."""

from __future__ import annotations

import re

GENERATED_NOTE = "<!-- Generated at build time by tools/docs_reference.py from the code; not a file in docs/. -->"


def cell(text: object) -> str:
    """A value made safe for one cell of a Markdown table."""
    s = " ".join(str(text).split())
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def code(text: object) -> str:
    """Inline code for a table cell (Python-Markdown's tables split no cell at a pipe inside
    backticks, so none is escaped)."""
    s = " ".join(str(text).split())
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def paragraphs(text: str | None) -> str:
    """A docstring-style help text (hard-wrapped lines, blank lines between paragraphs) as
    Markdown paragraphs."""
    if not text:
        return ""
    parts = re.split(r"\n\s*\n", text.replace("\b", "").strip())
    return "\n\n".join(" ".join(p.split()) for p in parts)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines: the header, its rule, one line per row (cells already made safe
    with `cell` or `code`)."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
