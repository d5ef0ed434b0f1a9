"""The Markdown every reference page uses: the generated-page note, table cells, inline code,
help texts as paragraphs, and long descriptions cut short for a table."""

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


#: A table cell longer than this holds only the description's opening; the whole of it follows the
#: table in a section of its own, so a table stays one line a row.
LONG_CELL = 300


def opening(text: str) -> str:
    """The opening of a long description: its first sentence, or, when that is long too, what
    comes before its first colon or parenthesis."""
    s = " ".join(text.split())
    depth = 0
    for i, ch in enumerate(s):
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "." and depth == 0 and (i + 1 == len(s) or s[i + 1] == " "):
            s = s[: i + 1]
            break
    if len(s) > LONG_CELL:
        cut = min((i for i in (s.find(":"), s.find(" (")) if i > 0), default=LONG_CELL)
        s = s[:cut].rstrip(" .,;") + "."
    return s


def described(name: str, text: str, details: list[tuple[str, str]]) -> str:
    """A table cell for `name`'s description `text`: the text itself, or, past LONG_CELL
    characters, its opening and a link to the whole, which is added to `details`."""
    if len(" ".join(text.split())) <= LONG_CELL:
        return cell(text)
    details.append((name, text))
    return f"{cell(opening(text))} [More](#field-{_anchor(name)})."


def details_sections(details: list[tuple[str, str]]) -> list[str]:
    """The sections that hold the long descriptions `described` cut short."""
    lines: list[str] = []
    for name, text in details:
        lines += [f"### `{name}` {{#field-{_anchor(name)}}}", "", paragraphs(text), ""]
    return lines


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
