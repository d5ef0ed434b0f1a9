"""The page of `fedkey-bench cohorts` (fedkey_bench.cohorts.runner): one table row per measured
row, then each distinct command; rebuilt from results.json alone:

    python -m fedkey_bench.cohorts.report experiments/results/cohorts
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fedkey_bench.common.checkout import RESULTS, shown


def markdown(rows: list[dict[str, Any]]) -> str:
    """results.md: one table row per measured row, then each distinct command."""
    head = ("| workload | model | phones/round | backend | phones a stack | phone-updates/s | "
            "per CPU-s | training phase (s) | CPU (s) | batches | peak RSS (MiB) | load at "
            "start | date |\n" + "|" + "---|" * 13 + "\n")  # fmt: skip
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['model']} | {r['phones']} | {r['backend']} | "
                         f"error: {r['error']} |" + " |" * 8)  # fmt: skip
            continue
        cells = [r["workload"], f"{r['model']} (h{r['hidden_size']})", r["phones"], r["backend"],
                 r["stack_phones"] or "", r["updates_per_s"], r["updates_per_cpu_s"],
                 r["seconds"], r["cpu_seconds"], r["batches"], r["peak_rss_mib"],
                 r["load_at_start"], r["date"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    commands = sorted({shown(r["command"]) for r in rows})
    return (
        "# Phone-updates per second by cohort size (`fedkey-bench cohorts`)\n\n"
        "One cohort of the Ubuntu IRC population (`--partition user`: one phone per sender) "
        "trained once, E=1, B=10, from the same initial weights; one torch thread. "
        "phone-updates/s: phones trained over the wall-clock seconds of the training phase; "
        "per CPU-s: over this process's CPU seconds (the machine is shared; load at start is "
        "its 1-minute load average). Rows of one date ran side by side.\n\n"
        + head
        + "\n".join(lines)
        + "\n\nCommands:\n\n"
        + "\n".join(f"    {c}" for c in commands)
        + "\n\nEvery row's figures and command: [results.json](results.json). Rebuild this page "
        "from it: `python -m fedkey_bench.cohorts.report experiments/results/cohorts`.\n"
    )


def rebuild(folder: Path) -> Path:
    """FOLDER/results.md from FOLDER/results.json; -> its path."""
    path = folder / "results.md"
    path.write_text(markdown(json.loads((folder / "results.json").read_text())["rows"]))
    return path


if __name__ == "__main__":
    print(rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "cohorts"))
