"""Rank rows run again with one change, against the ranking's targets (the decay, dropout and
confirm suites' sections of `fedkey-bench paper`'s report).

A variant suite (fedkey_bench.paper.suites: decay_suite, dropout_suite, confirm_suite) runs some rows
of the rank suite (PTB's; confirm's on both datasets, and the noniid suite's on the demo corpus)
again with one change (a flag added, or an lr the sweep chose set one step lower), the
centralized model among them. Each row here sets its run beside the run it repeats, and holds
the federated rows against the centralized model with the same change: the target compares like
with like. Written from results.json's objects
alone (no torch), as the rest of the report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.paper.presets import Preset
from fedkey_bench.paper.spec import RunSpec
from fedkey_bench.paper.suites import (
    DROPOUT,
    NONIID,
    ROUND_DECAY,
    confirm_suite,
    decay_suite,
    dropout_suite,
    noniid_suite,
    rank_suite,
    source_suite,
)
from fedkey_bench.paper.sweep import _score, choices_so_far, sweep_epochs
from fedkey_bench.paper.tables import NAMES, PARTITIONS, Begun, _c, _f, _pct, _where, _x


@dataclass(frozen=True)
class Variant:
    """One variant suite: the flag it adds to rank runs and how its report names the change."""

    suite: str
    runs: Callable[..., list[RunSpec]]  # (preset, results, choices) -> its specs
    flag: str  # the flag it adds or changes; its value is the table's `column` ("-": none)
    column: str  # "lr decay"
    before: str  # the rank runs, as the change is not made: "constant lr"
    after: str  # the suite's runs: "lr decayed"
    heading: str  # the report's section heading, before "(preset `cpu`)"
    about: Callable[[Preset], str]  # the section's paragraph
    units: tuple[str, str] = ("", "")  # after a value: a federated run's, a centralized one's
    # a row kept only once a run besides its first is done (confirm: its first run is the rank
    # run, so until another ends nothing is checked yet)
    whole: bool = False

    def value(self, spec: RunSpec) -> str:
        """The spec's value of the flag, with its unit ("-" where the spec has no such flag)."""
        if self.flag not in spec.args:
            return "-"
        unit = self.units[spec.kind == "central"]
        return spec.args[spec.args.index(self.flag) + 1] + unit

    def label(self, spec: RunSpec) -> str:
        """What sets a run apart from the suite's other run of its row (a tagged one's): its
        value of the flag where it has one, else its lr."""
        if self.value(spec) != "-":
            return f"{self.column} {self.value(spec)}"
        return f"lr {spec.lr:g}"


def _about_decay(preset: Preset) -> str:
    last = ROUND_DECAY ** (preset.rounds - 1)
    return (
        f"The decay suite runs these PTB rows of the rank suite again with the local lr decayed "
        f"by {ROUND_DECAY:g} a round (`--lr-decay`: round r trains at lr x {ROUND_DECAY:g}^(r-1),"
        f" {last:.3f}x the lr by round {preset.rounds}), and the centralized model with its lr "
        "falling as fast per example seen, stepped per epoch (each epoch at the lr of the first "
        "of the rounds that see as many examples). The same learning rates and seed as the rank "
        "runs; one fixed schedule, not swept. vs centralized, lr decayed: the 10% "
        "target held against the centralized model trained with the same decay (the targets "
        'table\'s "lr decayed" row).'
    )


def _about_dropout(preset: Preset) -> str:
    return (
        f"The dropout suite runs these PTB rows of the rank suite at C 0.1 again with dropout "
        f"{DROPOUT:g} on the embeddings and the GRU's outputs (`--dropout`: the non-recurrent "
        "connections only, as Zaremba et al. 2014 regularize their LSTMs), the centralized "
        "model too; the model is evaluated without it. Each row runs at the lr the sweep chose "
        "without dropout and at the grid's next larger one (dropout slows fitting and delays "
        "overfitting), and the one with the better validation perplexity is kept; the same "
        "seed as the rank runs; one dropout value, not swept. vs centralized, dropout: the "
        "federated rows against the kept centralized model with the same dropout (the targets "
        'table\'s "dropout" row, from the kept runs).'
    )


def _about_confirm(preset: Preset) -> str:
    epochs = sweep_epochs(preset)
    return (
        f"The sweep chooses each learning rate by runs of {preset.sweep_rounds} of a rank run's "
        f"{preset.rounds} rounds (the centralized model's: {epochs} of its "
        f"{preset.central_epochs_for(0.1)} epochs): it ranks them by early progress, which "
        "favours the larger. The confirm suite runs these rows of the rank suite at C 0.1, "
        "on each dataset, and of the noniid suite on the demo corpus by owner (where FedAvgM "
        f"diverged after its sweep's rounds), for all {preset.rounds} rounds again one step of "
        "the grid lower (FedAvg's and the centralized model's lr; FedAvgM's and FedAdam's "
        "server lr, at the client lr chosen with it); the row at the sweep's value is the rank "
        "(noniid) run itself, and where the lower one ends better on validation, one step lower "
        "again (twice at most). The best on validation is kept (test perplexity is never read for "
        "it). vs centralized, lr checked at full length: the federated rows against the "
        'kept centralized model (the targets table\'s "lr checked at full length" row, from the '
        "kept runs)."
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
    "confirm": Variant(
        "confirm", confirm_suite, "--server-lr", "server lr", "sweep's choice",
        "lr checked at full length", "The sweep's learning rates checked at full length",
        _about_confirm, whole=True,
    ),
}  # fmt: skip


class VariantRun(NamedTuple):
    """One run a variant suite plans, and the runs it is read against."""

    spec: RunSpec
    unchanged: dict | None  # the rank (noniid) run it repeats unchanged; None: not done
    run: dict | None  # its own run; None: not done
    # the id its run goes by: the rank (noniid) run's where it is that run, else its own
    runs_as: str


def _row_id(spec: RunSpec) -> str:
    """The id of the rank (noniid) run a variant spec's row repeats: its row's key."""
    return replace(spec, suite=source_suite(spec), tag="").id


def variant_pairs(v: Variant, preset: Preset, runs: list[dict]) -> list[VariantRun]:
    """Per run the variant suite plans for `preset`, in its order, a VariantRun."""
    mine = [r for r in runs if r.get("preset") == preset.name]
    by_id = {r["id"]: r for r in mine}
    # the sweep's choices where made (a dropout run's lr is in its id), placeholders elsewhere
    choices = choices_so_far(mine, preset)
    repeated = {*rank_suite(preset, mine, choices=choices), *noniid_suite(preset, mine, choices)}
    out = []
    for s in v.runs(preset, mine, choices):
        unchanged = by_id.get(_row_id(s))
        # a run that is the rank (noniid) run itself (confirm's row at the sweep's value) is that
        # run, before the bench records it under its own id too
        same = replace(s, suite=source_suite(s))
        twin = unchanged if same in repeated else None
        runs_as = same.id if same in repeated else s.id
        out.append(VariantRun(s, unchanged, by_id.get(s.id) or twin, runs_as))
    return out


def variant_kept(
    v: Variant, preset: Preset, runs: list[dict], pairs: list[VariantRun] | None = None
) -> dict[str, dict]:
    """Repeated run id (a rank run's, or a noniid run's) -> the variant's run of that row that
    the report keeps: where the suite runs a row at more than one lr (dropout, confirm), the one
    with the lowest best validation perplexity once all of them are done, and until then the one
    at the repeated run's own lr (a `whole` variant: the best of those done once one besides the
    repeated run is); test perplexity is never read. `pairs`: variant_pairs' answer, where the
    caller has it."""
    kept = {}
    for rank_id, tries in variant_rows(
        pairs if pairs is not None else variant_pairs(v, preset, runs)
    ).items():
        done = [run for _, run in tries if run is not None]
        # all done; or, for a whole variant, checked so far (a step further lower still to run)
        if done and (len(done) == len(tries) or (v.whole and len(done) > 1)):
            kept[rank_id] = min(done, key=_score)  # the sweep's score: best validation
        elif tries[0][1] is not None and not v.whole:
            kept[rank_id] = tries[0][1]
    return kept


def variant_rows(pairs: list[VariantRun]) -> dict[str, list[tuple[RunSpec, dict | None]]]:
    """variant_pairs' answer by row: repeated run id -> its (spec, run) pairs in the suite's order
    (the first at the rank run's own value)."""
    rows: dict[str, list[tuple[RunSpec, dict | None]]] = {}
    for spec, _, run, _ in pairs:
        rows.setdefault(_row_id(spec), []).append((spec, run))
    return rows


def kept_central(kept: Mapping[str, dict], dataset: str) -> dict | None:
    """Of variant_kept's runs, the centralized run at C 0.1 on `dataset`, or None."""
    return next((run for run in kept.values()
                 if run["kind"] == "central" and run["dataset"] == dataset
                 and run["fraction"] == 0.1), None)  # fmt: skip


def variant_table(v: Variant, preset: Preset, runs: list[dict], begun: Begun | None = None) -> str:
    """One row per run of the variant: its test perplexity beside its rank run's, the change,
    against the centralized model with the same change (the kept one), and its keyboard metrics
    (top-1 against the rank suite's Kneser-Ney 3-gram); kept: the run the targets table uses
    (variant_kept: where a row runs at more than one lr, the better on validation). Its top-3,
    KSR and best validation perplexity: the run's row of runs.csv."""
    begun = begun or {}
    header = ["method", "C", v.column, "lr", f"test ppl, {v.before}", f"test ppl, {v.after}",
              "change", f"vs centralized, {v.after}", "top-1", "top-1 vs 3-gram",
              "best round / rounds", "kept"]  # fmt: skip
    pairs = variant_pairs(v, preset, runs)
    kept_runs = variant_kept(v, preset, runs, pairs)
    kept = {id(run) for run in kept_runs.values()}
    central = {ds: kept_central(kept_runs, ds) for ds in {p.spec.dataset for p in pairs}}
    ngram_top1 = {r["dataset"]: r["top1"] for r in runs if r.get("preset") == preset.name
                  and r["suite"] in ("rank", "noniid") and r["kind"] == "ngram"}  # fmt: skip
    rows = []
    for spec, unchanged, run, runs_as in pairs:
        was = unchanged["test_ppl"] if unchanged else None
        fed = spec.kind == "federated"
        lr = "-" if spec.lr is None else f"{spec.lr:g}"
        if run is None:
            # the repeated run's progress, where it is this row's run (confirm's at the sweep's lr)
            state = begun.get(f"{preset.name}/{spec.id}") or begun.get(f"{preset.name}/{runs_as}")
            where = _where(state, spec.kind)
            rows.append([spec.method, _c(spec.fraction) if fed else "-", v.value(spec), lr,
                         _f(was), where, *[""] * (len(header) - 6)])  # fmt: skip
            continue
        ref = central.get(spec.dataset)
        top1 = run.get("top1")
        rows.append([
            run["method"], _c(run["fraction"]) if fed else "-", v.value(spec), lr, _f(was),
            _f(run["test_ppl"]), _pct(run["test_ppl"], was),
            _pct(run["test_ppl"], ref["test_ppl"]) if fed and ref else "-",
            _f(top1, ".3f"), _x(top1, ngram_top1.get(spec.dataset)),
            f"{run['best_round']} / {run['rounds']}", "yes" if id(run) in kept else "",
        ])  # fmt: skip
    if len({p.spec.dataset for p in pairs}) > 1:  # a suite on several datasets says whose row
        header = ["dataset", *header]
        rows = [[_dataset(p.spec), *row] for p, row in zip(pairs, rows, strict=True)]
    return markdown_table(header, rows) if rows else ""


def _dataset(spec: RunSpec) -> str:
    """The dataset cell of a spec's row, with how its phones hold it where they differ."""
    if source_suite(spec) == "rank":
        return NAMES[spec.dataset]
    partition = next(task[1] for task in NONIID if task[0] == spec.dataset)
    return f"{NAMES[spec.dataset]} ({PARTITIONS[partition]})"


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
    out, seen = [], set()
    for spec, unchanged, run, _ in variant_pairs(v, preset, runs):
        if run is None:
            continue
        if unchanged and unchanged["id"] not in seen:
            seen.add(unchanged["id"])
            out.append({**unchanged, "method": f"{unchanged['method']}, {v.before}"})
        if unchanged is not None and (
            run is unchanged or run.get("same_run_as") == unchanged["id"]
        ):
            continue  # the rank run itself (confirm's row at the sweep's lr): drawn once, above
        at = f", {v.label(spec)}" if spec.tag else ""
        out.append({**run, "method": f"{run['method']}, {v.after}{at}"})
    return out


def checked_note(preset: Preset, runs: list[dict], dataset: str, suite: str = "rank") -> str:
    """A line under the `suite` table (rank or noniid) of `dataset`: which of its rows the
    confirm suite has checked at full length, and where the sweep's lr gave way to a lower one on
    validation, that run's test perplexity against the kept centralized model ("" while none is
    checked). The table itself keeps the sweep's choices: every method there chose its lr alike."""
    v = VARIANTS["confirm"]
    if v.suite not in preset.suites:
        return ""
    pairs = [p for p in variant_pairs(v, preset, runs)
             if p.spec.dataset == dataset and source_suite(p.spec) == suite]  # fmt: skip
    kept = variant_kept(v, preset, runs, pairs)
    if not kept:
        return ""
    rows = variant_rows(pairs)
    central = kept_central(kept, dataset)
    held, moved = [], []
    for rank_id, run in kept.items():
        name = "the centralized model" if run["kind"] == "central" else run["method"]
        (first, at_sweep), *_ = rows[rank_id]  # the row's run at the sweep's value
        if run is at_sweep:  # the rank run's own lr won
            held.append(name)
            continue
        vs = ""
        if run["kind"] == "federated" and central is not None:
            vs = f", {_pct(run['test_ppl'], central['test_ppl'])} from the centralized model"
        spec = next(s for s, r in rows[rank_id] if r is run)
        moved.append(f"{name}'s {v.label(first)} gave way to {v.label(spec)} (test "
                     f"{_f(run['test_ppl'])}{vs})")  # fmt: skip
    said = "; ".join(moved + ([f"{', '.join(held)}: the sweep's choice held"] if held else []))
    return (f"Checked at full length (\"{v.heading}\" below, kept on validation): {said}. "
            "The table keeps the sweep's choices, made alike for every method.")  # fmt: skip
