"""The real suite of `fedkey-bench paper`: its runs on NUS SMS and the Ubuntu IRC
population (one phone per sender, the vocabulary of the training messages, every row scored on
the held-out senders too), and the table that leads results.md with them."""

import shlex
from dataclasses import replace
from pathlib import Path

from fedkey_bench.paper.plan import command
from fedkey_bench.paper.presets import PRESETS
from fedkey_bench.paper.real import (
    REAL_CURVE_TOP,
    REAL_PAGE,
    real_curve_top,
    real_curves,
    real_markdown,
    real_rows,
    real_section,
    real_summary,
    real_waiting,
)
from fedkey_bench.paper.real_suite import (
    REAL,
    REAL_AS_MANY,
    REAL_COHORTS,
    REAL_DECAYED,
    REAL_GROUP,
    STEP_LOWER_GROUP,
    SWEPT_GROUP,
    real_suite,
)
from fedkey_bench.paper.report import markdown
from fedkey_bench.paper.runner import summarize
from fedkey_bench.paper.spec import RunSpec
from fedkey_bench.paper.sweep import KNOBS, REAL_EVAL, TASK_OF

CPU = PRESETS["cpu"]


def test_the_real_suite_runs_every_method_on_each_corpus_by_sender():
    specs = real_suite(CPU)
    assert "real" in CPU.suites
    for task, fraction in REAL:
        mine = [s for s in specs if s.dataset == task.dataset]
        assert [s.method for s in mine][:6] == [
            "Kneser-Ney 3-gram", "centralized, 5 epochs (as many examples as C 0.1)", "FedAvg",
            "FedAtt", "FedAvgM", "FedAdam"]  # fmt: skip
        for s in mine:
            cmd = command(s, CPU, Path("/data"), Path("/runs") / s.id)
            words = shlex.join(cmd)
            assert "--paper-protocol" not in cmd  # the vocabulary of the training messages
            assert f"--clients {task.clients}" in words and "--partition user" in words
            assert f"--max-eval-sentences {REAL_EVAL}" in words
            assert cmd[cmd.index("--data") + 1] == f"/data/{task.dataset}"
            if s.kind == "federated" and s.fraction is None:  # AdaFL's fraction is its own
                assert "--adafl" in cmd and "--fraction" not in cmd
            elif s.kind == "federated":
                assert f"--fraction {s.fraction:g}" in words
        cohorts = sorted(s.fraction for s in mine
                         if s.fraction not in (None, fraction) and s.rounds is None)  # fmt: skip
        assert cohorts == sorted(REAL_COHORTS.get(task.dataset, ()))
        # other cohorts for as many fewer or more rounds: as many phones trained in all as at C
        as_many = {
            s.fraction: s for s in mine if s.rounds is not None and "--lr-decay" not in s.args
        }
        assert sorted(as_many) == sorted(REAL_AS_MANY[task.dataset])
        fedavg = next(s for s in mine if s.method == "FedAvg")
        for c, s in as_many.items():
            assert round(s.rounds * c, 9) == round(CPU.rounds * fraction, 9)
            assert (s.args, s.lr) == (fedavg.args, fedavg.lr) and f"--rounds {s.rounds}" in (
                shlex.join(command(s, CPU, Path("/data"), Path("/r"))))  # fmt: skip
    # 50 to 1,000 phones, tens of them a round (IRC: 100)
    assert {t.dataset: round(t.clients * c) for t, c in REAL} == {
        "nus-sms": 30, "ubuntu-irc": 100}  # fmt: skip
    # the IRC population's FedAvg at 50 phones a round, as its C 0.1 row else; at all 1,000 a
    # round only for as many examples (5 rounds), never for the 50 rounds of 10x the training
    irc = {s.fraction: s for s in specs if s.dataset == "ubuntu-irc" and s.method == "FedAvg"}
    assert sorted(irc) == [0.05, 0.1] and irc[0.05].id != irc[0.1].id
    assert irc[0.05].args == irc[0.1].args and irc[0.05].lr == irc[0.1].lr
    everyone = [s for s in specs if s.dataset == "ubuntu-irc" and s.fraction == 1.0]
    assert [s.rounds for s in everyone] == [round(CPU.rounds * 0.1)]
    # the other suites' runs keep --paper-protocol
    rank = RunSpec("rank", "ptb", "FedAvg", 0.1)
    assert "--paper-protocol" in command(rank, CPU, Path("/data"), Path("/runs/x"))


def _result(spec: RunSpec, ppl: float, top1: float, unseen_top1: float) -> dict:
    """A run's results.json object; the bar ranks 0.01 higher than the model (no </s>, <unk>)."""
    rows = [{"round": i, "val_ppl": p + 1, "test_ppl": p, "top1": top1, "top3": 0.4,
             "bar_top1": top1 + 0.01, "bar_top3": 0.41, "ksr": 0.3, "unseen_test_ppl": p * 1.5,
             "unseen_top1": unseen_top1, "unseen_top3": 0.35, "unseen_bar_top1": unseen_top1 + 0.01,
             "unseen_bar_top3": 0.36, "unseen_ksr": 0.25, "aggregated": ["a"] * (i > 0),
             "info": {}}
            for i, p in enumerate([1000.0, ppl] if spec.kind != "ngram" else [ppl])]  # fmt: skip
    return {"id": spec.id, **summarize(rows, spec), "wall_seconds": 60.0,
            "command": shlex.join(command(spec, CPU, Path("/data"), Path("/runs") / spec.id)),
            "git_commit": "abcdef1234", "git_dirty": False, "device": "cpu", "preset": "cpu",
            "seed_ppl": None}  # fmt: skip


def test_the_table_holds_both_held_out_sets_against_the_3gram():
    specs = [s for s in real_suite(CPU) if s.dataset == "nus-sms"]
    ngram, central, fedavg = specs[0], specs[1], specs[2]
    runs = [_result(ngram, 140.0, 0.16, 0.12), _result(central, 120.0, 0.2, 0.15),
            _result(fedavg, 130.0, 0.18, 0.16)]  # fmt: skip
    assert runs[2]["unseen_top1"] == 0.16 and runs[2]["unseen_test_ppl"] == 195.0
    assert runs[2]["bar_top1"] == 0.19 and runs[2]["unseen_bar_top1"] == 0.17
    rows = real_rows(runs)
    assert [r[1] for r in rows] == ["Kneser-Ney 3-gram", central.method, "FedAvg"]
    fed = rows[2]
    assert fed[0].startswith("NUS SMS (300 phones, C 0.1: 30 a round)")
    assert fed[2] == "1 / 1 (of 50 planned)"  # fewer rounds than planned: said so
    # a row planned at fewer rounds than the preset's (1,000 phones for 5 rounds) is not short
    few = next(s for s in real_suite(CPU) if s.fraction == 1.0 and s.rounds == 5)
    done = {**_result(few, 500.0, 0.1, 0.1), "rounds": 5, "best_round": 5}
    assert next(r for r in real_rows([done]) if r[1] == few.method)[2] == "5 / 5"
    assert fed[3] == "lr 3"
    # the bar's top-1, and against the 3-gram's (0.17; 0.13 on senders who never trained)
    assert fed[5] == "130.00" and fed[6] == "0.190" and fed[9] == "1.12x"
    assert fed[11] == "0.170" and fed[14] == "1.31x"
    assert fed[-2:] == ["0.180", "0.160"]  # the model's own ranking, beside it
    assert rows[0][9] == rows[0][14] == "-"
    # the summary: the best federated run against the 3-gram and the centralized model
    summary = "\n".join(real_section(runs))
    row = next(line for line in summary.splitlines() if line.startswith("| NUS SMS"))
    assert row.split(" | ")[1:8] == ["0.170", "0.210", "FedAvg", "0.190", "1.12x", "-", "-"]
    assert "+8.3%" in row and "1 of 10" in row  # 130 against 120; FedAtt not run
    assert f"]({REAL_PAGE})" in summary
    assert real_markdown(runs).count("| NUS SMS") == 3
    waiting = real_waiting(runs, begun={f"cpu/{specs[3].id}": [7, 50]})
    assert "FedAtt (begun: round 7 of 50)" in waiting and "FedAvgM (not run yet)" in waiting
    assert "Ubuntu IRC: Kneser-Ney 3-gram (not run yet)" in waiting
    # results.md leads with the table, above the ranking protocol's answer
    page = markdown(runs, ["fedkey-bench paper --suite real"], {}, {})
    answer = page.split("\n## ")[1]
    assert answer.startswith("The answer\n\n### Real typing")
    assert real_section([]) == []


def _swept(dataset: str, knob: str, values: dict[float, float], client_lr: float) -> list[dict]:
    """The sweep's results of one knob on a real task: value -> best validation perplexity."""
    from fedkey_bench.paper.sweep import sweep_spec

    out = []
    for v, ppl in values.items():
        own = v if knob in ("client_lr", "central_lr") else client_lr
        spec = sweep_spec(CPU, TASK_OF[dataset], knob, v, own)
        out.append({**spec.fields(), "id": spec.id, "preset": "cpu", "best_val_ppl": ppl,
                    "command": shlex.join(command(spec, CPU, Path("/data"), Path("/r")))})  # fmt: skip
    return out


def test_the_sweep_tunes_the_real_corpora_as_their_runs_are_made():
    sweep = [s for s in real_suite(CPU) if s.kind != "ngram"]
    assert {s.group for s in sweep} == {REAL_GROUP}  # nothing swept yet: the demo's rates
    from fedkey_bench.paper.sweep import sweep_suite

    mine = [s for s in sweep_suite(CPU, []) if s.dataset == "nus-sms"]
    assert {s.partition for s in mine} == {"user"} and {s.clients for s in mine} == {300}
    for s in mine:  # as the real suite's runs: the training split's vocabulary, the same cut
        words = shlex.join(command(s, CPU, Path("/data"), Path("/r")))
        assert "--paper-protocol" not in words and "--partition user" in words
        assert f"--max-eval-sentences {REAL_EVAL}" in words
    # FedAvg's client lr chosen on validation (1 of 0.3, 1, 3): FedAvg, FedMed take it; FedAtt
    # keeps the demo's rates until its server step is chosen too, and so does the 3-gram
    results = _swept("nus-sms", "client_lr", {0.3: 300.0, 1.0: 200.0, 3.0: 250.0}, 0)
    specs = {s.method: s for s in real_suite(CPU, results)
             if s.dataset == "nus-sms" and s.group != STEP_LOWER_GROUP}  # fmt: skip
    assert specs["FedAvg"].lr == specs["FedMed"].lr == 1.0
    assert specs["FedAvg"].group == SWEPT_GROUP
    assert specs["FedAtt"].lr == 3.0 and specs["FedAtt"].group == REAL_GROUP
    results += _swept("nus-sms", "fedatt_step", {0.1: 210.0, 0.3: 190.0, 1.2: 400.0}, 1.0)
    fedatt = next(s for s in real_suite(CPU, results) if s.method == "FedAtt")
    assert (fedatt.lr, fedatt.group) == (1.0, SWEPT_GROUP) and "0.3" in fedatt.args
    assert KNOBS["fedatt_step"].flag in fedatt.args
    irc = [s for s in real_suite(CPU, results) if s.dataset == "ubuntu-irc"]
    assert {s.group for s in irc} == {REAL_GROUP}  # one corpus's choices are its own


def test_the_other_cohort_sizes_have_rows_of_their_own_out_of_the_summary():
    specs = {(s.method, s.fraction): s for s in real_suite(CPU) if s.dataset == "ubuntu-irc"}
    runs = [_result(specs["Kneser-Ney 3-gram", None], 100.0, 0.2, 0.18),
            _result(specs["FedAvg", 0.1], 140.0, 0.18, 0.14),
            _result(specs["FedAvg", 0.05], 120.0, 0.19, 0.15),
            _result(specs["AdaFL + FedAvg", None], 110.0, 0.2, 0.16)]  # fmt: skip
    adafl = next(r for r in real_rows(runs) if r[1] == "AdaFL + FedAvg")
    assert adafl[0] == "Ubuntu IRC (1000 phones, AdaFL's C: 0.1 rising to 0.5)"
    rows = {r[0]: r for r in real_rows(runs) if r[1] == "FedAvg"}
    assert rows["Ubuntu IRC (1000 phones, C 0.05: 50 a round)"][5] == "120.00"
    assert rows["Ubuntu IRC (1000 phones, C 0.1: 100 a round)"][5] == "140.00"
    # the summary's best federated run is of the task's C: 140 (C 0.1), not 120 (C 0.05, half
    # the phones in all) or AdaFL's 110 (up to 5 times the phones a round)
    row = next(r for r in real_summary(runs) if r[0].startswith("Ubuntu IRC"))
    # of as many examples: 7 methods at C 0.1 (AdaFL's C is its own), FedAvg with dropout, at
    # other cohorts for as many examples, and with the lr decayed
    n = 8 + len(REAL_AS_MANY["ubuntu-irc"]) + len(REAL_DECAYED["ubuntu-irc"])
    assert row[8] == "140.00" and row[-1] == f"1 of {n}"
    # a smaller cohort for as many more rounds trains as many phones: it is in the summary too
    smaller = next(s for s in real_suite(CPU) if s.dataset == "ubuntu-irc" and s.rounds == 100)
    runs.append(_result(smaller, 130.0, 0.19, 0.15))
    row = next(r for r in real_summary(runs) if r[0].startswith("Ubuntu IRC"))
    assert row[3] == "FedAvg, 100 rounds (as many examples as C 0.1), 50 a round"
    assert row[8] == "130.00" and row[-1] == f"2 of {n}"
    assert "0.05: 50 a round" in next(r[0] for r in real_rows(runs) if r[1] == smaller.method)
    waiting = real_waiting(runs)
    left = waiting.split("Ubuntu IRC: ")[1].rstrip(".").split("; ")
    assert "FedAvg, 50 a round (not run yet)" not in left and "FedAvg (not run yet)" not in left
    assert "FedAtt (not run yet)" in left


def test_a_row_run_before_the_sweep_at_the_rates_it_chose_counts_as_swept():
    before = {s.method: s for s in real_suite(CPU) if s.dataset == "nus-sms"}
    runs = [_result(before[m], 150.0, 0.15, 0.14) for m in ("FedAvg", "FedAtt", "FedAvgM")]
    # the sweep chooses client lr 3, the rate FedAvg ran at; FedAtt's step is not swept yet
    runs += _swept("nus-sms", "client_lr", {0.3: 300.0, 1.0: 250.0, 3.0: 200.0, 10.0: 900.0}, 0)
    rates = {r[1]: r[3] for r in real_rows(runs)}
    assert rates["FedAvg"] == "lr 3 (swept)"
    assert "FedAvg (to run again" not in real_waiting(runs)
    assert rates["FedAtt"] == "lr 3, step 0.3"
    assert rates["FedAvgM"] == "lr 1, server lr 0.3"
    # a swept rate other than the one a row ran at: the row is not marked
    runs[-4:] = _swept("nus-sms", "client_lr", {0.3: 300.0, 1.0: 200.0, 3.0: 250.0}, 0)
    assert {r[1]: r[3] for r in real_rows(runs)}["FedAvg"] == "lr 3"
    assert "FedAvg (to run again at the rates the sweep chose" in real_waiting(runs)


def test_a_swept_row_runs_again_one_grid_step_lower_and_the_summary_chooses_on_validation():
    """As the confirm suite checks the rank suite's: a short sweep favours the larger rate (NUS
    SMS's FedAvgM at the sweep's server lr 1 ended at test 205.85, at 0.3 at 152.96), so a row
    whose rates the sweep chose runs one grid step lower too, and lower again while the step
    lower wins on validation; the summary takes the run of lowest validation perplexity."""
    results = _swept("nus-sms", "client_lr", {0.3: 300.0, 1.0: 250.0, 3.0: 200.0, 10.0: 900.0}, 0)
    results += _swept("nus-sms", "central_lr", {0.3: 300.0, 1.0: 200.0, 3.0: 250.0}, 0)

    def lower(runs: list[dict]) -> dict[str, RunSpec]:
        return {s.id: s for s in real_suite(CPU, runs) if s.group == STEP_LOWER_GROUP}

    steps = lower(results)
    assert sorted((s.method.split(",")[0], s.lr) for s in steps.values()) == [
        ("FedAvg", 1.0), ("centralized", 0.3)]  # fmt: skip
    assert all(s.dataset == "nus-sms" and s.fraction == 0.1 for s in steps.values())
    specs = {(s.method, s.tag): s for s in real_suite(CPU, results) if s.dataset == "nus-sms"}
    fedavg, step = specs["FedAvg", ""], specs["FedAvg", "lr1"]
    assert step.args == fedavg.args and step.id == f"{fedavg.id}-lr1"
    assert "FedAvg, lr 1 (not run yet)" in real_waiting(results)
    # the step lower wins on validation: one more step, as the sweep extends a grid
    runs = results + [_result(fedavg, 150.0, 0.15, 0.14), _result(step, 140.0, 0.16, 0.15)]
    assert sorted(s.lr for s in lower(runs).values() if s.method == "FedAvg") == [0.3, 1.0]
    assert "FedAvg, lr 0.3 (not run yet)" in real_waiting(runs)
    rates = [r[3] for r in real_rows(runs) if r[1] == "FedAvg"]
    assert rates == ["lr 3 (swept)", "lr 1 (one step lower)"]
    # lower again loses on validation (though not on test): no further step, and the summary
    # takes the run of lowest validation perplexity, never the lowest test
    third = _result(replace(step, lr=0.3, tag="lr0.3"), 130.0, 0.2, 0.2)
    third["best_val_ppl"] = 160.0
    runs.append(third)
    assert sorted(s.lr for s in lower(runs).values() if s.method == "FedAvg") == [0.3, 1.0]
    row = next(r for r in real_summary(runs) if r[0].startswith("NUS SMS"))
    assert row[3] == "FedAvg" and row[8] == "140.00"
    # a row's record at other rates than its plan's is not compared: one step, no more
    stale = _result(fedavg, 150.0, 0.15, 0.14)
    stale["command"] = stale["command"].replace("--lr 3", "--lr 10")
    again = [r for r in runs if r["id"] != fedavg.id] + [stale]
    assert sorted(s.lr for s in lower(again).values() if s.method == "FedAvg") == [1.0]


def test_the_cohort_figure_sets_fedavg_and_the_centralized_model_at_as_many_phones_trained():
    specs = {(s.method, s.fraction): s for s in real_suite(CPU) if s.dataset == "ubuntu-irc"}
    central = next(s for s in specs.values() if s.kind == "central" and "dropout" not in s.method)
    smaller = next(s for s in specs.values() if s.rounds == 100)
    runs = [_result(s, 140.0, 0.18, 0.14) for s in (
        specs["FedAvg", 0.1], specs["FedAvg", 0.05], smaller, central, specs["FedAvgM", 0.1],
        specs["FedAvg, dropout 0.3", 0.1])]  # fmt: skip
    curves = real_curves(runs)["ubuntu-irc"]
    # FedAvg at each cohort size and the centralized model; not FedAvgM, nor dropout
    assert sorted(r["id"] for r in curves) == sorted(
        s.id for s in (specs["FedAvg", 0.1], specs["FedAvg", 0.05], smaller, central))  # fmt: skip
    last = {r["id"]: r["curve"][-1][0] for r in curves}  # _result's curve: rounds 0 and 1
    # the legend names a run by its phones a round and rounds: C 0.05's two rows differ
    labels = {r["id"]: r["label"] for r in curves}
    assert labels[specs["FedAvg", 0.1].id] == "FedAvg, 100 a round x 50 rounds"
    assert labels[smaller.id] == "FedAvg, 50 a round x 100 rounds"
    assert labels[central.id] == "centralized, 5 epochs" and len(set(labels.values())) == 4
    assert last[specs["FedAvg", 0.1].id] == 100 and last[smaller.id] == 50
    assert last[central.id] == 1000  # an epoch: every phone once
    fedavg = next(r for r in curves if r["id"] == runs[0]["id"])
    assert [p[1:] for p in fedavg["curve"]] == [p[1:] for p in runs[0]["curve"]]  # the same ppl
    # the axis stops at REAL_CURVE_TOP, or shows the end of a run that ends above it
    assert real_curve_top(curves) == REAL_CURVE_TOP
    high = {**curves[0], "curve": [*curves[0]["curve"][:-1], [100, 610.0, 600.0]]}
    assert real_curve_top([*curves, high]) == 720.0
    page = real_markdown(runs, plots={"real:cpu:ubuntu-irc": Path("/o/curves_cpu_real_x.png")})
    assert "![curves_cpu_real_x](curves_cpu_real_x.png)" in page


def test_a_smaller_cohort_runs_again_with_its_lr_decayed_beside_a_centralized_model_decayed_alike():
    """At 20 phones a round one phone can carry half a round's weight and a constant lr leaves
    the validation perplexity jumping; REAL_DECAYED's FedAvg falls to a tenth of its lr by its
    last round, and the centralized model's lr by as much over its epochs."""
    results = _swept(
        "ubuntu-irc", "client_lr", {0.3: 300.0, 1.0: 250.0, 3.0: 200.0, 10.0: 900.0}, 0
    )
    results += _swept("ubuntu-irc", "central_lr", {0.3: 300.0, 1.0: 200.0, 3.0: 250.0}, 0)
    specs = [s for s in real_suite(CPU, results) if s.dataset == "ubuntu-irc"]
    decayed = [s for s in specs if "--lr-decay" in s.args]
    fed, central = sorted(decayed, key=lambda s: s.kind != "federated")
    # NUS SMS's centralized model decays too (no FedAvg of its: at 20 a round it moved less)
    everywhere = [(s.dataset, s.kind) for s in real_suite(CPU) if "--lr-decay" in s.args]
    assert sorted(everywhere) == [("nus-sms", "central"), ("ubuntu-irc", "central"),
                                  ("ubuntu-irc", "federated")]  # fmt: skip
    plain = next(s for s in specs if s.fraction == REAL_DECAYED["ubuntu-irc"][0]
                 and s.rounds and "--lr-decay" not in s.args)  # fmt: skip
    assert (fed.fraction, fed.rounds, fed.lr) == (plain.fraction, plain.rounds, plain.lr)
    assert fed.method == f"{plain.method}, lr decayed" and fed.id != plain.id
    per_round = float(fed.args[fed.args.index("--lr-decay") + 1])
    assert abs(per_round ** (fed.rounds - 1) - 0.1) < 1e-3  # a tenth by its last round
    # the centralized model: a tenth over its 5 epochs, as the rounds fall over theirs
    per_epoch = float(central.args[central.args.index("--lr-decay") + 1])
    assert abs(per_epoch**5 - 0.1) < 1e-3 and central.fraction == 0.1
    # neither is stepped lower: a schedule is its own row, not the sweep's choice checked
    assert all(s.group != STEP_LOWER_GROUP or "--lr-decay" not in s.args for s in specs)
    lower = [s for s in specs if s.group == STEP_LOWER_GROUP]
    assert sorted(s.kind for s in lower) == ["central", "federated"]
    # both are of as many examples: the summary chooses among them on validation
    base = next(s for s in specs if s.kind == "central" and "--lr-decay" not in s.args
                and s.group != STEP_LOWER_GROUP and "--dropout" not in s.args)  # fmt: skip
    runs = results + [
        _result(plain, 110.0, 0.2, 0.15),
        _result(fed, 95.0, 0.21, 0.16),
        _result(base, 90.0, 0.22, 0.17),
        _result(central, 85.0, 0.22, 0.17),
    ]
    row = next(r for r in real_summary(runs) if r[0].startswith("Ubuntu IRC"))
    assert row[3] == f"{fed.method}, 20 a round" and (row[8], row[9]) == ("95.00", "85.00")
    assert {r[1] for r in real_rows(runs)} >= {fed.method, central.method}
    curves = {r["id"]: r["label"] for r in real_curves(runs)["ubuntu-irc"]}
    assert curves.keys() == {s.id for s in (plain, fed, base, central)}
    assert [curves[s.id].endswith(", lr decayed") for s in (plain, fed, base, central)] == [
        False, True, False, True]  # fmt: skip
