"""A learning-rate schedule against issue 18's 10% target (the decay suite's section of
`fedkey bench paper`'s report).

The decay suite (bench.paper_suites.decay_suite) runs some PTB rows of the rank suite again with
the local lr decayed, the centralized model among them, alike per example seen. Each row here
sets its decayed run beside its constant-lr rank run, and holds the federated rows against the
centralized model trained with the same decay: the target compares like with like. Written from
results.json's objects alone (no torch), as the rest of the report.
"""

from __future__ import annotations

from dataclasses import replace

from bench.paper_spec import RunSpec
from bench.paper_suites import ROUND_DECAY, decay_suite, every_knob_chosen
from bench.paper_tables import Begun, _c, _f, _pct, _where, _x
from bench.presets import Preset
from bench.report import markdown_table


def decay_pairs(preset: Preset, runs: list[dict]) -> list[tuple[RunSpec, dict | None, dict | None]]:
    """Per run the decay suite plans for `preset`, in its order: (its spec, the rank run it
    repeats with the lr decayed, its own run), None for a run not done."""
    mine = [r for r in runs if r.get("preset") == preset.name]
    by_id = {r["id"]: r for r in mine}
    return [(s, by_id.get(replace(s, suite="rank").id), by_id.get(s.id))
            for s in decay_suite(preset, mine, every_knob_chosen())]  # fmt: skip


def decay_central(preset: Preset, runs: list[dict], dataset: str) -> dict | None:
    """The decay suite's centralized run at C 0.1 on `dataset`, done, or None."""
    return next((run for s, _, run in decay_pairs(preset, runs)
                 if run and s.kind == "central" and s.dataset == dataset
                 and s.fraction == 0.1), None)  # fmt: skip


def _per(spec: RunSpec) -> str:
    """The spec's decay: a round's, or the centralized model's per epoch."""
    value = spec.args[spec.args.index("--lr-decay") + 1]
    return f"{value} an epoch" if spec.kind == "central" else f"{value} a round"


def decay_table(preset: Preset, runs: list[dict], begun: Begun | None = None) -> str:
    """One row per decayed run: its test perplexity beside its rank run's at a constant lr, the
    change, against the centralized model with the lr decayed alike, and its keyboard metrics
    (top-1 against the rank suite's Kneser-Ney 3-gram)."""
    begun = begun or {}
    header = ["method", "C", "lr decay", "test ppl, constant lr", "test ppl, lr decayed",
              "change", "vs centralized, lr decayed", "top-1", "top-1 vs 3-gram", "top-3", "KSR",
              "best round / rounds"]  # fmt: skip
    pairs = decay_pairs(preset, runs)
    # per dataset: the centralized run decayed alike, and the rank suite's 3-gram's top-1
    central = {s.dataset: run for s, _, run in pairs
               if run and s.kind == "central" and s.fraction == 0.1}  # fmt: skip
    ngram_top1 = {r["dataset"]: r["top1"] for r in runs if r.get("preset") == preset.name
                  and r["suite"] == "rank" and r["kind"] == "ngram"}  # fmt: skip
    rows = []
    for spec, constant, run in pairs:
        was = constant["test_ppl"] if constant else None
        if run is None:
            where = _where(begun.get(f"{preset.name}/{spec.id}"), spec.kind)
            rows.append([spec.method, _c(spec.fraction) if spec.kind == "federated" else "-",
                         _per(spec), _f(was), where, *[""] * (len(header) - 5)])  # fmt: skip
            continue
        fed = spec.kind == "federated"
        ref = central.get(spec.dataset)
        top1 = run.get("top1")
        rows.append([
            run["method"], _c(run["fraction"]) if fed else "-", _per(spec), _f(was),
            _f(run["test_ppl"]), _pct(run["test_ppl"], was),
            _pct(run["test_ppl"], ref["test_ppl"]) if fed and ref else "-",
            _f(top1, ".3f"), _x(top1, ngram_top1.get(spec.dataset)),
            _f(run.get("top3"), ".3f"), _f(run.get("ksr"), ".3f"),
            f"{run['best_round']} / {run['rounds']}",
        ])  # fmt: skip
    return markdown_table(header, rows) if rows else ""


def decay_section(preset: Preset, runs: list[dict], begun: Begun | None = None) -> list[str]:
    """The report's section on the decay suite of `preset` (none if it has no such suite)."""
    if "decay" not in preset.suites:
        return []
    table = decay_table(preset, runs, begun)
    last = ROUND_DECAY ** (preset.rounds - 1)
    return [
        "", f"## A learning-rate schedule against the 10% target (preset `{preset.name}`)", "",
        f"The decay suite runs these PTB rows of the rank suite again with the local lr decayed "
        f"by {ROUND_DECAY:g} a round (`--lr-decay`: round r trains at lr x {ROUND_DECAY:g}^(r-1),"
        f" {last:.3f}x the lr by round {preset.rounds}), and the centralized model with its lr "
        "falling as fast per example seen, stepped per epoch (each epoch at the lr of the first "
        "of the rounds that see as many examples). The same learning rates and seed as the rank "
        "runs; one fixed schedule, not swept. vs centralized, lr decayed: the issue's 10% "
        "target held against the centralized model trained with the same decay (the targets "
        "table's \"lr decayed\" row).", "",
        table or "No run of the decay suite is planned yet.",
    ]  # fmt: skip


def decay_curves(preset: Preset, runs: list[dict]) -> list[dict]:
    """The decay suite's runs and the rank runs they repeat, labelled, for one figure."""
    out = []
    for _, constant, run in decay_pairs(preset, runs):
        if run is not None:
            out += (
                [{**constant, "method": f"{constant['method']}, constant lr"}] if constant else []
            )
            out += [{**run, "method": f"{run['method']}, lr decayed"}]
    return out
