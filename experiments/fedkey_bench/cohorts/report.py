"""The page of `fedkey-bench cohorts` (fedkey_bench.cohorts.runner): the answer first (phone-
updates per second and peak memory at 1,000 phones against the target), one table row per
measured row, how each row's resident set moved as its phones trained, then each distinct
command; rebuilt from results.json alone:

    python -m fedkey_bench.cohorts.report experiments/results/cohorts
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fedkey_bench.common.checkout import RESULTS, shown

#: The target: 1,000 phones a round at this many phone-updates a second or more ...
TARGET_PER_S = 100
#: ... in under 3 GB (10^9 bytes), in MiB.
TARGET_MIB = 3e9 / 2**20
TARGET_PHONES = 1000


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    """A row's figures under this runner's names (rows written before the rename kept)."""
    renamed = {"updates_per_s": "phone_updates_per_s",
               "updates_per_cpu_s": "phone_updates_per_cpu_s"}  # fmt: skip
    return {renamed.get(k, k): v for k, v in r.items()}


def _backend(r: dict[str, Any]) -> str:
    n = r.get("processes", 1)
    return r["backend"] + (f" x{n} processes" if n > 1 else "")


def lead(rows: list[dict[str, Any]]) -> str:
    """The answer: per model, the fastest row at TARGET_PHONES phones, whether it meets the
    target, and the other rows at that cohort."""
    ok = [r for r in rows if "error" not in r and r["phones"] == TARGET_PHONES]
    lines = []
    for model in sorted({r["model"] for r in ok}):
        mine = sorted((r for r in ok if r["model"] == model),
                      key=lambda r: -r["phone_updates_per_s"])  # fmt: skip
        best = mine[0]
        met = (best["phone_updates_per_s"] >= TARGET_PER_S
               and best["peak_rss_mib"] < TARGET_MIB)  # fmt: skip
        others = "; ".join(
            f"{_backend(r)} {r['phone_updates_per_s']:g}/s "
            f"({r['phone_updates_per_cpu_s']:g} per CPU-s), {r['peak_rss_mib']:,} MiB"
            for r in mine[1:]
        )
        lines.append(
            f"- **{model} (h{best['hidden_size']}), {TARGET_PHONES:,} phones a round: "
            f"{_backend(best)}, {best['phone_updates_per_s']:g} phone-updates/s "
            f"({best['phone_updates_per_cpu_s']:g} per CPU-second), peak RSS "
            f"{best['peak_rss_mib']:,} MiB** ({best.get('precision') or 'precision not recorded'}"
            f", {best['date']}): the target ({TARGET_PER_S} phone-updates/s, under 3 GB) "
            + ("met." if met else "not met.")
            + (f" Others: {others}." if others else "")
        )
    return "\n".join(lines)


def growth(r: dict[str, Any]) -> str:
    """A row's resident set after its first sample and at its end, MiB ('' if not sampled)."""
    samples = r.get("rss_mib_by_phones")
    if not samples:
        parts = r.get("parts") or []
        if parts and all(p.get("rss_mib_by_phones") for p in parts):
            first = sum(p["rss_mib_by_phones"][0][1] for p in parts)
            last = sum(p["rss_mib_by_phones"][-1][1] for p in parts)
            return f"{first:,} -> {last:,}"
        return ""
    return f"{samples[0][1]:,} ({samples[0][0]}) -> {samples[-1][1]:,} ({samples[-1][0]})"


def markdown(rows: list[dict[str, Any]], notes: list[str] | None = None) -> str:
    """results.md: the answer (and results.json's `notes`, paragraphs under it), one table row
    per measured row, then each distinct command."""
    rows = [_figures(r) for r in rows]
    head = ("| workload | model | phones/round | backend | precision | phones a stack | "
            "phone-updates/s | per CPU-s | training phase (s) | CPU (s) | batches | "
            "peak RSS (MiB) | RSS after load (MiB) | RSS first sample -> end (MiB, at phones) | "
            "load at start | date |\n" + "|" + "---|" * 16 + "\n")  # fmt: skip
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['model']} | {r['phones']} | {_backend(r)} | "
                         f"error: {r['error']} |" + " |" * 11)  # fmt: skip
            continue
        cells = [r["workload"], f"{r['model']} (h{r['hidden_size']})", r["phones"], _backend(r),
                 r.get("precision") or "", r["stack_phones"] or "", r["phone_updates_per_s"],
                 r["phone_updates_per_cpu_s"], r["seconds"], r["cpu_seconds"], r["batches"],
                 r["peak_rss_mib"], r["rss_after_load_mib"], growth(r), r["load_at_start"],
                 r["date"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    commands = sorted({shown(r["command"]) for r in rows})
    return (
        "# Phone-updates per second by cohort size (`fedkey-bench cohorts`)\n\n"
        + lead(rows)
        + "".join(f"\n\n{n}" for n in notes or [])
        + "\n\nOne cohort of the Ubuntu IRC population (`--partition user`: one phone per sender) "
        "trained once, E=1, B=10, from the same initial weights; one torch thread a process. "
        "phone-updates/s: phones trained over the wall-clock seconds of the training phase; "
        "per CPU-s: over the training processes' CPU seconds (the machine is shared; load at "
        "start is its 1-minute load average). `x2 processes`: the cohort split between two "
        "processes side by side (balanced by each phone's words), started together; their CPU "
        "seconds, peak RSS and RSS summed. precision: what `auto` resolved to on the machine "
        "(bf16 where the CPU has native bf16). RSS is sampled after every 100 phones: a row "
        "whose memory grew with the phones it trained shows it in the first-sample -> end "
        "column. Rows of one date ran side by side.\n\n"
        + head
        + "\n".join(lines)
        + "\n\nCommands:\n\n"
        + "\n".join(f"    {c}" for c in commands)
        + "\n\nEvery row's figures, its RSS after every 100 phones and its command: "
        "[results.json](results.json). Rebuild this page from it: "
        "`python -m fedkey_bench.cohorts.report experiments/results/cohorts`.\n"
    )


def rebuild(folder: Path) -> Path:
    """FOLDER/results.md from FOLDER/results.json; -> its path."""
    path = folder / "results.md"
    saved = json.loads((folder / "results.json").read_text())
    path.write_text(markdown(saved["rows"], saved.get("notes")))
    return path


if __name__ == "__main__":
    print(rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "cohorts"))
