"""The layout of `fedkey-bench paper`'s results.md, on small synthetic rows: it
opens with the question and its answer, then perplexity and keyboard metrics per method beside
the centralized model and the n-gram, the targets, the non-IID phones and their weights' spread,
what was chosen by the sweep (learning-rates.md: the sweep and its check), the curves, and the
column-measure evidence; every run and its command in runs.csv. And the committed cpu results
rebuild a page of at most 30 KB."""

import math

import pytest

from fedkey_bench.paper.learning_rates import lr_markdown
from fedkey_bench.paper.report import (
    answer_table,
    markdown,
    runs_csv,
    targets_table,
    write_report,
)
from fedkey_bench.paper.results import Bench
from fedkey_bench.paper.runner import summarize
from fedkey_bench.paper.spec import RunSpec
from fedkey_bench.paper.tables import by_central, lm_table


def run(suite, dataset, method, fraction, ppls, *, kind="federated", preset="cpu", top1=0.2,
        group="", partition="iid", weights=None, seed=0, tag=""):  # fmt: skip
    rows = [{"round": i, "val_ppl": p + 1, "test_ppl": p, "top1": top1, "top3": 0.3, "ksr": 0.4,
             "aggregated": ["a", "b"] * (i > 0),
             "info": {"attention_mean": weights} if weights and i else {}}
            for i, p in enumerate(ppls)]  # fmt: skip
    spec = RunSpec(suite, dataset, method, fraction, kind=kind, group=group, partition=partition,
                   seed=seed, tag=tag)  # fmt: skip
    return {"id": f"{spec.id}", **summarize(rows, spec), "wall_seconds": 60.0,
            "command": f"fedkey simulate --lr 1 --id {spec.id}", "git_commit": "abcdef1234",
            "git_dirty": False, "device": "cpu", "preset": preset, "seed_ppl": None}  # fmt: skip


CENTRAL = "centralized, 5 epochs (as many examples as C 0.1)"


def ranking_runs():
    return [
        run("sweep", "ptb", "FedAvg, client lr 1", 0.1, [1000, 300], group="client_lr=1"),
        run("sweep", "ptb", "FedAvg, client lr 3", 0.1, [1000, 350], group="client_lr=3"),
        run("rank", "ptb", CENTRAL, 0.1, [1000, 150], kind="central", top1=0.25),
        run("rank", "ptb", "Kneser-Ney 3-gram", None, [200], kind="ngram", top1=0.16),
        run("rank", "ptb", "FedAvg", 0.1, [1000, 180, 160], top1=0.22),
        run(
            "rank", "ptb", "FedAtt", 0.1, [1000, 170, 164], top1=0.21, weights={"a": 0.6, "b": 0.4}
        ),  # fmt: skip
        run(
            "noniid",
            "wikitext-2",
            "FedAtt",
            0.1,
            [1000, 400, 390],
            partition="articles",
            weights={"a": 0.9, "b": 0.1},
        ),  # fmt: skip
        # a code-suite run of the old cpu-8round preset (cpu/results.json): the evidence section
        run("code", "ptb", "FedAvg", 0.1, [1000, 900], preset="cpu-8round"),
    ]


def test_results_open_with_the_answer_then_the_language_model_and_end_with_the_evidence():
    cmds = ["fedkey-bench paper --preset cpu"]
    md = markdown(ranking_runs(), cmds, {"cpu": {"ptb": {
        "client_lr": 1.0}}}, {})  # fmt: skip
    heads = [line for line in md.splitlines() if line.startswith("## ")]
    assert md.split("\n\n")[1].startswith("Which aggregation method trains the better")
    assert heads[:2] == ["## The answer", "## How it was run"]
    order = ["## The answer", "## Language model", "## Targets", "## Non-IID phones",
             "## Seed to seed", "## A learning-rate schedule", "## Dropout 0.5 against",
             "## Learning rates, chosen on the validation set", "## The seed papers' column "
             "measure"]  # fmt: skip
    at = [next(i for i, h in enumerate(heads) if h.startswith(o)) for o in order]
    assert at == sorted(at), heads
    assert (
        "**7 of 263 runs done** (sweep 2 of 150, rank 4 of 28, noniid 1 of 36, seeds 0 of 16, "
        "decay 0 of 3, dropout 0 of 6, confirm 0 of 24;" in md
    )
    first = md.split("### PTB")[1].split("###")[0]
    assert f"**{CENTRAL}**" in first and "**Kneser-Ney 3-gram**" in first
    assert first.count("| centralized") + first.count("**centralized") == 1  # not twice
    assert first.index("| FedAvg |") < first.index("| FedAtt |")  # best test ppl first
    assert "| FedAttOpt | 0.1 | not run yet |" in first  # the C it will run at
    assert "| AdaFL + FedAtt | - | not run yet |" in first  # AdaFL sets its own C
    produced = next(line for line in md.splitlines() if line.startswith("- Produced by"))
    assert "`fedkey-bench paper --preset cpu`;" in produced
    assert "## Appendix" not in md
    # the lists of every run and command are in runs.csv and results.json, not on the page
    assert "## Every run" not in md and "## Commands" not in md and "runs.csv" in md
    stub = md.split("## Learning rates")[1].split("\n## ")[0]
    assert "PTB: client lr 1." in stub and "[learning-rates.md](learning-rates.md)" in stub
    sweep = lr_markdown(ranking_runs(), {"cpu": {"ptb": {"client_lr": 1.0}}})
    sweep = sweep.split("## Learning rates")[1].split("\n## ")[0]
    assert "| PTB (100 IID phones) | client lr | 1, 3 | 1 | 301.00 | 2 |" in sweep
    assert "client lr 1" in sweep


def test_the_seeds_section_holds_each_row_at_every_seed_beside_its_spread():
    """A rank row and its reruns at other seeds: each seed's test perplexity (or where a run
    not done stands), the mean, the sample sd and the range, in the seeds suite's order."""
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.seeds import seeds_table

    runs = ranking_runs() + [
        run("seeds", "ptb", "FedAvg", 0.1, [1000, 180, 170], top1=0.24, seed=1),
        run("seeds", "ptb", "FedAvgM", 0.1, [1000, 150], top1=0.24, seed=2),
    ]
    begun = {"cpu/seeds-ptb-fedavg-c0.1-seed2": [3, 50]}
    table = seeds_table(PRESETS["cpu"], runs, begun)
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == [CENTRAL, "FedAvg", "FedAvgM"]
    # rank FedAvg (seed 0) 160, seed 1 170: mean 165, sd 7.07, range 10 / 165
    # against the centralized model's mean (150, one seed so far): +10.0%; seed 0's own: +6.7%
    assert rows[1] == ("| PTB | FedAvg | 0.1 | 160.00 | 170.00 | begun: round 3 of 50 | 165.00 | "
                       "7.07 | 6.1% | +10.0% | +6.7% / - / - | 0.2300 | 0.0141 | 2 / 2 / - |")  # fmt: skip
    assert "| - | 150.00 | not run yet | not run yet | 150.00 | - | - | - | - | 0.2500 |" in rows[0]
    # paired: seed 0's 160 against the centralized model's seed 0 (150); FedAvgM has no pair yet
    assert "| not run yet | not run yet | 150.00 | 150.00 | - | - | +0.0% | - / - / - |" in rows[2]
    md = markdown(runs, [], {}, {}, begun)
    assert "## Seed to seed: how far a row moves by chance (preset `cpu`)" in md
    assert "**9 of 263 runs done**" in md and "seeds 2 of 16" in md


def test_the_confirm_suite_checks_the_demo_by_owner_against_its_noniid_runs():
    """On the demo corpus by owner the confirm rows repeat the noniid suite's runs: the row at
    the sweep's server lr is the noniid run itself, the lower one beside it; the note under the
    noniid demo table says which lr validation kept; the targets table (IID phones) and the
    rank tables' notes leave the demo out."""
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.variants import VARIANTS, checked_note, variant_table

    v, p = VARIANTS["confirm"], PRESETS["cpu"]
    runs = ranking_runs() + [
        # the sweep's server lr (1, a placeholder here) diverged after round 1: best val 301
        run("noniid", "demo", "FedAvgM", 0.1, [1000, 300, 900], partition="user"),
        run("confirm", "demo", "FedAvgM", 0.1, [1000, 200, 20], partition="user",
            tag="server-lr0.3"),
    ]  # fmt: skip
    rows = [r.split(" | ") for r in variant_table(v, p, runs).splitlines() if "| FedAvgM |" in r]
    demo = [r for r in rows if r[0] == "| demo corpus (one phone per owner)"]
    # server lr 1 (the noniid run, test 300), 0.3 (test 20, kept), 0.1 asked for: 0.3 won
    assert [r[3] for r in demo] == ["1", "0.3", "0.1"]
    assert demo[0][5:7] == ["300.00", "300.00"] and demo[1][5:7] == ["300.00", "20.00"]
    assert demo[1][-1] == "yes |" and "not run yet" in demo[2][6]
    note = checked_note(p, runs, "demo", "noniid")
    assert "FedAvgM's server lr 1 gave way to server lr 0.3 (test 20.00)" in note
    assert "demo" not in checked_note(p, runs, "ptb") and not checked_note(p, runs, "demo")
    assert "demo" not in targets_table(runs)
    md = markdown(runs, [], {}, {}, {})
    noniid = md.index("## Non-IID phones")
    assert md.index(note) > md.index("### demo corpus", noniid)


def test_the_decay_section_sets_each_decayed_run_beside_its_constant_lr_twin():
    """Each decay row: the rank run's test perplexity at a constant lr, the decayed run's, the
    change, and the federated rows against the centralized model decayed alike; the targets
    table adds a row for the decayed runs against that centralized model."""
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.variants import VARIANTS, variant_table

    runs = ranking_runs() + [
        run("decay", "ptb", CENTRAL, 0.1, [1000, 140], kind="central", top1=0.26),
        run("decay", "ptb", "FedAvg", 0.1, [1000, 150, 147], top1=0.24),
    ]
    begun = {"cpu/decay-ptb-fedavgm-c0.1": [7, 50]}
    rows = variant_table(VARIANTS["decay"], PRESETS["cpu"], runs, begun).splitlines()[2:]
    assert [r.split(" | ")[0][2:] for r in rows] == [CENTRAL, "FedAvg", "FedAvgM"]
    # 150 -> 140: -6.7%; FedAvg 160 -> 147 (-8.1%), +5.0% from the decayed centralized 140;
    # top-1 0.24 against the 3-gram's 0.16: 1.50x
    assert rows[0].startswith(
        f"| {CENTRAL} | - | 0.5987 an epoch | 1 | 150.00 | 140.00 | -6.7% | - |"
    )
    assert rows[1] == ("| FedAvg | 0.1 | 0.95 a round | 1 | 160.00 | 147.00 | -8.1% | +5.0% "
                       "| 0.240 | 1.50x | 2 / 2 | yes |")  # fmt: skip
    assert rows[2].startswith("| FedAvgM | 0.1 | 0.95 a round | 1 | - | begun: round 7 of 50 |")
    targets = targets_table(runs).splitlines()
    # constant lr: FedAvg 160 against 150 (+6.7%); decayed: 147 against 140 (+5.0%)
    assert targets[2].startswith("| cpu | PTB | FedAvg | 160.00 | 150.00 | yes (+6.7%) |")
    assert targets[3].startswith(
        "| cpu, lr decayed | PTB | FedAvg | 147.00 | 140.00 | yes (+5.0%) |"
    )
    assert "decay 2 of 3" in markdown(runs, [], {}, {}, begun)


def test_the_dropout_section_keeps_of_each_row_the_lr_with_the_better_validation():
    """Each dropout row runs at the rank run's lr (1 here) and the next larger (3): both are
    listed beside the rank run without dropout, and once both are done the one with the better
    VALIDATION perplexity is kept, for the targets table and as the centralized reference (never
    the better test perplexity); until then the one at the rank run's lr."""
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.variants import VARIANTS, variant_table

    def with_val(r, val):
        return {**r, "best_val_ppl": val}

    runs = ranking_runs() + [
        run("dropout", "ptb", CENTRAL, 0.1, [1000, 120], kind="central", top1=0.26),
        with_val(run("dropout", "ptb", CENTRAL, 0.1, [1000, 125], kind="central", tag="lr3"), 100),
        run("dropout", "ptb", "FedAvg", 0.1, [1000, 140, 138], top1=0.24),
    ]
    table = variant_table(VARIANTS["dropout"], PRESETS["cpu"], runs).splitlines()
    assert table[0].startswith(
        "| method | C | dropout | lr | test ppl, no dropout | test ppl, dropout | change |"
    )
    assert [r.split(" | ")[3] for r in table[2:]] == ["1", "3"] * 3
    # the centralized run at lr 3 is kept (validation 100 against 121) though its test is worse:
    # FedAvg 160 -> 138 (-13.7%), +10.4% from it (125)
    assert table[2].endswith("| 1.62x | 1 / 1 |  |") and table[3].endswith("| 1 / 1 | yes |")
    assert table[4].startswith("| FedAvg | 0.1 | 0.5 | 1 | 160.00 | 138.00 | -13.7% | +10.4% |")
    assert table[4].endswith("| yes |")  # its lr-3 twin not done yet: the rank lr's run
    assert table[5].startswith("| FedAvg | 0.1 | 0.5 | 3 | 160.00 | not run yet |")
    target = targets_table(runs).splitlines()[3]
    assert target.startswith("| cpu, dropout | PTB | FedAvg | 138.00 | 125.00 | no (+10.4%) |")
    # FedAvg at lr 3 done, better on validation: it is kept, and the targets row follows
    runs.append(with_val(run("dropout", "ptb", "FedAvg", 0.1, [1000, 150], tag="lr3"), 90))
    target = targets_table(runs).splitlines()[3]
    assert target.startswith("| cpu, dropout | PTB | FedAvg | 150.00 | 125.00 | no (+20.0%) |")
    md = markdown(runs, [], {}, {})
    assert "## Dropout 0.5 against overfitting (preset `cpu`)" in md and "dropout 4 of 6" in md


def test_a_confirm_row_at_the_sweeps_value_shows_its_rank_run_begun():
    """The confirm row at the sweep's value is the rank run itself: while that one is begun, the
    row says how far it got (not "not run yet"); its run one step lower is its own."""
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.variants import VARIANTS, variant_table

    begun = {"cpu/rank-ptb-fedavgm-c0.1": [12, 50, 141.5, 12]}
    rows = variant_table(VARIANTS["confirm"], PRESETS["cpu"], ranking_runs(), begun).splitlines()
    fedavgm = [r for r in rows if r.startswith("| PTB | FedAvgM |")]
    assert "| begun: round 12 of 50 (best val ppl so far 141.50, round 12) |" in fedavgm[0]
    assert all("not run yet" in r for r in fedavgm[1:]) and len(fedavgm) == 2


def test_the_confirm_section_checks_the_sweeps_lr_against_one_step_lower():
    """Each confirm row sets the rank run (the sweep's lr, standing for its twin before the bench
    records it) beside the runs one grid step lower (a second step where the first won); nothing
    of a row is kept until all of its runs are done; then the best on VALIDATION is kept, the
    centralized reference too, and the targets row follows the kept runs."""
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.variants import VARIANTS, variant_curves, variant_table

    v, p = VARIANTS["confirm"], PRESETS["cpu"]

    def with_val(r, val):
        return {**r, "best_val_ppl": val}

    runs = ranking_runs() + [
        run("rank", "ptb", "FedAvgM", 0.1, [1000, 140, 130], top1=0.23),
        run("confirm", "ptb", "FedAvg", 0.1, [1000, 170, 155], tag="lr0.3"),
    ]
    # 0.3 won on validation (156 against 161): one step lower asked for; until it is done, the
    # best so far is kept
    rows = variant_table(v, p, runs).splitlines()
    assert rows[5].endswith("| 2 / 2 | yes |") and "not run yet" in rows[6]
    runs.append(run("confirm", "ptb", "FedAvg", 0.1, [1000, 175, 165], tag="lr0.1"))
    rows = variant_table(v, p, runs).splitlines()
    assert rows[0].startswith("| dataset | method | C | server lr | lr | test ppl, sweep's choice "
                              "| test ppl, lr checked at full length | change |")  # fmt: skip
    # the sweep chose lr 1 (ranking_runs' sweep): FedAvg's twin, its run at 0.3 (better on
    # validation: 156 against 161) and so at 0.1 (166: worse, the last), 0.3 kept; the
    # centralized model at 0.3 not run yet
    assert [r.split(" | ")[:6] for r in rows[2:7]] == [
        ["| PTB", CENTRAL, "-", "-", "1", "150.00"],
        ["| PTB", CENTRAL, "-", "-", "0.3", "150.00"],
        ["| PTB", "FedAvg", "0.1", "-", "1", "160.00"],
        ["| PTB", "FedAvg", "0.1", "-", "0.3", "160.00"],
        ["| PTB", "FedAvg", "0.1", "-", "0.1", "160.00"],
    ]  # fmt: skip
    # WikiText-2's rows, then the demo's by owner: no sweep there, so none of their runs yet
    assert [r.split(" | ")[0] for r in rows[11:]] == ["| WikiText-2"] * 8 + [
        "| demo corpus (one phone per owner)"
    ] * 8 and all("not run yet" in r for r in rows[10:])
    assert rows[2].endswith("| 1 / 1 |  |") and "not run yet" in rows[3]
    assert rows[4].endswith("| 2 / 2 |  |") and rows[5].endswith("| 2 / 2 | yes |")
    assert rows[6].endswith("| 2 / 2 |  |")
    # the centralized run at 0.3 is not done: no reference yet
    targets = [line for line in targets_table(runs).splitlines() if "lr checked" in line]
    assert targets == [
        "| cpu, lr checked at full length | PTB | FedAvg | 155.00 | not done yet | - (-) | "
        "0.200 (FedAvg) | 0.160 | yes (1.25x) |"
    ]
    runs.append(with_val(run("confirm", "ptb", CENTRAL, 0.1, [1000, 120], kind="central",
                             tag="lr0.3"), 200))  # fmt: skip
    targets = [line for line in targets_table(runs).splitlines() if "lr checked" in line]
    # the centralized model at 0.3 is worse on validation (200 against 151): its rank run at 1
    # (test 150) is the reference, though 0.3's test is better; FedAvg at 0.3: 155, +3.3%
    assert targets == [
        "| cpu, lr checked at full length | PTB | FedAvg | 155.00 | 150.00 | yes (+3.3%) | "
        "0.200 (FedAvg) | 0.160 | yes (1.25x) |"
    ]
    # the curves: the rank runs once each, the runs one step lower labelled by their lr
    labels = [r["method"] for r in variant_curves(v, p, runs)]
    assert labels == [f"{CENTRAL}, sweep's choice", f"{CENTRAL}, lr checked at full length, "
                      "lr 0.3", "FedAvg, sweep's choice", "FedAvg, lr checked at full length, "
                      "lr 0.3", "FedAvg, lr checked at full length, lr 0.1",
                      "FedAvgM, sweep's choice"]  # fmt: skip
    # under the PTB rank table, which rows were checked and where the sweep's choice gave way;
    # the table itself keeps the sweep's choices (FedAvg at lr 1: 160)
    ptb = markdown(runs, [], {}, {}).split("### PTB")[1].split("###")[0]
    assert "| FedAvg | 0.1 | 160.00 |" in ptb
    assert (
        'Checked at full length ("The sweep\'s learning rates checked at full length" below, '
        "kept on validation): FedAvg's lr 1 gave way to lr 0.3 (test 155.00, +3.3% from the "
        "centralized model); the centralized model: the sweep's choice held."
    ) in ptb
    # FedAvgM's lower run not done: unchecked, unnamed; a row nothing checked says nothing
    assert "FedAvgM" not in ptb.split("Checked at full length")[1]
    assert "Checked at full length" not in markdown(ranking_runs(), [], {}, {})


def test_the_rank_table_marks_what_chance_alone_could_explain():
    """A row rerun at other seeds shows its mean and sd in the ranking; a row run once is marked
    where it lies within 2 sd of a rerun federated row's mean, and only there."""
    runs = ranking_runs() + [
        run("seeds", "ptb", "FedAvg", 0.1, [1000, 170], seed=1),  # with 160: mean 165, sd 7.07
        run("seeds", "ptb", CENTRAL, 0.1, [1000, 152], kind="central", seed=1),
        run("rank", "ptb", "FedAdam", 0.1, [1000, 180]),  # 15 from 165: beyond 2 sd
    ]
    ptb = markdown(runs, [], {}, {}).split("### PTB")[1].split("###")[0]
    assert ptb.splitlines()[2].endswith("| best round / rounds | seed to seed |")
    cell = {line.split(" | ")[0][2:]: line.split(" | ")[-1] for line in ptb.splitlines()[4:]}
    assert cell["FedAvg"] == "mean 165.00, sd 7.07 (2 seeds) |"
    assert cell[f"**{CENTRAL}**"] == "mean 151.00, sd 1.41 (2 seeds) |"
    assert cell["FedAtt"] == "within 2 sd of FedAvg |"  # 164: 1 from the mean
    assert cell["FedAdam"] == "- |" and cell["**Kneser-Ney 3-gram**"] == "- |"
    # no row at two seeds: no such column
    wt2 = markdown(runs, [], {}, {}).split("### WikiText-2")[1].split("###")[0]
    assert "| best round / rounds |\n" in wt2


def test_the_demo_by_owner_at_c1_is_seeded_against_its_own_centralized_model():
    """The demo's C 1 rows rerun at other seeds: the seeds table names the phones and holds the
    row against the mean of the centralized model of its C (50 epochs), not C 0.1's; the
    non-IID table gets the seed-to-seed cells, and its C 0.1 rows stay unseeded."""
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.seeds import seeds_table

    c1, c01 = "centralized, 50 epochs", "centralized, 5 epochs"
    runs = ranking_runs() + [
        run("noniid", "demo", c01, 0.1, [100, 4.7], kind="central"),
        run("noniid", "demo", c1, 1.0, [100, 4.0], kind="central"),
        run("seeds", "demo", c1, 1.0, [100, 6.0], kind="central", seed=1),
        run("noniid", "demo", "FedAvgM", 1.0, [100, 4.8], partition="user"),
        run("seeds", "demo", "FedAvgM", 1.0, [100, 5.2], partition="user", seed=1),
        run("noniid", "demo", "FedAvg", 0.1, [100, 11.0], partition="user"),
    ]
    table = seeds_table(PRESETS["cpu"], runs).splitlines()[2:]
    rows = {line.split(" | ")[1]: line for line in table}
    # FedAvgM's mean 5.0 against the 50-epoch model's mean 5.0 (4.0 and 6.0), not 4.7
    assert rows["FedAvgM"].startswith("| demo corpus, one phone per owner | FedAvgM | 1 | 4.80 |")
    assert "| 5.00 | 0.28 | 8.0% | +0.0% | +20.0% / -13.3% / - |" in rows["FedAvgM"]  # paired
    assert rows[c1].startswith(f"| demo corpus | {c1} | - | 4.00 | 6.00 |")
    demo = markdown(runs, [], {}, {}).split("## Non-IID phones")[1].split("### demo corpus")[1]
    demo = demo.split("\n#")[0]
    cell = {(line.split(" | ")[0][2:], line.split(" | ")[1]): line.split(" | ")[-1]
            for line in demo.splitlines()[4:]}  # fmt: skip
    assert cell["FedAvgM", "1"] == "mean 5.00, sd 0.28 (2 seeds) |"
    assert cell[f"**{c1}**", "-"] == "mean 5.00, sd 1.41 (2 seeds) |"
    assert cell["FedAvg", "0.1"] == "- |"  # 11.0: far from FedAvgM's 5.0


def test_method_rows_are_held_against_the_ceiling_and_the_ngram():
    runs = ranking_runs()
    central, ngram = runs[2], runs[3]
    table = lm_table(runs[4:6], central, ngram)
    fedavg = next(line for line in table.splitlines() if line.startswith("| FedAvg |"))
    # 160 vs 150: +6.7%; top-1 0.22 vs the 3-gram's 0.16: 1.38x; best of 2 rounds at round 2
    assert fedavg == "| FedAvg | 0.1 | 160.00 | +6.7% | 0.220 | 1.38x | 0.300 | 0.400 | 2 / 2 |"
    # at C 0.5 (gpu), against the centralized model of as many examples as C 0.5
    c05 = run("rank", "ptb", "centralized, 125 epochs", 0.5, [1000, 120], kind="central")
    at05 = run("rank", "ptb", "FedAvg", 0.5, [1000, 132])
    table = lm_table([c05, at05, *runs[4:6]], central, ngram)
    assert (
        "| FedAvg | 0.5 | 132.00 | +10.0% |" in table
        and "| FedAvg | 0.1 | 160.00 | +6.7% |" in table
    )
    assert "| **centralized, 125 epochs** | - | 120.00 | -20.0% |" in table
    # FedSGD (C 1) and AdaFL (its C rising) saw more examples than any centralized model run:
    # held against C 0.1's, and the cell says so; once a C 1 one is run, against that
    sgd = run("rank", "ptb", "FedSGD", 1.0, [1000, 140])
    ada = run("rank", "ptb", "AdaFL + FedAvg", None, [1000, 165])
    table = lm_table([sgd, ada, *runs[4:6]], central, ngram)
    assert "| FedSGD | 1 | 140.00 | -6.7% vs C 0.1's |" in table
    assert "| AdaFL + FedAvg | 0.1->0.5 (AdaFL) | 165.00 | +10.0% vs C 0.1's |" in table
    assert "| FedAvg | 0.1 | 160.00 | +6.7% |" in table
    c1 = run("rank", "ptb", "centralized, 50 epochs", 1.0, [1000, 125], kind="central")
    assert "| FedSGD | 1 | 140.00 | +12.0% |" in lm_table([c1, sgd], central, ngram)
    # each centralized model heads the runs held against it, in blocks by C, best first in each
    fed1 = run("rank", "ptb", "FedAvg", 1.0, [1000, 130])
    table = lm_table([sgd, *runs[4:6], fed1, c1, ada], central, ngram)
    methods = [line.split(" | ")[0][2:] for line in table.splitlines()[2:]]
    assert methods == ["**" + CENTRAL + "**", "**Kneser-Ney 3-gram**", "FedAvg", "FedAtt",
                       "AdaFL + FedAvg", "**centralized, 50 epochs**", "FedAvg", "FedSGD"]  # fmt: skip
    # the curves split as the table does: one figure per centralized model
    parts = by_central([central, ngram, c1, sgd, ada, *runs[4:6]])
    assert {k: [r["method"] for r in v] for k, v in parts.items()} == {
        "_c0.1": [CENTRAL, "Kneser-Ney 3-gram", "AdaFL + FedAvg", "FedAvg", "FedAtt"],
        "_c1": ["Kneser-Ney 3-gram", "centralized, 50 epochs", "FedSGD"],
    }
    assert by_central([central, sgd, ada]) == {"": [central, sgd, ada]}
    # a noniid table's reference is the rank suite's centralized model: its C counts as run
    fed = run("noniid", "wikitext-2", "FedAvg", 0.1, [1000, 180], partition="articles")
    assert "| FedAvg | 0.1 | 180.00 | +20.0% |" in lm_table([fed], central, ngram)


def test_targets_say_where_we_stand():
    runs = ranking_runs()
    line = next(x for x in targets_table(runs).splitlines() if x.startswith("| cpu | PTB |"))
    assert "| FedAvg | 160.00 | 150.00 | yes (+6.7%) |" in line
    assert "0.220 (FedAvg) | 0.160 | yes (1.38x) |" in line
    runs[4]["test_ppl"] = 170.0  # +13% now; FedAtt's 164 is +9.3%: still within 10%
    assert "| FedAtt | 164.00 | 150.00 | yes (+9.3%)" in targets_table(runs)
    runs[5]["test_ppl"] = 200.0
    assert "| FedAvg | 170.00 | 150.00 | no (+13.3%)" in targets_table(runs)
    # the gpu preset writes its own results: a cpu report says where they are
    assert "target test ppl <= 100; none in these results (a gpu bench writes its own" in (
        targets_table(runs)
    )


def test_attention_spread_is_reported_per_run():
    md = markdown(ranking_runs(), ["b"], {}, {})
    section = md.split("### Does attention do anything")[1].split("\n## ")[0]
    table = [x for x in section.splitlines() if x.startswith("| ")]
    assert table[0] == "| text | phones | C | m | FedAtt |"
    # two rounds of max 0.9, min 0.1: entropy 0.325, evenness H / ln 2 = 0.469 (each round's
    # max, min and entropy: the run's weight_spread in results.json)
    assert "| WikiText-2 | 100 phones of whole articles | 0.1 | 2 | 0.4690 |" in table
    assert "`weight_spread` in [`results.json`](results.json)" in section


def test_report_is_rebuilt_from_results_json(tmp_path):
    bench = Bench(tmp_path)
    for r in ranking_runs():
        bench.add(r, "fedkey-bench paper --preset cpu")
    path = write_report(bench.read(), tmp_path, bench.commands(), bench.lr_choices())
    md = path.read_text()
    assert md.startswith("# fedkey-bench paper: which aggregation method trains the better")
    assert (tmp_path / "curves_cpu_rank_ptb.png").stat().st_size > 1000
    assert (tmp_path / "spread_cpu.png").stat().st_size > 1000
    assert "![curves_cpu_rank_ptb](curves_cpu_rank_ptb.png)" in md


def test_a_preset_without_a_variant_suite_gets_no_figure_of_it(tmp_path):
    """The gpu preset runs no confirm suite: its rank runs (which the confirm suite would set at
    the sweep's value) draw no "lr checked at full length" figure."""
    bench = Bench(tmp_path)
    for r in ranking_runs():
        bench.add({**r, "preset": "gpu"} if r["preset"] == "cpu" else r, "fedkey-bench paper")
    write_report(bench.read(), tmp_path, bench.commands(), bench.lr_choices())
    assert (tmp_path / "curves_gpu_rank_ptb.png").is_file()
    assert not list(tmp_path.glob("curves_gpu_confirm_*.png"))
    assert not list(tmp_path.glob("curves_gpu_decay_*.png"))


def test_a_diverged_runs_curve_does_not_stop_the_report(tmp_path):
    """A sweep run at too high a server lr went to 1e283 and then inf: its curve is cut at the
    ceiling instead of stretching the log axis past what matplotlib can label."""
    from fedkey_bench.paper.tables import plot_curves

    ok = {"method": "FedAvgM", "kind": "federated", "fraction": 0.1,
          "curve": [[0, 10026.4, 10036.7], [1, 900.0, 910.0], [2, 600.0, 610.0]]}  # fmt: skip
    gone = {**ok, "curve": [[0, 10026.4, 10036.7], [1, 6.6e23, 3.5e23], [2, 9.7e283, 1.1e283],
                            [3, math.inf, math.inf]]}  # fmt: skip
    path = plot_curves([ok, gone], tmp_path, "sweep.png", "WikiText-2, sweep", split="val")
    assert path is not None and path.stat().st_size > 0


def test_every_run_says_where_it_ran_in_runs_csv():
    """A bench's runs may come from several machines (`bench paper --backend stacked` on a GPU,
    then `bench merge`): runs.csv names each one's device and command, the header all."""
    import csv
    import io

    runs = ranking_runs()
    runs[4] = {**runs[4], "device": "cuda (NVIDIA H100 80GB HBM3)"}
    rows = list(csv.DictReader(io.StringIO(runs_csv(runs))))
    assert [r["id"] for r in rows] == [r["id"] for r in runs]  # every run, in results.json's order
    assert rows[4]["device"] == "cuda (NVIDIA H100 80GB HBM3)"
    assert sum(r["device"] == "cpu" for r in rows) == len(runs) - 1
    assert all(row["command"] == r["command"] for row, r in zip(rows, runs, strict=True))
    header = markdown(runs, [], {}, {})
    assert "- Devices: cpu, cuda (NVIDIA H100 80GB HBM3)" in header


def test_a_long_history_of_bench_commands_and_commits_is_counted_not_listed():
    """Past five bench commands (or git commits) the header names how many, the first and the
    last (results.json lists every one in order); five or fewer stay in the header."""
    cmds = [f"fedkey-bench paper --preset cpu --hours {h}" for h in range(1, 8)]
    runs = ranking_runs()
    for i, r in enumerate(runs):
        r["git_commit"], r["git_dirty"] = f"{i:010d}", i == 3
    md = markdown(runs, cmds, {}, {})
    head = md.split("## How it was run")[1].split("\n## ")[0]
    assert f"Produced by 7 bench commands, the first `{cmds[0]}` and the last `{cmds[-1]}`" in head
    assert "results.json's bench_commands" in head
    assert "- Git commits: 8, 1 of them with changes not committed" in head
    # the page lists neither every command nor every commit (results.json and runs.csv do)
    assert cmds[3] not in md and "0000000003" not in md and "## Commands" not in md
    short = markdown(ranking_runs(), cmds[:2], {}, {})
    assert f"Produced by `{cmds[0]}`, then `{cmds[1]}`;" in short
    assert "- Git commits: abcdef1234" in short and "The bench commands, in order" not in short


def test_a_seeded_row_is_held_against_the_centralized_model_of_its_own_c():
    """The gpu preset seeds PTB at C 0.1 and 0.5, each with its own centralized model: a C 0.5
    row's "mean vs centralized mean" is against the 125-epoch model, not the 25-epoch one."""
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.seeds import seeds_table

    c01 = "centralized, 25 epochs (as many examples as C 0.1)"
    c05 = "centralized, 125 epochs (as many examples as C 0.5)"
    runs = [
        run("rank", "ptb", c01, 0.1, [1000, 100], kind="central", preset="gpu"),
        run("rank", "ptb", c05, 0.5, [1000, 80], kind="central", preset="gpu"),
        run("rank", "ptb", "FedAvg", 0.1, [1000, 110], preset="gpu"),
        run("rank", "ptb", "FedAvg", 0.5, [1000, 88], preset="gpu"),
    ]
    table = seeds_table(PRESETS["gpu"], runs).splitlines()[2:]
    rows = {(line.split(" | ")[1], line.split(" | ")[2]): line for line in table}
    assert "| +10.0% |" in rows["FedAvg", "0.1"] and "| +10.0% |" in rows["FedAvg", "0.5"]


def test_the_seed_curves_draw_a_colour_per_row_and_a_line_style_per_seed():
    from fedkey_bench.paper.presets import PRESETS
    from fedkey_bench.paper.seeds import seed_curves

    runs = ranking_runs() + [
        run("seeds", "ptb", "FedAvg", 0.1, [1000, 170], seed=1),
        run("seeds", "ptb", CENTRAL, 0.1, [1000, 152], kind="central", seed=2),
    ]
    lines = {(r["method"], r["line"]) for r in seed_curves(PRESETS["cpu"], runs)}
    assert lines == {(f"{CENTRAL}, seed 0", (0, "-")), (f"{CENTRAL}, seed 2", (0, ":")),
                     ("FedAvg, seed 0", (1, "-")), ("FedAvg, seed 1", (1, "--"))}  # fmt: skip


def test_runs_of_a_suite_the_bench_no_longer_has_stay_in_results_json_and_out_of_the_report(
    tmp_path,
):
    """cpu/results.json keeps the old 8-round cut's runs (suites paper, beyond, ...: the record of
    what ran); results.md leaves them out."""
    old = run("paper", "ptb", "FedAvg", 0.1, [10000, 2000], preset="cpu-8round")
    write_report([*ranking_runs(), old], tmp_path, ["fedkey-bench paper --preset cpu"])
    md = (tmp_path / "results.md").read_text()
    assert old["id"] not in md and "## The seed papers' column measure" in md


def test_the_answer_is_the_best_federated_row_of_each_text_phones_and_c():
    """The page's first table: per text, phones and C, the federated run of lowest test
    perplexity against the centralized model of as many examples and the 3-gram."""
    rows = [line for line in answer_table(ranking_runs()).splitlines() if line.startswith("| cpu")]
    ptb = next(r for r in rows if r.startswith("| cpu | PTB (100 IID phones) | 0.1 |"))
    assert ptb.split(" | ")[3:10] == [
        "FedAvg",
        "160.00",
        "150.00",
        "+6.7%",
        "200.00",
        "1.38x",
        "2 |",
    ]
    # no centralized model or 3-gram on that text yet: "-" where they would stand
    assert (
        "| cpu | WikiText-2 (100 phones of whole articles) | 0.1 | FedAtt | 390.00 | - |" in rows[1]
    )


@pytest.mark.slow
def test_the_committed_cpu_results_rebuild_short_pages_that_lead_with_the_answer(tmp_path):
    """experiments/results/cpu: every run the bench has recorded (the big fixture) rebuilds a
    results.md under 30 KB whose first table is the answer, a learning-rates.md beside it, and
    a runs.csv with every run of results.json and its command."""
    import csv
    import json
    import shutil
    from pathlib import Path

    from fedkey_bench.paper.report import write

    committed = Path(__file__).resolve().parents[2] / "results" / "cpu"
    shutil.copy(committed / "results.json", tmp_path / "results.json")
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(runs) > 200
    write(tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert len(md.encode()) <= 30 * 1024
    assert len((tmp_path / "learning-rates.md").read_bytes()) <= 30 * 1024
    head = md.split("\n## ")[1]
    assert (
        head.startswith("The answer") and "| cpu | PTB (100 IID phones) | 0.1 | FedAvgM |" in head
    )
    with (tmp_path / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["id"] for r in rows] == [r["id"] for r in runs]
    assert [r["command"] for r in rows] == [r["command"] for r in runs]
    assert md == (committed / "results.md").read_text()  # the committed page is this one
