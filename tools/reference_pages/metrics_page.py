"""reference/metrics.md: the fields of a metrics row (server.metrics_row), those of every row and
those an option asks for."""

from __future__ import annotations

from tools.reference_pages.markup import GENERATED_NOTE, cell, code, paragraphs


def metrics_reference() -> str:
    """reference/metrics.md: the fields of a metrics row (server.metrics_row)."""
    from server import metrics_row

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
        "| field | type | meaning |",
        "|---|---|---|",
    ]
    for name, field in metrics_row.ALWAYS.items():
        lines.append(f"| {code(name)} | {cell(field.type)} | {cell(field.description)} |")
    lines += [
        "",
        "## When an option asks for them",
        "",
        "| field | type | when | meaning |",
        "|---|---|---|---|",
    ]
    for name, field in metrics_row.CONDITIONAL.items():
        lines.append(
            f"| {code(name)} | {cell(field.type)} | {field.when} | {cell(field.description)} |"
        )
    lines.append("")
    return "\n".join(lines)
