"""The page of `fedkey-bench aggregation` (fedkey_bench.aggregation.runner): the answer against
the target first, then one table per run, from results.json alone (`fedkey-bench aggregation
--page`)."""

from __future__ import annotations

from fedkey_bench.common.checkout import shown, shown_path

#: The target: the aggregation at most this many times the read, at TARGET_UPLOADS uploads.
TARGET_RATIO, TARGET_UPLOADS = 3.0, 1000


def answer(runs: list[dict]) -> str:
    """The page's first line: this checkout's aggregation against the target, run by run."""
    parts = []
    for r in runs:
        ours = [
            row for row in r["rows"] if row["server"] == "this checkout" and row["what"] != "read"
        ]
        worst = max(ours, key=lambda row: row["per_read"], default=None)
        if worst is not None and r["uploads"] >= TARGET_UPLOADS:
            verdict = "within" if worst["per_read"] <= TARGET_RATIO else "over"
            parts.append(f"{worst['per_read']:.1f}x the read ({worst['cpu_per_read']:.1f}x its CPU "
                         f"seconds) at {r['uploads']:,} uploads of {r['parameters']:,} "
                         f"parameters ({verdict} the target, commit {str(r['git_commit'])[:10]})")  # fmt: skip
    if not parts:
        return f"No run of {TARGET_UPLOADS:,} uploads yet."
    return f"**The slower strategy's aggregation took {'; '.join(parts)}.**"


def page(runs: list[dict]) -> str:
    """results.md: the answer, then one table per run."""
    lines = [
        "# Aggregation against reading the uploads once",
        "",
        answer(runs),
        "",
        "The server's aggregation of one round at the default bound (cosine filter, trim 0.1,",
        "clip at the median; `bound_round` then the strategy), one torch thread as the server's",
        "aggregation process, against reading the same stored uploads once with safetensors",
        f"(page cache warm). Target: at most {TARGET_RATIO:g}x the read at {TARGET_UPLOADS:,} uploads.",
        "Every repeat's seconds: [results.json](results.json) (`all_seconds`).",
    ]
    for r in runs:
        mb = r["upload_bytes"] / 1e6
        lines += [
            "",
            f"## {r['uploads']} uploads of {r['parameters']:,} parameters ({mb:.1f} MB each)",
            "",
            f"`{shown(r['command'])}`, commit {str(r['git_commit'])[:10]}"
            + (f" (baseline {str(r['baseline_commit'])[:10]})" if r["baseline_commit"] else "")
            + f", {r['date']}, {r['machine']}; median of {r['repeats']}."
            + (f" {r['note']}" if r.get("note") else ""),
            "",
            "| server | what | seconds | x read | CPU seconds | x read's CPU | peak RSS (MB) |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            lines.append(
                f"| {shown_path(row['server'])} | {row['what']} | {row['seconds']:.2f} | "
                f"{row['per_read']:.2f} | {row['cpu_seconds']:.2f} | {row['cpu_per_read']:.2f} | "
                f"{row['peak_rss_mb']} |"
            )
    lines += [
        "",
        "Written by `fedkey-bench aggregation`; rebuild it from results.json with "
        "`fedkey-bench aggregation --page`.",
    ]
    return "\n".join(lines) + "\n"
