"""Seed to seed: how far a ranking row moves by chance alone (the seeds suite's section of
`fedkey-bench paper`'s report).

The seeds suite (fedkey_bench.paper.suites.seeds_suite) runs some rank rows (and some of the noniid
suite's) again at other seeds; each row here is one run at seed 0 and its reruns, with the same
learning rates.
A difference between two methods that is not larger than these spreads is no evidence that one
is better. Written from results.json's objects alone (no torch), as the rest of the report.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace

from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.paper.presets import Preset
from fedkey_bench.paper.suites import OTHER_SEEDS, seeds_suite, source_suite
from fedkey_bench.paper.sweep import every_knob_chosen
from fedkey_bench.paper.tables import NAMES, PARTITIONS, Begun, _c, _f, _where

#: The seeds of a row: the rank run's own, then the suite's.
ALL_SEEDS = (0, *OTHER_SEEDS)
#: A row run once and within this many sample sds of a rerun row's mean is no evidence of a
#: difference from it (about 95% of a normal spread; three seeds estimate the sd only roughly).
CHANCE_SD = 2


def _row_key(r: dict) -> tuple:
    return r["dataset"], r.get("partition", "iid"), r["method"], r["fraction"]


def seed_rows(preset: Preset, runs: list[dict]) -> list[tuple[dict[int, str], dict[int, dict]]]:
    """Per row the seeds suite plans for `preset`, in its order: (seed -> the id of its run, the
    rank or noniid run's it repeats for seed 0; seed -> its run, those done)."""
    mine = [r for r in runs if r.get("preset") == preset.name]
    ids: dict[tuple, dict[int, str]] = {}
    for s in seeds_suite(preset, mine, every_knob_chosen()):  # every row, chosen or not
        row = ids.setdefault((s.dataset, s.partition, s.method, s.fraction), {})
        row[0], row[s.seed] = replace(s, suite=source_suite(s), seed=0).id, s.id
    first = {row[0] for row in ids.values()}
    done: dict[tuple, dict[int, dict]] = {}
    for r in mine:
        if r["suite"] == "seeds" or r["id"] in first:
            done.setdefault(_row_key(r), {})[r.get("seed", 0)] = r
    return [(row, done.get(key, {})) for key, row in ids.items()]


def seed_notes(
    preset: Preset, runs: list[dict], dataset: str, suite: str = "rank"
) -> dict[str, str]:
    """The "seed to seed" cells of `suite`'s table for `dataset`, by run id: a row done at
    several seeds gets the mean and sample sd of its test perplexity over them; a row run once,
    the rerun federated rows within `CHANCE_SD` sds of whose mean it lies (a difference from
    those is no evidence). Empty where no row of the table is done at two seeds or more."""
    seeded = [(ids[0], by_seed[0], [r["test_ppl"] for r in by_seed.values()])
              for ids, by_seed in seed_rows(preset, runs)
              if len(by_seed) > 1 and 0 in by_seed and by_seed[0]["dataset"] == dataset
              and by_seed[0]["suite"] == suite]  # fmt: skip
    spread = {
        rid: (ref, statistics.fmean(p), statistics.stdev(p), len(p)) for rid, ref, p in seeded
    }
    notes = {rid: f"mean {_f(m)}, sd {_f(sd)} ({n} seeds)" for rid, (_, m, sd, n) in spread.items()}
    for r in runs:
        if (notes and r.get("preset") == preset.name and r["suite"] == suite
                and r["dataset"] == dataset and r["kind"] == "federated"
                and r["id"] not in notes):  # fmt: skip
            near = [ref["method"] for ref, m, sd, _ in spread.values()
                    if ref["kind"] == "federated" and abs(r["test_ppl"] - m) <= CHANCE_SD * sd]  # fmt: skip
            notes[r["id"]] = f"within {CHANCE_SD} sd of {' and '.join(near)}" if near else "-"
    return notes


def seeds_table(preset: Preset, runs: list[dict], begun: Begun | None = None) -> str:
    """One row per row the seeds suite repeats: its test perplexity at each seed (a run not
    done: where it stands), their mean, sample standard deviation and range, the mean against
    the centralized model's mean over its seeds and each seed's run against that seed's
    centralized model (paired: on the demo corpus the seed draws the test text too), and
    top-1's mean and sd."""
    begun = begun or {}
    header = ["dataset", "method", "C", *(f"test ppl, seed {k}" for k in ALL_SEEDS), "mean",
              "sd", "range (% of mean)", "mean vs centralized mean",
              "vs centralized, same seed (by seed)", "top-1: mean", "top-1: sd",
              "best round, by seed"]  # fmt: skip
    # (run ids, runs done by seed, one of them to name the row by, their mean test perplexity)
    done = [(ids, by_seed, next(iter(by_seed.values())),
             statistics.fmean(r["test_ppl"] for r in by_seed.values()))
            for ids, by_seed in seed_rows(preset, runs) if by_seed]  # fmt: skip
    # each row against the centralized model of its text and C (the gpu preset has two for PTB)
    central = {(ref["dataset"], ref["fraction"]): (m, by_seed) for _, by_seed, ref, m in done
               if ref["kind"] == "central"}  # fmt: skip
    rows = []
    for ids, by_seed, ref, m in done:
        cells = []
        for k in ALL_SEEDS:
            at = begun.get(f"{preset.name}/{ids[k]}")
            cells.append(_f(by_seed[k]["test_ppl"]) if k in by_seed else _where(at, ref["kind"]))
        ppl = [by_seed[k]["test_ppl"] for k in ALL_SEEDS if k in by_seed]
        top1 = [by_seed[k]["top1"] for k in ALL_SEEDS if by_seed.get(k, {}).get("top1") is not None]
        many = len(ppl) > 1
        base, twins = (central.get((ref["dataset"], ref["fraction"]), (None, {}))
                       if ref["kind"] == "federated" else (None, {}))  # fmt: skip
        paired = [f"{(by_seed[k]['test_ppl'] / twins[k]['test_ppl'] - 1) * 100:+.1f}%"
                  if k in by_seed and k in twins else "-" for k in ALL_SEEDS]  # fmt: skip
        text = NAMES.get(ref["dataset"], ref["dataset"])
        phones = ref.get("partition", "iid")
        rows.append([
            f"{text}, {PARTITIONS[phones]}" if phones != "iid" else text, ref["method"],
            _c(ref["fraction"]) if ref["kind"] == "federated" else "-", *cells, _f(m),
            _f(statistics.stdev(ppl)) if many else "-",
            f"{(max(ppl) - min(ppl)) / m * 100:.1f}%" if many else "-",
            f"{(m / base - 1) * 100:+.1f}%" if base else "-",
            " / ".join(paired) if twins else "-",
            _f(statistics.fmean(top1), ".4f") if top1 else "-",
            _f(statistics.stdev(top1), ".4f") if len(top1) > 1 else "-",
            " / ".join(str(by_seed[k]["best_round"]) if k in by_seed else "-" for k in ALL_SEEDS),
        ])  # fmt: skip
    return markdown_table(header, rows) if rows else ""


def seeds_section(preset: Preset, runs: list[dict], begun: Begun | None = None) -> list[str]:
    """The report's section on the seeds suite of `preset` (none if it has no such suite)."""
    if "seeds" not in preset.suites:
        return []
    table = seeds_table(preset, runs, begun)
    seeds = ", ".join(str(k) for k in OTHER_SEEDS)
    return [
        "", f"## Seed to seed: how far a row moves by chance (preset `{preset.name}`)", "",
        f"The seeds suite runs these rows of the ranking and non-IID tables again at seeds "
        f"{seeds} (those tables' runs are seed 0): the same learning rates; the seed deals the "
        "data to the phones, draws the initial weights and picks each round's phones. On the "
        "demo corpus it also draws which of each owner's messages are held out for validation "
        "and test, so its rows move with their test text too (each seed's centralized model "
        "is trained and tested on that seed's split). A difference between two rows of the "
        "ranking that is not well beyond a row's range here is no evidence that one method is "
        "better. sd: the sample standard deviation over the seeds done; mean vs centralized "
        "mean: the 10% target held against the means; vs centralized, same seed: each "
        "seed's run against that seed's centralized model (the pairs the demo corpus needs, "
        "where the test text moves with the seed). Seed 0 is the table's own run, "
        "from an earlier commit than the reruns when the code changed between them "
        "(results.json's git_commit).", "",
        table or "No run of the seeds suite's rows is done yet.",
    ]  # fmt: skip


def seed_curves(preset: Preset, runs: list[dict]) -> list[dict]:
    """The runs of every seeds row, labelled with their seed, for one figure of curves: a colour
    per row, a line style per seed."""
    styles = dict(zip(ALL_SEEDS, ("-", "--", ":"), strict=True))
    out: list[dict] = []
    drawn: Counter[str] = Counter()  # rows drawn so far per dataset (a figure per dataset)
    for _, by_seed in seed_rows(preset, runs):
        for k, r in sorted(by_seed.items()):
            line = (drawn[r["dataset"]], styles[k])
            out.append({**r, "method": f"{r['method']}, seed {k}", "line": line})
        drawn.update({r["dataset"] for r in by_seed.values()})
    return out
