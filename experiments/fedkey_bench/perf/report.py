"""The report of `fedkey-bench perf`: one folder per machine with its perf.json (every figure),
and one page beside them, results.md, with every machine's figures against the targets side by
side and then each machine's tables.

    experiments/results/perf/<machine>/perf.json    what `fedkey-bench perf --out` there wrote
    experiments/results/perf/results.md             every machine's (`python -m fedkey_bench.perf.report DIR`)

No torch here: the report is written (and tested) from a plain result dict, the one
`fedkey_bench.perf.runner.run_perf` builds: {"meta": {...}, "params": {...}, "steps": {name: figures, or
{"skipped": reason}, or {"error": message}}}.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from fedkey_bench.common.checkout import RESULTS, shown
from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.perf.sections import SECTIONS
from fedkey_bench.perf.targets import targets

#: The steps of `fedkey-bench perf`, in the order they run (also the names --skip takes).
STEPS = tuple(step for step, _, _ in SECTIONS)


def _not_run(result: dict, name: str) -> str | None:
    """The one line of a step not measured (not run, skipped, failed), or None."""
    s = result.get("steps", {}).get(name)
    if s is None:
        return "not run"
    if "skipped" in s:
        return f"skipped: {s['skipped']}"
    if "error" in s:
        return f"**failed**: `{s['error'].strip().splitlines()[-1] if s['error'].strip() else ''}`"
    return None


def _kept_line(result: dict) -> list[str]:
    """The header's line on the steps this command skipped whose earlier figures it kept."""
    kept = [f"{n} ({k['date']}, commit `{(k.get('git_commit') or '?')[:10]}`)"
            for n, s in result.get("steps", {}).items() if (k := s.get("kept"))]  # fmt: skip
    return [f"Kept from earlier runs, not measured by this command: {', '.join(kept)}."] * bool(
        kept
    )


def _header(result: dict) -> list[str]:
    """A machine's command, machine and kept steps, then its targets."""
    meta = result.get("meta", {})
    m = meta.get("machine", {})
    seconds = meta.get("seconds")
    return [
        "# fedkey performance benchmark",
        "",
        f"`{shown(meta.get('command', 'fedkey-bench perf'))}` on {meta.get('date', '?')}, commit "
        f"`{meta.get('git_commit', '?')}`{' (with uncommitted changes)' if meta.get('git_dirty') else ''}.",
        f"Machine: {m.get('cpus', '?')} CPUs ({m.get('cpu_model', '?')}), torch "
        f"{m.get('torch', '?')}, device {m.get('device', '?')}, Python {m.get('python', '?')}. "
        f"Total {'-' if seconds is None else f'{seconds:.0f}'} s. Every figure is in `perf.json`.",
        *_kept_line(result),
        "",
        "## Targets",
        "",
        markdown_table(
            ["measure", "figure", "target", "status"],
            [[r["measure"], r["figure"], r["target"], r["status"]] for r in targets(result)],
        ),
        "",
        "Speed ratios are measured side by side in one run, interleaved, and compare the best "
        "repeat of each: the machine is shared and noisy. Peak memory is the whole process's "
        "peak RSS (VmHWM).",
    ]


def _failures(result: dict) -> list[str]:
    """Each failed step's error in full."""
    steps = result.get("steps", {})
    failed = [n for n, s in steps.items() if "error" in s]
    out = ["", "## Failures", ""] if failed else []
    for n in failed:
        out += [f"### {n}", "", "```", steps[n]["error"].rstrip(), "```", ""]
    return out


def markdown(result: dict) -> str:
    """One machine's page: its header and targets, then a section per step (a step not
    measured: why), then the failures."""
    out = _header(result)
    for number, (step, title, section) in enumerate(SECTIONS, 1):
        out += ["", f"## {number}. {title}", ""]
        note = _not_run(result, step)
        out += [note] if note else section(result)
    out += _failures(result)
    return "\n".join(out).rstrip() + "\n"


QUESTION = (
    "Does fedkey meet its performance targets: its trainer against a bare PyTorch loop, HTTP "
    "against in-process, aggregation memory, suggestion latency, the int8 model, bf16, the Ray "
    "phone host, a round's phones stacked on a GPU?"
)


#: "(1000 keystrokes)" and a skipped step's "(- keystrokes)": one row of the side-by-side table.
KEYSTROKES = re.compile(r"\((?:\d+|-) keystrokes\)")


def _cell(row: dict) -> str:
    """A machine's figure of one target, its verdict first."""
    if row["status"] in ("met", "not met"):
        return f"{row['status']}: {row['figure']}"
    return str(row["status"])


def _machine(result: dict) -> str:
    m = result.get("meta", {}).get("machine", {})
    return (f"{m.get('cpus', '?')} CPUs ({m.get('cpu_model', '?')}), device "
            f"{m.get('device', '?')}, torch {m.get('torch', '?')}")  # fmt: skip


def _details(result: dict) -> list[str]:
    """markdown(result) below its targets (the page has them side by side), a level down."""
    text = markdown(result)
    lines = text.split("\n## Targets", 1)[0].splitlines()[2:]  # the command, machine, kept
    start = text.find("\n## 1. ")
    sections = re.split(r"\n(?=## )", text[start:].strip()) if start >= 0 else []
    measured, skipped = [], []
    for section in sections:
        title, _, rest = section.partition("\n")
        if rest.strip().startswith(("skipped", "not run")) and "\n" not in rest.strip():
            skipped.append(f"- {title.removeprefix('## ')}: {rest.strip()}")
        else:
            measured += ["", "#" + section]
    if skipped:
        lines += ["", "Not measured here:", "", *skipped]
    return [*lines, *measured]


def page(machines: dict[str, dict]) -> str:
    """results.md: every machine's figures against the targets side by side, then each
    machine's tables. `machines`: folder name -> its perf.json."""
    names = sorted(machines, key=lambda n: (n != "cpu", n))
    rows: dict[str, dict] = {}  # measure -> {"target": ..., name: cell}
    for name in names:
        result = machines[name]
        for row in targets(result):  # today's targets, from the figures it recorded
            key = KEYSTROKES.sub("keystrokes)", row["measure"])  # a skipped step counts "-"
            rows.setdefault(key, {"measure": row["measure"], "target": row["target"]})
            rows[key][name] = _cell(row)
    out = [
        "# fedkey-bench perf: the system against its performance targets",
        "",
        QUESTION,
        "",
        "## Targets",
        "",
        markdown_table(
            ["measure", "target", *names],
            [[r["measure"], r["target"], *(r.get(n, "-") for n in names)] for r in rows.values()],
        ),
        "",
        "Speed ratios are measured side by side in one run, interleaved, and compare the best "
        "repeat of each: the machine is shared and noisy. Peak memory is the whole process's "
        "peak RSS (VmHWM). Skipped: not measured on that machine (no GPU, or left out by "
        "--skip / --only).",
        "",
        "## Machines",
        "",
        markdown_table(
            ["machine", "what it is", "date", "commit", "figures"],
            [
                [
                    n,
                    _machine(machines[n]),
                    machines[n].get("meta", {}).get("date", "?"),
                    f"`{(machines[n].get('meta', {}).get('git_commit') or '?')[:10]}`",
                    f"[`{n}/perf.json`]({n}/perf.json)",
                ]
                for n in names
            ],
        ),  # fmt: skip
        "",
        "Each machine's command, its parameters and every repeat are in its perf.json. A new "
        "machine: `fedkey-bench perf --out experiments/results/perf/<machine>`; the page is "
        "rebuilt from every perf.json here (`python -m fedkey_bench.perf.report experiments/results/perf`).",
    ]
    for name in names:
        out += ["", f"## {name}: {_machine(machines[name])}", "", *_details(machines[name])]
    return "\n".join(out).rstrip() + "\n"


def rebuild(folder: str | Path) -> Path:
    """FOLDER/results.md from every FOLDER/<machine>/perf.json; -> its path."""
    folder = Path(folder)
    machines = {p.parent.name: json.loads(p.read_text()) for p in folder.glob("*/perf.json")}
    path = folder / "results.md"
    path.write_text(page(machines))
    return path


def write_report(result: dict, out: str | Path) -> tuple[Path, Path]:
    """Write `<out>/perf.json` (OUT: this machine's folder, e.g. experiments/results/perf/cpu)
    and rebuild the page beside the machines' folders, `<out>/../results.md`; their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "targets": targets(result)}
    json_path = out / "perf.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    return json_path, rebuild(out.parent)


if __name__ == "__main__":  # python -m fedkey_bench.perf.report experiments/results/perf
    print(rebuild(sys.argv[1] if len(sys.argv) > 1 else RESULTS / "perf"))
