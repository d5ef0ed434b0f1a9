"""Runs made by hand beside a bench: what results.md says of `<results folder>/manual/`.

A question the bench's suites do not ask yet (FedAvg with dropout at the gpu protocol, on the CPU,
before a GPU was lent) is answered with one `fedkey simulate` or `fedkey train-central` run, and
its metrics rows are committed as `manual/<name>.metrics.jsonl` with its command line in
`manual/<name>.command.txt`. The bench never reads them; the report lists them in a section of
their own, beside the preset whose protocol they share, so a reader of results.md sees where the
best measured number stands and not only the best the bench has run (issue 18: "report where we
stand").
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from bench.paper import _finite
from bench.paper_tables import _f
from bench.presets import Preset
from bench.report import markdown_table
from bench.runs import PLACE_FLAGS  # where or how a run ran: left out of "what differs"

#: A ranking preset and the hand-made runs in its results folder (what results.md reports).
Manual = tuple[Preset, list[dict]]


def flags_of(cmd: str) -> dict[str, str]:
    """A fedkey command line's flags and their values ("" for a switch), the last one winning."""
    words = shlex.split(cmd)
    flags: dict[str, str] = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else ""
            flags[w] = "" if nxt.startswith("--") else nxt
    return flags


def protocol(preset: Preset, central: bool) -> dict[str, str]:
    """The flags a run must share with `preset`'s C 0.1 runs to be at its protocol (a federated
    run: its rounds, E, B, momentum, vocabulary, phones; a centralized one: the epochs that see
    as many examples as C 0.1). The learning rates are free: they are what a run tries."""
    base = {"--paper-protocol": "", "--vocab-size": str(preset.vocab_size), "--batch-size": "10",
            "--momentum": "0.5", "--clients": "100"}  # fmt: skip
    if central:
        return {**base, "--epochs": str(preset.central_epochs_for(0.1))}
    return {**base, "--rounds": str(preset.rounds), "--local-epochs": str(preset.local_epochs),
            "--fraction": "0.1"}  # fmt: skip


def summarize_manual(rows: list[dict], cmd: str, preset: Preset) -> dict:
    """One hand-made run from its metrics rows: the model with the best validation perplexity
    (after the initial model) and its test scores, the rounds (or epochs) done of those asked,
    whether it is at `preset`'s protocol, and what in it differs from that protocol."""
    flags = flags_of(cmd)
    central = bool(rows) and rows[0].get("strategy") == "central"
    scored = [r for r in rows if r.get("round", 0) >= 1]
    best = min(scored, key=lambda r: _finite(r.get("val_ppl")), default=None)
    want = protocol(preset, central)
    usual = {**want, "--ksr-sentences": str(preset.ksr_sentences), "--seed": "0"}
    own = {k: v for k, v in flags.items() if k not in PLACE_FLAGS and k != "--data"}
    return {
        "kind": "central" if central else "federated",
        "at_protocol": bool(cmd) and all(flags.get(k) == v for k, v in want.items()),
        "what": " ".join(f"{k} {v}".strip() for k, v in own.items() if usual.get(k) != v),
        "data": Path(flags["--data"]).name if flags.get("--data") else "-",
        "done": rows[-1].get("round", 0) if rows else 0,
        "of": int(flags.get("--epochs" if central else "--rounds", "0") or 0),
        "last_val_ppl": rows[-1].get("val_ppl") if rows else None,
        "best_round": best["round"] if best else None,
        "best_val_ppl": best.get("val_ppl") if best else None,
        "test_ppl": best.get("test_ppl") if best else None,
        "top1": best.get("top1") if best else None,
        "top3": best.get("top3") if best else None,
        "ksr": best.get("ksr") if best else None,
        "device": rows[-1].get("eval_device") if rows else None,
        "seconds": sum(r.get("seconds") or 0.0 for r in rows),
    }


def manual_runs(folder: Path, preset: Preset) -> list[dict]:
    """Every `folder/manual/*.metrics.jsonl` summarized (:func:`summarize_manual`), by name; a
    run without its `.command.txt` is listed with what its rows say, never at the protocol."""
    runs = []
    for path in sorted((folder / "manual").glob("*.metrics.jsonl")):
        name = path.name.removesuffix(".metrics.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        command = path.with_name(f"{name}.command.txt")
        cmd = command.read_text().strip() if command.exists() else ""
        runs.append({"name": name, "command": cmd, **summarize_manual(rows, cmd, preset)})
    return runs


def best_at_protocol(runs: list[dict], dataset: str) -> dict | None:
    """The federated hand-made run at the preset's protocol (C 0.1) with the lowest test
    perplexity on `dataset`, or None."""
    fed = [r for r in runs if r["kind"] == "federated" and r["at_protocol"]
           and r["data"] == dataset and r["test_ppl"] is not None]  # fmt: skip
    return min(fed, key=lambda r: _finite(r["test_ppl"]), default=None)


def _short(v: float | None) -> str:
    """A perplexity in whole numbers; one that has blown up (1e6 or more) as a power of ten."""
    return _f(v, ".0f" if v is None or v < 1e6 else ".1e")


def manual_section(runs: list[dict], preset: Preset) -> list[str]:
    """results.md's section on the hand-made runs (nothing when there are none)."""
    if not runs:
        return []
    header = ["run", "data", f"at the `{preset.name}` protocol", "what differs", "done",
              "best val ppl (at)", "test ppl", "top-1", "top-3", "KSR", "device"]  # fmt: skip
    unit = {"central": "epoch", "federated": "round"}
    rows = [[f"`{r['name']}`", r["data"], "yes" if r["at_protocol"] else "no",
             f"{r['kind']}: `{r['what']}`" if r["what"] else r["kind"],
             f"{r['done']} of {r['of'] or '?'}" + (f", last val {_short(r['last_val_ppl'])}"
                                                   if r["done"] != r["of"] else ""),
             f"{_f(r['best_val_ppl'])} ({unit[r['kind']]} {r['best_round']})",
             _f(r["test_ppl"]), _f(r["top1"], ".3f"), _f(r["top3"], ".3f"), _f(r["ksr"], ".3f"),
             r["device"] or "-"]
            for r in sorted(runs, key=lambda r: _finite(r["test_ppl"]))]  # fmt: skip
    return [
        "",
        "## Runs outside the bench (`manual/`)",
        "",
        "Single runs made by hand to ask what the suites do not ask yet; the bench never reads "
        "them. At the protocol: the run shares the preset's rounds, E, B, momentum, vocabulary "
        "and phones at C 0.1 (a centralized run: its epochs at C 0.1); what differs: its own "
        "flags beyond that protocol (where and how it ran left out); a run stopped before its "
        "end shows its last validation perplexity. Test ppl is that of the model with the best "
        "validation perplexity, as in the tables above. Each command line is in "
        "`manual/<run>.command.txt`.",
        "",
        markdown_table(header, rows),
    ]
