"""reference/metrics.md: the fields of a metrics row (fedkey.federation.metrics_row), those of every row and
those an option asks for."""

from __future__ import annotations

from tools.reference_pages.markup import (
    GENERATED_NOTE,
    cell,
    code,
    described,
    details_sections,
    paragraphs,
    table,
)


def metrics_reference() -> str:
    """reference/metrics.md: the fields of a metrics row (fedkey.federation.metrics_row)."""
    from fedkey.federation import metrics_row

    details: list[tuple[str, str]] = []  # the descriptions too long for a cell, after the tables
    lines = [
        GENERATED_NOTE,
        "# Metrics rows",
        "",
        paragraphs(metrics_row.__doc__).split("\n\n")[0],
        "",
        "A run writes one row a round to `RUN_DIR/metrics.jsonl` (round 0 is the initial model); "
        "a server also answers them at `GET /v1/metrics`, with NaN and infinities as null. "
        "`fedkey ngram` writes one row, round 0, without the precision and device fields.",
        "",
        "## Every row",
        "",
        *table(
            ["field", "type", "meaning"],
            [
                [code(n), cell(f.type), described(n, f.description, details)]
                for n, f in metrics_row.ALWAYS.items()
            ],
        ),
        "",
        "## When an option asks for them",
        "",
        *table(
            ["field", "type", "when", "meaning"],
            [
                [code(n), cell(f.type), f.when, described(n, f.description, details)]
                for n, f in metrics_row.CONDITIONAL.items()
            ],
        ),
        "",
    ]
    if details:
        lines += ["## In full", "", *details_sections(details)]
    return "\n".join(lines)
