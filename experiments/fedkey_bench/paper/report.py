"""The report of `fedkey-bench paper`: results.md and its PNG curves, leading with what a researcher
asks: under the ranking protocol, scored as a language model, which aggregation
method trains the better keyboard model, and how close does it come to centralized training?

Layout: the question and its answer in a few rows (the best federated method per text, phones
and C against the centralized model and the 3-gram); the protocol and how many of its runs are
done; per dataset, test perplexity (of the
best-validation model, end of sentence counted) and the keyboard metrics (top-1, top-3, keystroke
savings) of every method beside the centralized model that saw as many examples and the
Kneser-Ney 3-gram; the targets; the non-IID phones and the spread of the server's weights;
how far some rows move at other seeds (fedkey_bench.paper.seeds); some rows again with one change, a
learning-rate decay or dropout, against the targets (fedkey_bench.paper.variants); the learning-rate
sweep in one row per knob; the curves; the evidence about the seed papers' column measure.
Every run's figures and command go to runs.csv beside results.md (results.json holds them too),
not on the page.

Written from results.json's objects alone (no torch), so a report can be rebuilt or tested
without running anything: `python -m fedkey_bench.paper.report experiments/results/cpu`.
"""

from __future__ import annotations

import csv
import io
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedkey_bench.common.checkout import shown
from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.common.runs import run_seconds
from fedkey_bench.paper.attopt_step import plot_steps, step_section
from fedkey_bench.paper.learning_rates import (
    LR_PAGE,
    LR_SUITES,
    lr_markdown,
    lr_stub,
    ranking_presets,
)
from fedkey_bench.paper.plan import superseded
from fedkey_bench.paper.presets import PRESETS, Preset
from fedkey_bench.paper.real import (
    PHONES_TRAINED,
    REAL_PAGE,
    real_curve_top,
    real_curves,
    real_markdown,
    real_section,
)
from fedkey_bench.paper.results import Bench
from fedkey_bench.paper.seeds import CHANCE_SD, seed_curves, seed_notes, seeds_section
from fedkey_bench.paper.spread import plot_spread, spread_section
from fedkey_bench.paper.suites import SUITES, planned, seed_number
from fedkey_bench.paper.sweep import every_knob_chosen
from fedkey_bench.paper.tables import (
    DATASET_NAMES,
    NAMES,
    PARTITIONS,
    RUNS_CSV,
    Begun,
    _f,
    _key,
    _pct,
    _where,
    _x,
    by_central,
    code_table,
    lm_table,
    plot_curves,
)
from fedkey_bench.paper.variants import (
    VARIANTS,
    checked_note,
    kept_central,
    variant_curves,
    variant_kept,
    variant_section,
)

#: The ranking's targets: the best federated method at C 0.1 within 10% of the centralized model
#: that saw as many examples; top-1 at least 1.25x the Kneser-Ney 3-gram's (Gboard's CIFG
#: against its n-gram, Hard et al. 2018: 16.4% vs 13.0%); gpu preset, PTB: test ppl <= 100.
WITHIN_CENTRAL = 0.10
TOP1_VS_NGRAM = 1.25
GPU_PTB_PPL = 100.0


def _name(ds: str) -> str:
    return NAMES.get(ds, ds)


def references(runs: list[dict], preset: str, dataset: str) -> tuple[dict | None, dict | None]:
    """(the centralized model at C 0.1, the Kneser-Ney 3-gram) of a preset on a dataset's text:
    the rank suite's, or the noniid suite's for the demo corpus."""
    mine = [r for r in runs if r.get("preset") == preset and r["dataset"] == dataset
            and r["suite"] in ("rank", "noniid")]  # fmt: skip
    central = [r for r in mine if r["kind"] == "central"]
    central.sort(key=lambda r: (r["fraction"] != 0.1, r["fraction"] or 0))
    ngram = [r for r in mine if r["kind"] == "ngram"]
    return (central[0] if central else None), (ngram[0] if ngram else None)


def targets_table(runs: list[dict]) -> str:
    """The targets per ranking preset and dataset, at C 0.1, IID phones: where the runs stand;
    with a variant suite's runs (decay, dropout), a row of theirs against its centralized model
    with the same change."""
    header = ["preset", "dataset", "best federated at C 0.1", "test ppl", "centralized",
              "within 10%", "best federated top-1", "3-gram top-1", "top-1 >= 1.25x"]  # fmt: skip
    rows = []
    for preset, ds, suite in [(p, ds, s) for p in ranking_presets(runs) for ds in DATASET_NAMES
                              for s in ("rank", *VARIANTS)]:  # fmt: skip
        # a variant suite's runs: those the report keeps (one per row, chosen on validation)
        kept = variant_kept(VARIANTS[suite], PRESETS[preset], runs) if suite in VARIANTS else {}
        of = kept.values() if suite in VARIANTS else runs
        fed = [r for r in of if r.get("preset") == preset
               and (suite in VARIANTS or r["suite"] == suite)  # a kept run may be a rank run
               and r["dataset"] == ds and r["kind"] == "federated" and r["fraction"] == 0.1]  # fmt: skip
        if not fed:
            continue
        central, ngram = references(runs, preset, ds)
        if suite in VARIANTS:  # held against the centralized model with the same change
            central = kept_central(kept, ds)
        best = min(fed, key=lambda r: _key(r["test_ppl"]))
        top = max(fed, key=lambda r: r["top1"] or 0)
        cp = central["test_ppl"] if central else None
        nt = ngram["top1"] if ngram else None
        ppl_ok = "-" if cp is None else _yes(best["test_ppl"] <= (1 + WITHIN_CENTRAL) * cp)
        # a variant's centralized model not done yet (its run with the change, or the lower
        # lr the confirm suite checks, not done): say so rather than a bare "-"
        central_cell = _f(cp) if cp is not None or suite not in VARIANTS else "not done yet"
        top_ok = "-" if not nt or top["top1"] is None else _yes(top["top1"] >= TOP1_VS_NGRAM * nt)
        label = f"{preset}, {VARIANTS[suite].after}" if suite in VARIANTS else preset
        rows.append([label, _name(ds), best["method"], _f(best["test_ppl"]), central_cell,
                     f"{ppl_ok} ({_pct(best['test_ppl'], cp)})", f"{_f(top['top1'], '.3f')} "
                     f"({top['method']})", _f(nt, ".3f"), f"{top_ok} ({_x(top['top1'], nt)})"])  # fmt: skip
    if not rows:
        return "No ranking run at C 0.1 is done yet."
    gpu = [r for r in runs if r.get("preset") == "gpu" and r["suite"] == "rank"
           and r["dataset"] == "ptb" and r["kind"] == "federated" and r["fraction"] == 0.1]  # fmt: skip
    note = f"\n\ngpu preset, PTB, C 0.1: target test ppl <= {GPU_PTB_PPL:g}; " + (
        f"best {_f(min(_key(r['test_ppl']) for r in gpu))}"
        if gpu
        else "none in these results (a gpu bench writes its own results.md: experiments/results/gpu)"
    )
    return markdown_table(header, rows) + note


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def progress(preset: Preset, runs: list[dict], stale: Sequence[str] | None = None,
             begun: Begun | None = None) -> str:  # fmt: skip
    """ "N of M runs done" of a ranking preset, per suite; the superseded runs (fedkey_bench.paper.runner:
    their command is not the preset's now; `stale` when already known) named and not counted;
    how many more are `begun`."""
    mine = [r for r in runs if r.get("preset") == preset.name]
    stale = superseded(preset, runs) if stale is None else stale
    plan = planned(preset, runs)
    done = {s: sum(r["suite"] == s and r["id"] not in stale for r in mine) for s in plan}
    total_done, total = sum(done.values()), sum(max(plan[s], done[s]) for s in plan)
    parts = ", ".join(f"{s} {done[s]} of {max(plan[s], done[s])}" for s in plan)
    hours = sum(run_seconds(r) for r in mine) / 3600
    old = (f" {len(stale)} runs are superseded (their command is not the one the preset makes "
           f"now: its protocol or a sweep choice changed since) and are not counted; their rows "
           f"stay until they are run again: {', '.join(f'`{i}`' for i in stale)}."
           if stale else "")  # fmt: skip
    started = sum(k.startswith(f"{preset.name}/") for k in begun or {})
    more = (f" {started} more begun: stopped at a time limit, the next bench continues them."
            if started else "")  # fmt: skip
    return (f"**{total_done} of {total} runs done** ({parts}; {hours:.1f} hours of run time so "
            f"far).{more} The bench resumes where it stopped; a best value at the edge of a sweep "
            f"grid adds a run.{old}")  # fmt: skip


def _waiting(preset: Preset, runs: list[dict], suite: str, dataset: str, done: list[dict],
             begun: Begun) -> list[tuple[str, float | None, str]]:  # fmt: skip
    """(method, C of a federated run or None, where it stands: not run yet, or the rounds done
    of one stopped at a time limit) of a suite's planned runs on a dataset that are not done."""
    from fedkey_bench.paper.suites import noniid_suite, rank_suite

    every = every_knob_chosen()
    mine = [r for r in runs if r.get("preset") == preset.name]
    make = rank_suite if suite == "rank" else noniid_suite
    specs = [s for s in make(preset, mine, choices=every) if s.dataset == dataset]
    have = {r["id"] for r in done}
    return [(s.method, s.fraction if s.kind == "federated" else None,
             _where(begun.get(f"{preset.name}/{s.id}"), s.kind))
            for s in specs if s.id not in have]  # fmt: skip


def _marked(run: dict, stale: Sequence[str]) -> dict:
    """A superseded run (its command not the preset's now) labelled so in the tables."""
    if run["id"] not in stale:
        return run
    return {**run, "method": f"{run['method']} (superseded: run again with the current command)"}


def ranking_sections(
    runs: list[dict], plots: Mapping[str, Path], begun: Begun | None = None
) -> list[str]:
    """The ranking tables per preset and dataset; `begun` (fedkey_bench.paper.results.Bench.begun): the runs
    stopped at a time limit, shown with the rounds they have done."""
    begun = begun or {}
    out = []
    # each preset's superseded runs, found once: the progress line and both tables use them
    stale_of = {name: superseded(PRESETS[name], runs) for name in ranking_presets(runs)}
    for name in ranking_presets(runs):
        preset = PRESETS[name]
        mine = [r for r in runs if r.get("preset") == name]
        stale = stale_of[name]
        out += ["", f"## Language model and keyboard: preset `{name}`, "
                f"{', '.join(f'C {c:g}' for c in preset.fractions)}, 100 IID phones", "",
                progress(preset, runs, stale, begun), ""]  # fmt: skip
        for ds in DATASET_NAMES:
            rank = [_marked(r, stale) for r in mine if r["suite"] == "rank" and r["dataset"] == ds]
            central, ngram = (x and _marked(x, stale) for x in references(runs, name, ds))
            wait = _waiting(preset, runs, "rank", ds, rank, begun)
            chance = seed_notes(preset, runs, ds)
            out += [f"### {_name(ds)}", "", lm_table(rank, central, ngram, wait, chance), ""]
            checked = checked_note(preset, runs, ds)
            out += [checked, ""] if checked else []
        out += ["test ppl: test perplexity of the model with the best validation perplexity over "
                "the rounds, the end-of-sentence prediction counted; top-1 / top-3: next-word "
                "accuracy on the test set; KSR: keystroke savings on the first "
                f"{preset.ksr_sentences} test sentences. vs centralized: against the "
                "centralized model that saw as many examples (rounds x C x E epochs); "
                "\"vs C 0.1's\": where none was run, against C 0.1's, which saw fewer; "
                "top-1 vs 3-gram: against the Kneser-Ney 3-gram on the same test text. Every row "
                "is one run at seed 0, ordered by it; seed to seed (\"Seed to seed\" below): a "
                "row rerun at other seeds, its test perplexity's mean and sample sd over them; "
                f"a row run once, the rerun federated rows within {CHANCE_SD} sd of whose mean it lies: "
                "it differs from them by no more than chance.", ""]  # fmt: skip
    out += ["## Targets", "", targets_table(runs)]
    for name in ranking_presets(runs):
        preset = PRESETS[name]
        noniid = [r for r in runs if r.get("preset") == name and r["suite"] == "noniid"]
        if "noniid" not in preset.suites:
            continue
        out += ["", f"## Non-IID phones: preset `{name}`, C 0.1; the demo by owner at C 1 too",
                "",
                "WikiText-2 with whole articles per phone (`--partition articles`: its 600 "
                "training articles dealt at random, 6 per phone, unequal sizes; the same text as "
                "the rank suite, whose centralized model and 3-gram are the reference rows) and "
                "the demo corpus with one phone per owner (`--partition user`, 22 phones: 2 a "
                "round at C 0.1, every one at C 1, where each method weighs the same phones and "
                "sampling is out of the comparison; the lrs chosen at C 0.1).", ""]  # fmt: skip
        for ds in ("wikitext-2", "demo"):
            mine = [_marked(r, stale_of[name]) for r in noniid if r["dataset"] == ds]
            central, ngram = (x and _marked(x, stale_of[name]) for x in references(runs, name, ds))
            wait = _waiting(preset, runs, "noniid", ds, mine, begun)
            chance = seed_notes(preset, runs, ds, "noniid")
            out += [f"### {_name(ds)}", "", lm_table(mine, central, ngram, wait, chance), ""]
            checked = checked_note(preset, runs, ds, "noniid")
            out += [checked, ""] if checked else []
        out += spread_section([r for r in runs if r.get("preset") == name
                               and r["suite"] in ("rank", "noniid")])  # fmt: skip
        out += [
            f"![{p.stem}]({p.name})" for k, p in plots.items() if k.startswith(f"spread:{name}")
        ]
    return out


QUESTION = (
    "Which aggregation method trains the better next-word model for a keyboard, and how far is "
    "the best federated model from a centralized one that saw as many examples, and from the "
    "Kneser-Ney 3-gram a keyboard would otherwise ship?"
)
RUNS_CSV_FIELDS = ("preset", "id", "suite", "dataset", "partition", "method", "kind", "fraction",
                   "group", "test_ppl", "best_val_ppl", "best_round", "rounds", "final_test_ppl",
                   "top1", "top3", "ksr", "unseen_test_ppl", "unseen_top1", "unseen_top3",
                   "unseen_ksr", "updates", "uplink_bytes", "downlink_bytes", "epsilon",
                   "wall_seconds", "device", "git_commit", "git_dirty", "same_run_as",
                   "command")  # fmt: skip


def runs_csv(runs: list[dict]) -> str:
    """Every run of results.json, one CSV row each: what it scored, cost and ran as."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(RUNS_CSV_FIELDS)
    for r in runs:
        row = {**r, "wall_seconds": round(run_seconds(r), 1)}
        writer.writerow(["" if row.get(k) is None else row[k] for k in RUNS_CSV_FIELDS])
    return buf.getvalue()


def answer_table(runs: list[dict]) -> str:
    """The answer in a few rows: per preset, text, phones and C, the best federated run (test
    perplexity) against the centralized model that saw as many examples and the 3-gram."""
    header = ["preset", "text (phones)", "C", "best federated", "test ppl", "centralized",
              "vs centralized", "3-gram", "top-1 vs 3-gram", "federated runs"]  # fmt: skip
    order = {"rank": 0, "noniid": 1}
    rows = []
    for name in ranking_presets(runs):
        stale = set(superseded(PRESETS[name], runs))
        mine = [r for r in runs if r.get("preset") == name and r["suite"] in order
                and r["id"] not in stale]  # fmt: skip
        groups: dict[tuple, list[dict]] = {}
        for r in mine:
            if r["kind"] == "federated" and r["fraction"] is not None:
                groups.setdefault((order[r["suite"]], r["dataset"], r["fraction"]), []).append(r)
        datasets = list(DATASET_NAMES)
        for (_suite, ds, c), fed in sorted(groups.items(), key=lambda kv: (
                kv[0][0], datasets.index(kv[0][1]) if kv[0][1] in datasets else 9, kv[0][2])):  # fmt: skip
            done = [r for r in fed if r["test_ppl"] is not None and math.isfinite(r["test_ppl"])]
            if not done:
                continue
            best = min(done, key=lambda r: r["test_ppl"])
            reference, ngram = references(runs, name, ds)
            central = next((r for r in mine if r["kind"] == "central" and r["dataset"] == ds
                            and r["fraction"] == c), None)  # fmt: skip
            if central is None and reference is not None and reference["fraction"] == c:
                central = reference
            phones = best.get("partition", "iid")
            rows.append([name, f"{_name(ds)} ({PARTITIONS.get(phones, phones)})", f"{c:g}",
                         best["method"], _f(best["test_ppl"]),
                         _f(central["test_ppl"]) if central else "-",
                         _pct(best["test_ppl"], central["test_ppl"]) if central else "-",
                         _f(ngram["test_ppl"]) if ngram else "-",
                         _x(best["top1"], ngram["top1"]) if ngram else "-",
                         str(len(done))])  # fmt: skip
    return markdown_table(header, rows) if rows else "(no ranking run done yet)"


SHOWN = 5  # at most this many bench commands or git commits are listed in results.md's header


def markdown(runs: list[dict], bench_commands: Sequence[str], choices: Mapping,
             plots: Mapping[str, Path], begun: Begun | None = None) -> str:  # fmt: skip
    """results.md: the question and its answer, the ranking, then the sweep, curves, the
    column-measure evidence, and the files that hold every run and its command."""
    commits = sorted({r["git_commit"][:10] + (" (dirty)" if r["git_dirty"] else "") for r in runs})
    devices = sorted({r["device"] for r in runs})
    presets = ranking_presets(runs)
    has_real = any(r["suite"] == "real" for r in runs)
    out = [
        "# fedkey-bench paper: which aggregation method trains the better keyboard model?",
        "",
        QUESTION,
        "",
        "## The answer",
        "",
        *real_section(runs, begun),
        *(["### The ranking protocol (PTB, WikiText-2, the demo corpus)", ""] if has_real else []),
        answer_table(runs),
        "",
        "Best federated: the federated run of lowest test perplexity at that text, phones and C "
        "(its table below); centralized: the centralized model that saw as many examples; "
        "top-1 vs 3-gram: its next-word top-1 accuracy against the Kneser-Ney 3-gram's. The "
        "rows run at the learning rates the sweep chose; a row run again one step lower "
        f"([{LR_PAGE}]({LR_PAGE})) may do better. Every "
        f"run's figures and command: [`{RUNS_CSV}`]({RUNS_CSV}), "
        "[`results.json`](results.json).",
        "",
        "## How it was run",
        "",
    ]
    for name in presets:
        out += [f"- Preset `{name}`: {PRESETS[name].note}"]
    new = list(bench_commands)
    # past SHOWN, the header counts them (naming the first and last command); results.json
    # (bench_commands) and runs.csv (git_commit) list them all
    many, hashes = len(new) > SHOWN, len(commits) > SHOWN
    out += [
        "- Produced by "
        + (
            f"{len(new)} bench commands, the first `{shown(new[0])}` and the last `{shown(new[-1])}` (all of "
            "them, in order: results.json's bench_commands)"
            if many
            else ", then ".join(f"`{shown(c)}`" for c in new) or "no bench command"
        )
        + f"; every run's own command line is in results.json and [`{RUNS_CSV}`]({RUNS_CSV}). "
        "Rebuild this file and runs.csv: "
        + ", ".join(
            f"`python -m fedkey_bench.paper.report experiments/results/{PRESETS[p].results_folder}`"
            for p in presets
        )
        + ".",
        "- Check a figure from the model kept for it (a finished run keeps its best and last "
        "rounds' checkpoints under runs/, on the machine that ran it): `fedkey evaluate "
        "runs/bench/<preset>/<run>/checkpoints/round_<best round>.safetensors` with the run's "
        "--data, --paper-protocol and --max-eval-sentences; `python -m fedkey_bench.paper.verify "
        "experiments/results/<preset>` does it for every run with its checkpoint there.",
        f"- Git commits: {', '.join(commits)}"
        if not hashes
        else f"- Git commits: {len(commits)}, {sum('dirty' in c for c in commits)} of them with "
        "changes not committed (each run's commit and whether it was clean: results.json, "
        "runs.csv)",
        f"- Devices: {', '.join(devices)}",
    ]
    out += ranking_sections(runs, plots, begun) + step_section(runs, plots.get("step"))
    for name in presets:
        out += seeds_section(PRESETS[name], runs, begun)
        for v in VARIANTS.values():
            if v.suite not in LR_SUITES:
                out += variant_section(v, PRESETS[name], runs, begun)
    out += lr_stub(runs, choices)
    curves = [p for k, p in plots.items() if k.startswith("curve:")]
    if curves:
        out += ["", "## Curves", ""] + [f"![{p.stem}]({p.name})" for p in curves]
    code = [r for r in runs if r["suite"] == "code"]
    if code:
        out += ["", "## The seed papers' column measure (evidence)", "",
                "What the seed papers' table measures, and why its perplexities are not "
                "language-model perplexities: [the seed papers]"
                "(../../../docs/explanation/seed-papers.md). These runs reproduce their measure.",
                "", code_table(code)]  # fmt: skip
        out += [f"![{p.stem}]({p.name})" for k, p in plots.items() if k.startswith("code:")]
    return "\n".join(out) + "\n"


def draw(runs: list[dict], out: Path) -> dict[str, Path]:
    """Every figure: kind:key -> path (kinds: curve, spread, code; and step)."""
    plots: dict[str, Path | None] = {}
    for name in ranking_presets(runs):
        mine = [r for r in runs if r.get("preset") == name]
        for suite in ("rank", "noniid"):
            for ds in NAMES:
                sel = [r for r in mine if r["suite"] == suite and r["dataset"] == ds]
                for tag, part in by_central(sel).items():  # one figure per centralized model
                    title = f"{_name(ds)}, {suite}{tag.replace('_c', ', C ')} ({name})"
                    plots[f"curve:{name}:{suite}:{ds}{tag}"] = plot_curves(
                        part, out, f"curves_{name}_{suite}_{ds}{tag}.png", title
                    )
        # the seeds and variant suites: each run labelled beside the rank runs it repeats
        for suite, labelled, what in (
            ("seeds", seed_curves(PRESETS[name], runs), "seed to seed"),
            *((v.suite, variant_curves(v, PRESETS[name], runs), f"{v.after} against {v.before}")
              for v in VARIANTS.values() if v.suite in PRESETS[name].suites),
        ):  # fmt: skip
            for ds in NAMES:
                sel = [r for r in labelled if r["dataset"] == ds]
                plots[f"curve:{name}:{suite}:{ds}"] = plot_curves(
                    sel, out, f"curves_{name}_{suite}_{ds}.png", f"{_name(ds)}, {what} ({name})"
                )
        for ds in NAMES:
            sel = [r for r in mine if r["suite"] == "sweep" and r["dataset"] == ds]
            plots[f"curve:{name}:sweep:{ds}"] = plot_curves(
                sel,
                out,
                f"curves_{name}_sweep_{ds}.png",
                f"{_name(ds)}, sweep ({name})",
                split="val",
            )
        sel = [r for r in mine if r["suite"] == "noniid" or (r["suite"] == "rank" and r["dataset"]
                                                             == "wikitext-2")]  # fmt: skip
        plots[f"spread:{name}"] = plot_spread(
            sel, out, f"spread_{name}.png", f"the server's weights per round ({name})"
        )
        for ds, sel in real_curves(runs, name).items():
            title = f"{_name(ds)}: FedAvg by cohort, and the centralized model ({name})"
            plots[f"real:{name}:{ds}"] = plot_curves(
                sel, out, f"curves_{name}_real_{ds}.png", title, xlabel=PHONES_TRAINED,
                top=real_curve_top(sel),
            )  # fmt: skip
    plots["step"] = plot_steps(runs, out, "attopt_step.png")
    for ds in DATASET_NAMES:
        sel = [r for r in runs if r["suite"] == "code" and r["dataset"] == ds]
        title = f"{DATASET_NAMES[ds]}, as the seed papers' code ran (column perplexity)"
        plots[f"code:{ds}"] = plot_curves(sel, out, f"curves_code_{ds}.png", title, "col_curve")
    return {k: p for k, p in plots.items() if p is not None}


def write_report(
    runs: list[dict],
    out: Path,
    bench_commands: Sequence[str] = (),
    choices: Mapping | None = None,
    begun: Begun | None = None,
) -> Path:
    """OUT/results.md, the pages beside it (learning rates, real typing), OUT/runs.csv and
    OUT/*.png from results.json's run objects (and its runs `begun`).
    Runs of a suite the bench no longer has (the old 8-round cut's, in cpu/results.json) stay
    in results.json, the record of what ran, and are left out of the report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RUNS_CSV).write_text(runs_csv(runs))  # every run results.json holds
    runs = [r for r in runs if r["suite"] in SUITES]
    plots = draw(runs, out)
    path = out / "results.md"
    path.write_text(markdown(runs, list(bench_commands), choices or {}, plots, begun))
    (out / LR_PAGE).write_text(lr_markdown(runs, choices or {}, begun))
    if any(r["suite"] == "real" for r in runs):
        (out / REAL_PAGE).write_text(real_markdown(runs, begun, plots))
    return path


def write(folder: Path) -> list[dict]:
    """Regenerate FOLDER/results.md and its curves from FOLDER/results.json."""
    bench = Bench(folder)
    runs = bench.read()
    for r in runs:  # the seed papers' numbers are this file's constants, as they are now
        r["seed_ppl"] = seed_number(
            r["suite"], r["dataset"], r["method"], r["fraction"], r["group"]
        )
    write_report(runs, folder, bench.commands(), bench.lr_choices(), bench.begun())
    return runs


if __name__ == "__main__":
    write(Path(sys.argv[1]))
    print(Path(sys.argv[1]) / "results.md")
