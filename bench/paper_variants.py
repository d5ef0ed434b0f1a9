"""Rank rows run again with one change, against issue 18's targets (the decay and dropout suites'
sections of `fedkey bench paper`'s report).

A variant suite (bench.paper_suites: decay_suite, dropout_suite) runs some PTB rows of the rank
suite again with one flag added, the centralized model among them. Each row here sets its run
beside the rank run it repeats, and holds the federated rows against the centralized model with
the same change: the target compares like with like. Written from results.json's objects alone
(no torch), as the rest of the report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.paper_spec import RunSpec
from bench.paper_suites import (
    DROPOUT,
    ROUND_DECAY,
    decay_suite,
    dropout_suite,
    every_knob_chosen,
)
from bench.paper_tables import Begun, _c, _f, _pct, _where, _x
from bench.presets import Preset
from bench.report import markdown_table


@dataclass(frozen=True)
class Variant:
    """One variant suite: the flag it adds to rank runs and how its report names the change."""

    suite: str
    runs: Callable[..., list[RunSpec]]  # (preset, results, choices) -> its specs
    flag: str  # the flag it adds; its value is the table's `column`
    column: str  # "lr decay"
    before: str  # the rank runs, as the change is not made: "constant lr"
    after: str  # the suite's runs: "lr decayed"
    heading: str  # the report's section heading, before "(preset `cpu`)"
    about: Callable[[Preset], str]  # the section's paragraph
    units: tuple[str, str] = ("", "")  # after a value: a federated run's, a centralized one's

    def value(self, spec: RunSpec) -> str:
        """The spec's value of the flag, with its unit."""
        unit = self.units[spec.kind == "central"]
        return spec.args[spec.args.index(self.flag) + 1] + unit


def _about_decay(preset: Preset) -> str:
    last = ROUND_DECAY ** (preset.rounds - 1)
    return (
        f"The decay suite runs these PTB rows of the rank suite again with the local lr decayed "
        f"by {ROUND_DECAY:g} a round (`--lr-decay`: round r trains at lr x {ROUND_DECAY:g}^(r-1),"
        f" {last:.3f}x the lr by round {preset.rounds}), and the centralized model with its lr "
        "falling as fast per example seen, stepped per epoch (each epoch at the lr of the first "
        "of the rounds that see as many examples). The same learning rates and seed as the rank "
        "runs; one fixed schedule, not swept. vs centralized, lr decayed: the issue's 10% "
        "target held against the centralized model trained with the same decay (the targets "
        'table\'s "lr decayed" row).'
    )


def _about_dropout(preset: Preset) -> str:
    return (
        f"The dropout suite runs these PTB rows of the rank suite at C 0.1 again with dropout "
        f"{DROPOUT:g} on the embeddings and the GRU's outputs (`--dropout`: the non-recurrent "
        "connections only, as Zaremba et al. 2014 regularize their LSTMs), the centralized "
        "model too; the model is evaluated without it. The same learning rates and seed as the "
        "rank runs; one value, not swept. vs centralized, dropout: the federated rows against "
        'the centralized model with the same dropout (the targets table\'s "dropout" row).'
    )


VARIANTS = {
    "decay": Variant(
        "decay", decay_suite, "--lr-decay", "lr decay", "constant lr", "lr decayed",
        "A learning-rate schedule against the 10% target", _about_decay,
        (" a round", " an epoch"),
    ),
    "dropout": Variant(
        "dropout", dropout_suite, "--dropout", "dropout", "no dropout", "dropout",
        f"Dropout {DROPOUT:g} against overfitting", _about_dropout,
    ),
}  # fmt: skip


def variant_pairs(
    v: Variant, preset: Preset, runs: list[dict]
) -> list[tuple[RunSpec, dict | None, dict | None]]:
    """Per run the variant suite plans for `preset`, in its order: (its spec, the rank run it
    repeats without the change, its own run), None for a run not done."""
    mine = [r for r in runs if r.get("preset") == preset.name]
    by_id = {r["id"]: r for r in mine}
    return [(s, by_id.get(replace(s, suite="rank").id), by_id.get(s.id))
            for s in v.runs(preset, mine, every_knob_chosen())]  # fmt: skip


def variant_central(v: Variant, preset: Preset, runs: list[dict], dataset: str) -> dict | None:
    """The variant suite's centralized run at C 0.1 on `dataset`, done, or None."""
    return next((run for s, _, run in variant_pairs(v, preset, runs)
                 if run and s.kind == "central" and s.dataset == dataset
                 and s.fraction == 0.1), None)  # fmt: skip


def variant_table(v: Variant, preset: Preset, runs: list[dict], begun: Begun | None = None) -> str:
    """One row per run of the variant: its test perplexity beside its rank run's, the change,
    against the centralized model with the same change, and its keyboard metrics (top-1 against
    the rank suite's Kneser-Ney 3-gram)."""
    begun = begun or {}
    header = ["method", "C", v.column, f"test ppl, {v.before}", f"test ppl, {v.after}",
              "change", f"vs centralized, {v.after}", "top-1", "top-1 vs 3-gram", "top-3", "KSR",
              "best round / rounds"]  # fmt: skip
    pairs = variant_pairs(v, preset, runs)
    # per dataset: the centralized run with the change, and the rank suite's 3-gram's top-1
    central = {s.dataset: run for s, _, run in pairs
               if run and s.kind == "central" and s.fraction == 0.1}  # fmt: skip
    ngram_top1 = {r["dataset"]: r["top1"] for r in runs if r.get("preset") == preset.name
                  and r["suite"] == "rank" and r["kind"] == "ngram"}  # fmt: skip
    rows = []
    for spec, unchanged, run in pairs:
        was = unchanged["test_ppl"] if unchanged else None
        if run is None:
            where = _where(begun.get(f"{preset.name}/{spec.id}"), spec.kind)
            rows.append([spec.method, _c(spec.fraction) if spec.kind == "federated" else "-",
                         v.value(spec), _f(was), where, *[""] * (len(header) - 5)])  # fmt: skip
            continue
        fed = spec.kind == "federated"
        ref = central.get(spec.dataset)
        top1 = run.get("top1")
        rows.append([
            run["method"], _c(run["fraction"]) if fed else "-", v.value(spec), _f(was),
            _f(run["test_ppl"]), _pct(run["test_ppl"], was),
            _pct(run["test_ppl"], ref["test_ppl"]) if fed and ref else "-",
            _f(top1, ".3f"), _x(top1, ngram_top1.get(spec.dataset)),
            _f(run.get("top3"), ".3f"), _f(run.get("ksr"), ".3f"),
            f"{run['best_round']} / {run['rounds']}",
        ])  # fmt: skip
    return markdown_table(header, rows) if rows else ""


def variant_section(
    v: Variant, preset: Preset, runs: list[dict], begun: Begun | None = None
) -> list[str]:
    """The report's section on the variant suite of `preset` (none if it has no such suite)."""
    if v.suite not in preset.suites:
        return []
    table = variant_table(v, preset, runs, begun)
    return [
        "", f"## {v.heading} (preset `{preset.name}`)", "", v.about(preset), "",
        table or f"No run of the {v.suite} suite is planned yet.",
    ]  # fmt: skip


def variant_curves(v: Variant, preset: Preset, runs: list[dict]) -> list[dict]:
    """The variant suite's runs and the rank runs they repeat, labelled, for one figure."""
    out = []
    for _, unchanged, run in variant_pairs(v, preset, runs):
        if run is not None:
            out += (
                [{**unchanged, "method": f"{unchanged['method']}, {v.before}"}] if unchanged else []
            )
            out += [{**run, "method": f"{run['method']}, {v.after}"}]
    return out
