"""Markdown for the results pages."""

from __future__ import annotations


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
