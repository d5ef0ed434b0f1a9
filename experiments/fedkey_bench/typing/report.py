"""The page of `fedkey-bench typing` (fedkey_bench.typing.runner), built from results.json
alone: the answer first (the best federated keyboard's top-1 and keystroke savings as multiples
of the 3-gram of the phones' own text, and FedAtt's, against issue 65's targets), then one table
per population and held-out set, then the runs and the commands.

    python -m fedkey_bench.typing.report experiments/results/typing
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fedkey_bench.common import pages
from fedkey_bench.common.checkout import RESULTS, shown_path
from fedkey_bench.common.markdown import markdown_table

#: Issue 65's targets, as multiples of the 3-gram of the phones' text (row a).
TARGETS = {"top1": 1.30, "fedatt_top1": 1.25, "ksr": 1.15}
#: And of the centralized fine-tune's perplexity: the best federated fine-tune's within 5% of it.
PPL_GAP = 1.05
#: The held-out sets, in the order the tables show them.
SETS = {"phones": "the phones' later messages", "unseen": "senders who never trained"}
#: Row (a), the 3-gram of the phones' pooled text: every multiple divides by its figures.
REFERENCE = "kn3-phones"


def load(folder: Path) -> dict[str, Any]:
    """FOLDER/results.json ({"populations": {}} before the first)."""
    return pages.load(folder)


def save(folder: Path, results: dict[str, Any]) -> Path:
    """FOLDER/results.json and FOLDER/results.md from it; -> the page's path."""
    return pages.save(folder, results, markdown)


def _num(value: Any, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _times(value: Any) -> str:
    return "" if value is None else f"{value:.2f}x"


def _met(value: Any, target: float) -> str:
    if value is None:
        return "not measured"
    return "met" if value >= target else "not met"


def best(rows: list[dict[str, Any]], set_name: str, cache: bool,
         run: str | None = None) -> dict[str, Any] | None:  # fmt: skip
    """The federated row of `set_name` and `cache` (of run `run`, when given) of the highest
    top-1 over every word; None when there is none."""
    pool = [r for r in rows if r["kind"] == "federated" and r["set"] == set_name
            and r["cache"] == cache and (run is None or r["run"] == run)
            and r.get("x_all_top1") is not None]  # fmt: skip
    return max(pool, key=lambda r: r["x_all_top1"], default=None)


def _central(rows: list[dict[str, Any]]) -> str:
    """The centralized fine-tune's best top-1 multiple on the phones' later messages (the
    ceiling), as the lead's sentence ends."""
    got = [r["x_all_top1"] for r in rows if r["kind"] == "central" and r["set"] == "phones"
           and not r["cache"] and r.get("x_all_top1") is not None]  # fmt: skip
    return f" The centralized fine-tune, for reference: {_times(max(got))}." if got else ""


def ppl_gap(pop: dict[str, Any]) -> str | None:
    """The line on the perplexity target: the best federated fine-tune's perplexity (the model
    alone, on the phones' later messages) against the centralized fine-tune's; None without
    both."""
    rows = [r for r in pop.get("rows") or [] if r["set"] == "phones" and not r["cache"]
            and r["id"] == r.get("run") and r.get("ppl") is not None]  # fmt: skip
    fed = min((r for r in rows if r["kind"] == "federated"), key=lambda r: r["ppl"], default=None)
    central = next((r for r in rows if r["kind"] == "central"), None)
    if fed is None or central is None:
        return None
    gap = fed["ppl"] / central["ppl"]
    return (
        f"- **{pop['label']}**, perplexity on the phones' later messages: the best federated "
        f"fine-tune, {fed['label']}, {fed['ppl']:.2f} against the centralized fine-tune's "
        f"{central['ppl']:.2f} with as many examples seen: {gap:.2f}x (target at most "
        f"{PPL_GAP:.2f}x: {'met' if gap <= PPL_GAP else 'not met'})."
    )


def answer(populations: dict[str, Any]) -> str:
    """The lead: per population and held-out set, with the cache off and on (both sides alike),
    the best federated keyboard's multiples and FedAtt's best, against TARGETS."""
    lines, table = [], []
    for pop in populations.values():
        rows = pop.get("rows") or []
        for set_name, set_label in SETS.items():
            for cache in (False, True):
                top, att = best(rows, set_name, cache), best(rows, set_name, cache, "fedatt")
                if top is None:
                    continue
                table.append([pop["label"], set_label, "on" if cache else "off", top["label"],
                              _times(top["x_all_top1"]), _times(top["x_ksr"]),
                              att["label"] if att else "", _times(att and att["x_all_top1"])])  # fmt: skip
                if set_name == "phones" and not cache:
                    lines.append(
                        f"- **{pop['label']}**, the phones' later messages: the best federated "
                        f"keyboard, {top['label']}, has {_times(top['x_all_top1'])} the top-1 of "
                        f"the 3-gram of the phones' text (target {TARGETS['top1']:.2f}x: "
                        f"{_met(top['x_all_top1'], TARGETS['top1'])}) and {_times(top['x_ksr'])} "
                        f"its keystroke savings (target {TARGETS['ksr']:.2f}x: "
                        f"{_met(top['x_ksr'], TARGETS['ksr'])}); FedAtt's best, "
                        + (f"{att['label']}, {_times(att['x_all_top1'])} (target "
                           f"{TARGETS['fedatt_top1']:.2f}x: "
                           f"{_met(att['x_all_top1'], TARGETS['fedatt_top1'])})."
                           if att else "not scored yet.")
                        + _central(rows)
                    )  # fmt: skip
        gap = ppl_gap(pop)
        if gap is not None:
            lines.append(gap)
    if not table:
        return "No federated run has been scored yet.\n"
    head = ["population", "held-out messages", "personal cache", "best federated keyboard",
            "top-1 x 3-gram", "KSR x 3-gram", "FedAtt's best", "its top-1 x 3-gram"]  # fmt: skip
    return ("\n".join(lines) + "\n\nThe best federated keyboard is the FedAvg, FedAdam or FedAtt "
            "row (alone or mixed with the public 3-gram) of the highest top-1 over every word; "
            "its keystroke savings are that row's. Every multiple divides by row (a) on the same "
            "messages with the same cache setting (off: both alone; on: both with the personal "
            "cache).\n\n" + markdown_table(head, table) + "\n")  # fmt: skip


ROWS_NOTE = (
    "Rows: (a) the Kneser-Ney 3-gram of the phones' pooled training text on its 10,000 most "
    "frequent words, which a keyboard cannot have without collecting that text (every multiple "
    "divides by it); (b) the 3-gram of public text that ships with the base (`--ngram`), on the "
    "base's vocabulary; (c) the base alone; (d) the base + (b); (e) each run's best-validation "
    "checkpoint alone and + (b). A mixture p = lam p_model + (1 - lam) p_3gram takes the lam "
    "(column lam) of the lowest perplexity on the phones' validation messages, never on the "
    'messages scored. "+ cache": the same keyboard with the personal cache '
    "(fedkey.models.personal.DEFAULTS) of the sender's earlier messages, each sender's messages "
    "scored in time order, a message learned after it is scored. top-1 / top-3: the suggestion "
    "bar's ranking over every real word (an out-of-vocabulary word a miss unless the cache "
    "offers it); bar top-1: over the words in the vocabulary; KSR: keystroke savings with the "
    "three-slot bar; OOV: the share of words out of the vocabulary; ppl: perplexity, </s> "
    "counted, without the cache; s: seconds of the scoring pass (one pass scores a keyboard "
    "with and without the cache)."
)


def _row_label(r: dict[str, Any]) -> str:
    label = r["label"] + (f" (round {r['round']})" if r.get("round") is not None else "")
    return label + (" + cache" if r["cache"] else "")


def set_table(rows: list[dict[str, Any]], set_name: str) -> str:
    """One population's rows on one held-out set: one figure per cell."""
    head = ["row", "lam", "ppl", "top-1", "top-3", "bar top-1", "KSR", "OOV", "top-1 x (a)",
            "KSR x (a)", "s"]  # fmt: skip
    body = [[_row_label(r), _num(r.get("ngram_weight"), 2), _num(r.get("ppl"), 2),
             _num(r["all_top1"]), _num(r["all_top3"]), _num(r["bar_top1"]), _num(r["ksr"]),
             _num(r["oov"]), _times(r.get("x_all_top1")), _times(r.get("x_ksr")),
             _num(r["seconds"], 1)] for r in rows if r["set"] == set_name]  # fmt: skip
    return markdown_table(head, body)


def runs_table(runs: dict[str, Any]) -> str:
    head = ["run", "rounds done", "best round (validation)", "best validation ppl",
            "training s", "CPU s"]  # fmt: skip
    body = [[r.get("label", name), f"{r.get('rounds_done', '')} of {r.get('rounds', '')}",
             "" if r.get("best_round") is None else r["best_round"], _num(r.get("best_val_ppl"), 2),
             _num(r.get("wall_seconds"), 0), _num(r.get("cpu_seconds"), 0)]
            for name, r in runs.items()]  # fmt: skip
    return markdown_table(head, body)


def population_section(pop: dict[str, Any]) -> str:
    """A population's tables (one per held-out set), its runs and where its figures came from."""
    parts = [f"## {pop['label']} ({pop['clients']} phones, one per sender)\n"]
    settings = pop.get("settings") or {}
    valid = pop.get("validation") or {}
    parts.append(
        f"Base `{shown_path(str(settings.get('init', '')))}`, public 3-gram "
        f"`{shown_path(str(settings.get('ngram', '')))}`; rounds R {settings.get('rounds')}, "
        f"C {settings.get('fraction')}; the mixture weights chosen on the phones' "
        f"{valid.get('messages')} validation messages ({valid.get('words')} words)."
        + (f" Only the first {settings['max_senders']} senders of each held-out set are scored."
           if settings.get("max_senders") else "") + "\n"
    )  # fmt: skip
    rows = pop.get("rows") or []
    for set_name, set_label in SETS.items():
        held = (pop.get("held_out") or {}).get(set_name)
        if held is None:
            continue
        parts.append(f"### {pop['label']}: {set_label} ({held['senders']} senders, "
                     f"{held['messages']} messages, {held['words']} words)\n")  # fmt: skip
        parts.append(set_table(rows, set_name) + "\n")
    runs = pop.get("runs") or {}
    if runs:
        parts.append(f"### {pop['label']}: the runs\n")
        parts.append(runs_table(runs) + "\n")
        missing = [r.get("label", n) for n, r in runs.items() if r.get("missing")]
        if missing:
            parts.append(f"Not scored (no checkpoint yet): {', '.join(missing)}.\n")
    dirty = " (with uncommitted changes)" if pop.get("git_dirty") else ""
    parts.append(f"Scored {pop.get('date')} on {pop.get('machine')}, commit "
                 f"{str(pop.get('git_commit'))[:10]}{dirty}, in {pop.get('scoring_seconds')} s.\n")  # fmt: skip
    return "\n".join(parts)


def commands(populations: dict[str, Any]) -> str:
    return pages.commands(populations, "runs")


def markdown(results: dict[str, Any]) -> str:
    """results.md: the answer, each population's tables, the commands."""
    pops = results.get("populations") or {}
    scored = {k: p for k, p in pops.items() if p.get("rows")}
    return (
        "# Real typing: federated keyboards against the 3-gram of the phones' own text "
        "(`fedkey-bench typing`)\n\n"
        + answer(scored)
        + "\n"
        + ROWS_NOTE
        + "\n\n"
        + "\n".join(population_section(p) for p in scored.values())
        + "\n## Commands\n\n"
        + commands(pops)
        + "\n\nEvery row's figures, the runs' commands and provenance: "
        "[results.json](results.json). Rebuild this page from it: "
        "`python -m fedkey_bench.typing.report experiments/results/typing`.\n"
    )


def rebuild(folder: Path) -> Path:
    """FOLDER/results.md from FOLDER/results.json; -> its path."""
    return pages.rebuild(folder, markdown)


if __name__ == "__main__":
    print(rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "typing"))
