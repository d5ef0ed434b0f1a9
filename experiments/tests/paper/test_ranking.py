"""The ranking presets of `fedkey-bench paper`: what the cpu and gpu presets run,
the learning-rate sweep that chooses on validation only, and the command lines the CLI accepts."""

import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey_bench.cli import app as bench_app
from fedkey_bench.paper.plan import LATE, command, select
from fedkey_bench.paper.presets import PRESETS
from fedkey_bench.paper.results import Bench
from fedkey_bench.paper.runner import run_bench
from fedkey_bench.paper.steps import CONFIRMED, lower_lr
from fedkey_bench.paper.suites import (
    BOUNDED_FEDATT,
    CAPPED_FEDATTOPT,
    next_lr,
    planned,
    suite_runs,
)
from fedkey_bench.paper.sweep import KNOBS, MAX_EXTENSIONS, TASKS, choose, choose_joint, lr_choices

runner = CliRunner()
PAPERS_TABLE = {"FedSGD", "FedAvg", "FedAtt", "FedAttOpt", "FedMed", "FedMed topK 0.8",
                "AdaFL + FedAvg", "AdaFL + FedAtt"}  # fmt: skip


def sweep_run(preset, dataset, knob, value, val_ppl, test_ppl=500.0, client_lr=None):
    """A sweep result of `knob` at `value`, trained at `client_lr` (the client lr's own runs:
    at `value`)."""
    lr = value if client_lr is None else client_lr
    return {"suite": "sweep", "preset": preset, "dataset": dataset, "group": f"{knob}={value:g}",
            "best_val_ppl": val_ppl, "test_ppl": test_ppl, "command": f"fedkey simulate --lr {lr:g}",
            "id": f"s-{dataset}-{knob}-{value}-{lr}"}  # fmt: skip


def decided(preset_name, best_index=1):
    """Sweep results in which every knob's grid value `best_index` has the lowest validation
    perplexity (an interior point: nothing to extend); the joint knobs' at client lr
    `best_index` too, every other client lr's row decided at the same value, a little worse."""
    p = PRESETS[preset_name]
    out = []
    for t in TASKS:
        for knob, k in KNOBS.items():
            grid = getattr(p, k.grid)
            rows = p.client_lrs if k.client_key else [p.client_lrs[best_index]]
            for j, lr in enumerate(rows):
                for i, v in enumerate(grid):
                    ppl = (100.0 if j == best_index else 150.0) if i == best_index else 200.0
                    own = v if knob in ("client_lr", "central_lr") else lr
                    out.append(sweep_run(preset_name, t.dataset, knob, v, ppl, client_lr=own))
    return out


def flag(words, name):
    return words[len(words) - 1 - words[::-1].index(name) + 1]


@pytest.mark.parametrize("preset", ["cpu", "gpu", "smoke"])
def test_every_ranking_command_is_one_the_cli_accepts(preset):
    p = PRESETS[preset]
    results = decided(preset, best_index=len(p.client_lrs) // 2)
    specs = select(p, [s for s in ("sweep", "rank", "noniid", "seeds") if s in p.suites], results)
    assert len({s.id for s in specs}) == len(specs)
    group = typer.main.get_command(app)
    for spec in specs:
        words = command(spec, p, Path("data"), Path("runs") / spec.id)
        sub = group.get_command(None, words[1])
        sub.make_context(words[1], words[2:])  # raises on an unknown flag or a bad value


def test_cpu_preset_is_issue_18s_protocol_with_the_sweeps_learning_rates():
    p = PRESETS["cpu"]
    results = decided("cpu")  # chooses client lr 1, FedAvgM 0.3, FedAdam 0.01
    rank = select(p, ["rank"], results)
    for ds in ("ptb", "wikitext-2"):
        mine = [s for s in rank if s.dataset == ds]
        assert PAPERS_TABLE | {"FedAvgM", "FedAdam"} <= {s.method for s in mine}
        assert {s.kind for s in mine} == {"federated", "central", "ngram"}
        for spec in mine:
            words = command(spec, p, Path("d"), Path("o"))
            assert "--max-train-tokens" not in words and "--max-eval-sentences" not in words
            if spec.kind == "ngram":
                continue
            assert flag(words, "--lr") == "1"  # the sweep's choice, not the preset's lr
            if spec.kind == "central":  # as many examples as 50 rounds x C 0.1 x E 1
                assert flag(words, "--epochs") == "5"
                continue
            assert words[1] == "simulate" and flag(words, "--rounds") == "50"
            assert flag(words, "--local-epochs") == "1" and flag(words, "--clients") == "100"
            assert "--partition" not in words  # IID
            if spec.method == "FedSGD":
                assert flag(words, "--fraction") == "1"
            elif spec.method.startswith("AdaFL"):
                assert "--adafl" in words
            else:
                assert flag(words, "--fraction") == "0.1"
            if spec.method == "FedAvgM":
                assert flag(words, "--server-opt") == "momentum"
                assert flag(words, "--server-lr") == "0.3"
            if spec.method == "FedAdam":
                assert flag(words, "--server-opt") == "adam"
                assert flag(words, "--server-lr") == "0.01"
            # the papers' methods unbounded, as published; fedkey's FedAtt with its own bound
            bounds = [words[i + 1] for i, w in enumerate(words) if w == "--bound"]
            assert bounds == (["adaptive"] if spec.method == BOUNDED_FEDATT else ["off"])


def test_gpu_preset_is_the_papers_protocol_at_both_fractions():
    p = PRESETS["gpu"]
    rank = select(p, ["rank"], decided("gpu"))
    fractions = {s.fraction for s in rank if s.kind == "federated"}
    assert {0.1, 0.5, 1.0, None} == fractions
    central = {flag(command(s, p, Path("d"), Path("o")), "--epochs")
               for s in rank if s.kind == "central" and s.dataset == "ptb"}  # fmt: skip
    assert central == {"25", "125"}  # 50 rounds x C x E 5
    fedavg = next(s for s in rank if s.method == "FedAvg" and s.fraction == 0.5)
    words = command(fedavg, p, Path("d"), Path("o"))
    assert words[1] == "simulate" and flag(words, "--local-epochs") == "5"
    assert flag(words, "--lr") == "0.1"  # the middle of its grid, as decided() chose
    assert 0.01 in p.client_lrs  # the papers' lr is in the grid
    # FedAttOpt's step (chosen at C 0.1: 100) sums a term per phone: 5x the phones, a fifth
    steps = {s.fraction: flag(command(s, p, Path("d"), Path("o")), "--epsilon")
             for s in rank if s.method == "FedAttOpt" and s.dataset == "ptb"}  # fmt: skip
    assert steps == {0.1: "100", 0.5: "20"}
    # the sweep runs as long as the ranking runs (a 10-round sweep chose an lr that overfits)
    sweep = [command(s, p, Path("d"), Path("o")) for s in select(p, ["sweep"], [])]
    assert {flag(w, "--rounds") for w in sweep if w[1] == "simulate"} == {"50"}
    # and the centralized model's sweep sees as many examples: 50 rounds x C 0.1 x E 5
    assert {flag(w, "--epochs") for w in sweep if w[1] == "train-central"} == {"25"}


def test_sweep_chooses_on_validation_never_on_test():
    p = PRESETS["cpu"]
    task = TASKS[0]
    runs = [sweep_run("cpu", "ptb", "client_lr", 0.3, 150.0, test_ppl=90.0),
            sweep_run("cpu", "ptb", "client_lr", 1.0, 120.0, test_ppl=300.0),
            sweep_run("cpu", "ptb", "client_lr", 3.0, 130.0, test_ppl=80.0)]  # fmt: skip
    assert choose(runs, p, task, "client_lr") == (1.0, [])
    assert choose(runs[:2], p, task, "client_lr") == (None, [3.0])  # the grid first
    # another preset's or dataset's runs do not count
    other = [{**r, "preset": "gpu"} for r in runs] + [{**r, "dataset": "wikitext-2"} for r in runs]
    assert choose(other, p, task, "client_lr") == (None, [0.3, 1.0, 3.0])


def test_a_best_value_at_the_grids_edge_extends_the_grid_twice_at_most():
    p = PRESETS["cpu"]
    task = TASKS[0]
    runs = [sweep_run("cpu", "ptb", "client_lr", v, 100.0 + v) for v in p.client_lrs]
    value, todo = choose(runs, p, task, "client_lr")  # 0.3 best: half a decade below
    assert value is None and todo == [0.1]
    high = [sweep_run("cpu", "ptb", "client_lr", v, 100.0 - v) for v in p.client_lrs]
    assert choose(high, p, task, "client_lr") == (None, [10.0])
    runs.append(sweep_run("cpu", "ptb", "client_lr", 0.1, 90.0))
    assert choose(runs, p, task, "client_lr") == (None, [0.03])
    runs.append(sweep_run("cpu", "ptb", "client_lr", 0.03, 80.0))
    assert MAX_EXTENSIONS == 2 and choose(runs, p, task, "client_lr") == (0.03, [])
    # the extension is a run of the sweep suite, at the value asked for
    specs = select(p, ["sweep"], runs[:4])
    assert "sweep-ptb-fedavg-client-lr-0-03-c0.1" in {s.id for s in specs}


def test_server_lrs_are_swept_at_the_chosen_client_lr_and_recorded(tmp_path):
    p = PRESETS["cpu"]
    runs = [sweep_run("cpu", "ptb", "client_lr", v, {0.3: 150.0, 1.0: 120.0, 3.0: 130.0}[v])
            for v in p.client_lrs]  # fmt: skip
    before = [s for s in select(p, ["sweep"], runs[:2]) if s.dataset == "ptb"]
    # the centralized lr needs no FedAvg choice; the server knobs wait for it
    assert {s.group.split("=")[0] for s in before} == {"client_lr", "central_lr"}
    specs = [s for s in select(p, ["sweep"], runs) if s.dataset == "ptb"]
    server = [s for s in specs if s.kind == "federated" and not s.group.startswith("client_lr")]
    assert {s.group.split("=")[0] for s in server} == set(KNOBS) - {"client_lr", "central_lr"}
    for spec in server:
        words = command(spec, p, Path("d"), Path("o"))
        knob, value = spec.group.split("=")
        # a joint knob at every client lr of the grid, the server steps at FedAvg's
        lrs = {"0.3", "1", "3"} if KNOBS[knob].client_key else {"1"}
        assert flag(words, "--lr") in lrs and flag(words, "--rounds") == str(p.sweep_rounds)
        assert flag(words, KNOBS[knob].flag) == value
        assert flag(words, "--strategy") == KNOBS[knob].flags[1]
    momentum = [s for s in server if s.group.startswith("momentum")]
    assert len(momentum) == len(p.client_lrs) * len(p.momentum_server_lrs)
    # named by their client lr, except at FedAvg's (the name they had before the joint grid)
    assert {(s.lr, "client-lr" in s.id) for s in momentum} == {(0.3, True), (1.0, False),
                                                               (3.0, True)}  # fmt: skip
    # Bench writes the choices into results.json beside the runs
    bench = Bench(tmp_path)
    for r in runs:
        bench.add({**r, "kind": "federated", "fraction": 0.1}, "fedkey-bench")
    assert bench.lr_choices()["cpu"] == {"ptb": {"client_lr": 1.0}}
    assert lr_choices(runs, p) == {"ptb": {"client_lr": 1.0}}


def test_a_server_optimizer_is_chosen_jointly_with_its_client_lr():
    """FedAvgM's server lr is decided on each client lr's row of the grid (edges extended per
    row), and the best pair over the rows wins: its rank run trains at that client lr, not at
    FedAvg's. The centralized model runs at its own chosen lr."""
    p = PRESETS["cpu"]
    task = TASKS[0]
    fedavg = [sweep_run("cpu", "ptb", "client_lr", v, {0.3: 150.0, 1.0: 120.0, 3.0: 130.0}[v])
              for v in p.client_lrs]  # fmt: skip
    # FedAvgM: best at client lr 0.3 and server lr 1, the top of its row's grid
    ppl = {(0.3, 0.1): 300.0, (0.3, 0.3): 200.0, (0.3, 1.0): 90.0,
           (1.0, 0.1): 250.0, (1.0, 0.3): 110.0, (1.0, 1.0): 400.0,
           (3.0, 0.1): 500.0, (3.0, 0.3): 300.0, (3.0, 1.0): 350.0}  # fmt: skip
    momentum = [sweep_run("cpu", "ptb", "momentum_server_lr", v, val, client_lr=lr)
                for (lr, v), val in ppl.items()]  # fmt: skip
    runs = fedavg + momentum
    assert choose_joint(runs, p, task, "momentum_server_lr") == (None, [(0.3, 3.0)])
    ext = [s for s in select(p, ["sweep"], runs) if s.group == "momentum_server_lr=3"]
    assert [(s.lr, s.id) for s in ext] == [
        (0.3, "sweep-ptb-fedavgm-server-momentum-0-9-server-lr-3-client-lr-0-3-c0.1")
    ]
    runs.append(sweep_run("cpu", "ptb", "momentum_server_lr", 3.0, 95.0, client_lr=0.3))
    assert choose_joint(runs, p, task, "momentum_server_lr") == ((0.3, 1.0), [])
    central = [sweep_run("cpu", "ptb", "central_lr", v, {0.3: 180.0, 1.0: 160.0, 3.0: 170.0}[v])
               for v in p.client_lrs]  # fmt: skip
    runs += central
    assert lr_choices(runs, p)["ptb"] == {
        "client_lr": 1.0,
        "central_lr": 1.0,
        "momentum_server_lr": 1.0,
        "momentum_client_lr": 0.3,
    }
    rank = {s.method: command(s, p, Path("d"), Path("o")) for s in select(p, ["rank"], runs)
            if s.dataset == "ptb"}  # fmt: skip
    assert flag(rank["FedAvgM"], "--lr") == "0.3" and flag(rank["FedAvgM"], "--server-lr") == "1"
    assert flag(rank["FedAvg"], "--lr") == "1" and "FedAdam" not in rank  # not chosen yet
    centralized = rank["centralized, 5 epochs (as many examples as C 0.1)"]
    assert flag(centralized, "--lr") == "1" and flag(centralized, "--epochs") == "5"
    # the centralized sweep sees as many examples as FedAvg's: 10 rounds x C 0.1 x E 1
    spec = next(s for s in select(p, ["sweep"], runs) if s.group == "central_lr=0.3")
    words = command(spec, p, Path("d"), Path("o"))
    assert words[1] == "train-central" and flag(words, "--epochs") == "1"
    assert flag(words, "--lr") == "0.3"


def test_attentive_methods_run_at_their_own_chosen_server_step():
    """FedAtt, AdaFL + FedAtt and FedAttOpt take the epsilon their sweep chose (the papers' 1.2
    diverged or stood still at the cpu preset's client lr); until it is chosen they wait, and
    the methods without a server knob do not."""
    p = PRESETS["cpu"]
    results = decided("cpu")  # the middle of every grid: FedAtt 0.3, FedAttOpt 100
    rank = [s for s in select(p, ["rank", "noniid"], results) if s.kind == "federated"]
    steps = {s.method: flag(command(s, p, Path("d"), Path("o")), "--epsilon")
             for s in rank if "--epsilon" in s.args}  # fmt: skip
    assert steps == {"FedAtt": "0.3", "AdaFL + FedAtt": "0.3", "FedAttOpt": "100",
                     CAPPED_FEDATTOPT: "100"}  # fmt: skip
    # the capped row is FedAttOpt at the same step, its reach cut to FedAvg's
    capped = next(s for s in rank if s.method == CAPPED_FEDATTOPT)
    assert flag(command(capped, p, Path("d"), Path("o")), "--max-reach") == "1"
    adafl = next(s for s in rank if s.method == "AdaFL + FedAtt")
    words = command(adafl, p, Path("d"), Path("o"))
    assert flag(words, "--strategy") == "fedatt" and "--adafl" in words
    undecided = [r for r in results if not r["group"].startswith("fedatt")]
    waiting = {s.method for s in select(p, ["rank"], undecided) if s.kind == "federated"}
    assert "FedAvg" in waiting and "FedMed" in waiting and "FedAvgM" in waiting
    assert not waiting & {"FedAtt", "FedAttOpt", CAPPED_FEDATTOPT, "AdaFL + FedAtt"}


def test_rank_waits_for_the_sweep_and_says_so(tmp_path):
    p = PRESETS["cpu"]
    assert {s.kind for s in select(p, ["rank"], [])} == {"ngram"}  # nothing else is decidable
    for ds in ("ptb", "wikitext-2"):
        (tmp_path / ds).mkdir()
    with pytest.raises(RuntimeError, match="add --suite sweep"):
        run_bench("cpu", ["rank"], tmp_path, tmp_path / "out", tmp_path / "runs")
    result = runner.invoke(bench_app, ["paper", "--preset", "cpu", "--suite", "code",
                                       "--dry-run", "--out", str(tmp_path / "o")])  # fmt: skip
    assert result.exit_code != 0 and "preset cpu has no suite code" in result.output


def test_noniid_runs_the_same_methods_on_articles_and_owners():
    p = PRESETS["cpu"]
    specs = select(p, ["noniid"], decided("cpu"))
    fed = [s for s in specs if s.kind == "federated"]
    assert {s.dataset for s in fed} == {"wikitext-2", "demo"}
    for ds, partition, clients in (("wikitext-2", "articles", "100"), ("demo", "user", "22")):
        mine = [s for s in fed if s.dataset == ds]
        fedkeys = {BOUNDED_FEDATT, CAPPED_FEDATTOPT}
        assert PAPERS_TABLE | {"FedAvgM", "FedAdam"} | fedkeys == {s.method for s in mine}
        for spec in mine:
            words = command(spec, p, Path("d"), Path("o"))
            assert flag(words, "--partition") == partition and flag(words, "--clients") == clients
            if spec.fraction == 0.1:
                assert flag(words, "--fraction") == "0.1"
    demo = [command(s, p, Path("d"), Path("o")) for s in specs if s.dataset == "demo"]
    assert all(flag(w, "--data") == "demo" for w in demo)


def test_the_demo_by_owner_runs_every_method_at_c_1_too_at_the_lrs_chosen_at_c_0_1():
    """At C 0.1 a round of the demo by owner holds 2 of its 22 phones; at C 1 every method
    weighs all 22 each round, against a centralized model of as many examples (50 epochs), at
    the same lrs and server steps as at C 0.1 (FedAttOpt's step scaled by 0.1 / C: it sums a
    term per phone). WikiText-2 by article stays at C 0.1 (hours a run)."""
    p = PRESETS["cpu"]
    specs = select(p, ["noniid"], decided("cpu"))
    at = {(s.dataset, s.method, s.fraction): s for s in specs}
    one = {m for d, m, c in at if d == "demo" and c == 1.0}
    tenth = {m for d, m, c in at if d == "demo" and c == 0.1}
    assert one == tenth - {"centralized, 5 epochs"} | {"FedSGD", "centralized, 50 epochs"}
    assert not {m for d, m, c in at if d == "wikitext-2" and c == 1.0} - {"FedSGD"}
    central = command(at["demo", "centralized, 50 epochs", 1.0], p, Path("d"), Path("o"))
    assert flag(central, "--epochs") == "50"
    for method in tenth - {"centralized, 5 epochs"}:
        low, high = (command(at["demo", method, c], p, Path("d"), Path("o")) for c in (0.1, 1.0))
        assert flag(high, "--fraction") == "1" and flag(high, "--lr") == flag(low, "--lr")
        for knob in ("--server-lr", "--epsilon"):
            if knob in low and "FedAttOpt" not in method:
                assert flag(high, knob) == flag(low, knob)
            elif knob in low:
                assert float(flag(high, knob)) == pytest.approx(float(flag(low, knob)) / 10)


def test_the_seeds_suite_runs_rows_again_changing_nothing_but_the_seed():
    """Each seeds run is its rank (PTB) or noniid (the demo by owner at C 1) run's command at
    another --seed (and its own folder), so the two differ by chance alone; the runs they
    repeat stay seed 0 and stay done."""
    p = PRESETS["cpu"]
    results = decided("cpu")
    first = {(s.dataset, s.method, s.fraction): s for s in select(p, ["rank", "noniid"], results)
             if s.dataset == "ptb" or (s.dataset == "demo" and s.fraction == 1.0)}  # fmt: skip
    seeds = select(p, ["seeds"], results)
    central = {d: m for d, m, _ in first if first[d, m, _].kind == "central"}
    assert {(s.dataset, s.method, s.fraction, s.seed) for s in seeds} == {
        (d, m, c, k)
        for d, c, methods in (("ptb", 0.1, ("FedAvg", "FedAvgM", CAPPED_FEDATTOPT)),
                              ("demo", 1.0, ("FedAvg", "FedAvgM", "FedAdam")))
        for m in (*methods, central[d])
        for k in (1, 2)
    }  # fmt: skip
    assert {s.partition for s in seeds if s.dataset == "demo" and s.kind != "central"} == {"user"}
    assert len({s.id for s in seeds} | {s.id for s in first.values()}) == len(seeds) + len(first)
    for spec in seeds:
        twin = command(first[spec.dataset, spec.method, spec.fraction], p, Path("d"), Path("o"))
        words = command(spec, p, Path("d"), Path("o"))
        assert flag(twin, "--seed") == "0" and flag(words, "--seed") == str(spec.seed)
        assert words.count("--seed") == 1
        at = words.index("--seed")
        assert words[:at] + words[at + 2 :] == twin[:at] + twin[at + 2 :]
        assert spec.id.endswith(f"-seed{spec.seed}")


def test_the_decay_suite_adds_an_lr_decay_alike_per_example_seen_and_nothing_else():
    """Each decay run is its rank run's command plus --lr-decay: 0.95 a round for FedAvg and
    FedAvgM, and for the centralized model the decay of the 10 rounds (50 rounds / 5 epochs)
    that see an epoch's examples, so both lrs fall alike per example seen."""
    p = PRESETS["cpu"]
    results = decided("cpu")
    rank = {s.method: s for s in select(p, ["rank"], results) if s.dataset == "ptb"}
    decay = select(p, ["decay"], results)
    central = next(m for m, r in rank.items() if r.kind == "central")
    assert sorted(s.method for s in decay) == sorted(["FedAvg", "FedAvgM", central])
    for spec in decay:
        twin = command(rank[spec.method], p, Path("d"), Path("o"))
        words = command(spec, p, Path("d"), Path("o"))
        at = words.index("--lr-decay")
        assert words[:at] + words[at + 2 :] == twin and "--lr-decay" not in twin
        expected = 0.95**10 if spec.kind == "central" else 0.95
        assert float(words[at + 1]) == pytest.approx(expected, rel=1e-3)
        assert spec.id.startswith("decay-ptb-")
    # the rank suite's centralized command is as before: its runs stay done
    assert command(rank[central], p, Path("d"), Path("o"))[-2:] == ["--workers", "0"]


def test_the_dropout_suite_adds_dropout_to_the_rank_rows_at_their_lr_and_the_next_larger():
    """Each dropout run is its rank run's command plus --dropout 0.5, once at the rank run's lr
    and once at the grid's next larger one (past the grid's top, one step of its ratio more):
    PTB's FedAvg, FedAvgM and centralized model at C 0.1, the targets' C (the gpu preset's C 0.5
    rows are not repeated)."""
    for name in ("cpu", "gpu"):
        p = PRESETS[name]
        results = decided(name)
        rank = {(s.method, s.fraction): s for s in select(p, ["rank"], results)
                if s.dataset == "ptb"}  # fmt: skip
        dropout = select(p, ["dropout"], results)
        central = next(m for (m, c), r in rank.items() if r.kind == "central" and c == 0.1)
        assert sorted(s.method for s in dropout) == sorted(["FedAvg", "FedAvgM", central] * 2)
        for spec in dropout:
            base = rank[spec.method, 0.1]
            assert spec.fraction == 0.1 and spec.id.startswith("dropout-ptb-")
            twin = command(base, p, Path("d"), Path("o"))
            words = command(spec, p, Path("d"), Path("o"))
            at = words.index("--dropout")
            assert words[at + 1] == "0.5" and "--dropout" not in twin
            del words[at : at + 2]
            if not spec.tag:  # the rank run's own lr: nothing else changes
                assert words == twin and spec.id == base.id.replace("rank-", "dropout-", 1)
                continue
            assert spec.tag == f"lr{spec.lr:g}" and spec.id.endswith(f"-c0.1-{spec.tag}")
            assert spec.lr == next_lr(p, base.lr) > base.lr
            lr = words.index("--lr")
            assert words[lr + 1] == f"{spec.lr:g}"
            assert words[:lr] + words[lr + 2 :] == twin[:lr] + twin[lr + 2 :]
    # the cpu grid is 0.3, 1, 3: the next above 1 is 3, above 3 one step (x3.16) more: 10
    assert [next_lr(PRESETS["cpu"], lr) for lr in (0.3, 1.0, 3.0)] == [1.0, 3.0, 10.0]
    assert next_lr(PRESETS["gpu"], 0.1) == 1.0


def test_the_confirm_suite_runs_each_chosen_lr_one_grid_step_lower_beside_the_rank_run():
    """Each confirm row is its rank run (the same command but for --out: recorded from it, not
    run again) and the same command one grid step below the lr the sweep chose: --lr for FedAvg
    and the centralized model, --server-lr for FedAvgM and FedAdam at their own client lr;
    nothing else changes, and only the rows at C 0.1, on both datasets, and the noniid suite's
    on the demo corpus by owner (the same, from its noniid run)."""
    for name in ("cpu", "gpu"):
        p = PRESETS[name]
        results = decided(name)
        repeated = {(s.dataset, s.method, s.fraction): s
                    for s in select(p, ["rank", "noniid"], results)
                    if s.partition == "iid" or s.dataset == "demo"}  # fmt: skip
        confirm = suite_runs("confirm", p, results)
        central = next(m for (ds, m, c), r in repeated.items()
                       if r.kind == "central" and c == 0.1 and ds == "ptb")  # fmt: skip
        demo_central = next(m for (ds, m, _), r in repeated.items()
                            if r.kind == "central" and ds == "demo")  # fmt: skip
        assert sorted((s.dataset, s.method) for s in confirm) == sorted(
            [(ds, m) for ds in ("ptb", "wikitext-2")
             for m in ("FedAvg", "FedAvgM", "FedAdam", central) * 2]
            + [("demo", m) for m in ("FedAvg", "FedAvgM", "FedAdam", demo_central) * 2]
        )  # fmt: skip
        for spec in confirm:
            base = repeated[spec.dataset, spec.method, 0.1]
            twin = command(base, p, Path("d"), Path("o"))
            words = command(spec, p, Path("d"), Path("o"))
            assert spec.fraction == 0.1 and spec.id.startswith(f"confirm-{spec.dataset}-")
            assert (spec.partition, spec.clients) == (base.partition, base.clients)
            if not spec.tag:  # the rank (noniid) run itself
                assert words == twin and spec.id == base.id.replace(f"{base.suite}-", "confirm-", 1)
                continue
            knob = "--server-lr" if spec.method in ("FedAvgM", "FedAdam") else "--lr"
            at = words.index(knob)
            was, now = float(twin[at + 1]), float(words[at + 1])
            assert (
                now
                == lower_lr(getattr(p, KNOBS[CONFIRMED.get(spec.method, "central_lr")].grid), was)
                < was
            )
            assert words[:at] + words[at + 2 :] == twin[:at] + twin[at + 2 :]
            assert spec.id.endswith(f"-c0.1-{spec.tag}") and spec.tag.endswith(f"lr{now:g}")
    # one step of the grid's ratio below, on the grid or past its bottom (half-decades)
    assert [lower_lr((0.3, 1.0, 3.0), v) for v in (3.0, 1.0, 0.3)] == [1.0, 0.3, 0.1]
    assert lower_lr((0.003, 0.01, 0.03), 0.1) == 0.03


def test_a_lower_lr_that_wins_at_full_length_asks_for_one_step_lower_twice_at_most():
    """As the sweep extends a grid past an edge, the confirm suite goes one step lower again
    where the lower run ends better on VALIDATION than the one above it (twice at most)."""
    p = PRESETS["cpu"]
    results = decided("cpu")  # FedAdam's server lr chosen: 0.01

    def runs_of(res):
        return [
            s for s in suite_runs("confirm", p, res) if s.dataset == "ptb" and s.method == "FedAdam"
        ]

    def scored(spec, val, test=100.0):
        return {
            **spec.fields(),
            "id": spec.id,
            "preset": "cpu",
            "best_val_ppl": val,
            "test_ppl": test,
        }

    rank = next(s for s in select(p, ["rank"], results) if s.id == "rank-ptb-fedadam-c0.1")
    twin, low = runs_of(results)
    assert (twin.tag, low.tag) == ("", "server-lr0.003")
    assert [s.tag for s in runs_of(results + [scored(rank, 150), scored(low, 160, test=1)])] == [
        "",
        "server-lr0.003",
    ]  # worse on validation (its better test is never read): no step further
    better = results + [scored(rank, 150), scored(low, 140)]
    lower = runs_of(better)[-1]
    assert lower.tag == "server-lr0.001" and len(runs_of(better)) == 3
    # and "N of M runs done" counts it: the plan grows by the step asked for
    assert planned(p, better)["confirm"] == planned(p, results)["confirm"] + 1
    assert len(runs_of(better + [scored(lower, 130)])) == 3  # MAX_EXTENSIONS steps at most


def test_progress_counts_every_planned_run():
    p = PRESETS["cpu"]
    plan = planned(p, [])
    # 5 tasks (PTB, WikiText-2, the demo, NUS SMS, Ubuntu IRC) x (4 knobs x 3 grid values + 2
    # joint knobs x 3 x 3 client lrs); 2 datasets x
    # (12 methods + ngram + central); WikiText-2 by article (12) and the demo (12 + ngram +
    # central; at C 1 the 9 methods without a C of their own, FedSGD's and AdaFL's, and a
    # 50-epoch central); PTB's FedAvg, FedAvgM, capped FedAttOpt and centralized model, and the
    # demo by owner's at C 1 FedAvg, FedAvgM, FedAdam and centralized model, at 2 more seeds;
    # PTB's FedAvg, FedAvgM and centralized model with the lr decayed, and with dropout at 2 lrs;
    # and on both datasets and the demo by owner FedAvg, FedAvgM, FedAdam and the centralized
    # model at their lr and one step below
    assert plan == {"sweep": 150, "rank": 28, "noniid": 36, "seeds": 16, "decay": 3, "dropout": 6,
                    "confirm": 24}  # fmt: skip
    assert set(KNOBS) == {"client_lr", "central_lr", "momentum_server_lr", "adam_server_lr",
                          "fedatt_step", "fedattopt_step"}  # fmt: skip


def test_a_run_whose_command_the_preset_no_longer_makes_is_superseded_not_done():
    """A run counts as done only while its command is the one the preset makes for its id (its
    own --data and --out aside): the FedAtt that ran at the papers' epsilon 1.2 before the sweep
    chose its step is named as superseded and left out of "N of M runs done"."""
    from fedkey_bench.paper.plan import superseded
    from fedkey_bench.paper.report import progress

    p = PRESETS["cpu"]
    results = [{**r, "wall_seconds": 60.0} for r in decided("cpu")]
    specs = {s.id: s for s in select(p, ["rank"], results)}

    def ran(spec_id, words=None):
        spec = specs[spec_id]
        cmd = words or command(spec, p, Path("../data"), Path("runs/bench/cpu") / spec_id)
        return {"id": spec_id, "suite": "rank", "preset": "cpu", "kind": spec.kind,
                "command": shlex.join(cmd), "wall_seconds": 60.0}  # fmt: skip

    fedavg = ran("rank-ptb-fedavg-c0.1")
    cmd = command(specs["rank-ptb-fedatt-c0.1"], p, Path("d"), Path("o"))
    at = cmd.index("--epsilon")
    old = ran("rank-ptb-fedatt-c0.1", cmd[:at] + cmd[at + 2 :])  # before the step was swept
    runs = [*results, fedavg, old]
    assert superseded(p, runs) == ["rank-ptb-fedatt-c0.1"]
    line = progress(p, runs)
    assert "rank 1 of 28" in line and "1 runs are superseded" in line
    assert "`rank-ptb-fedatt-c0.1`" in line
    assert superseded(p, [*results, fedavg]) == []


def test_costliest_runs_wait_until_every_other_run_is_done():
    p = PRESETS["cpu"]
    order = [(s.suite, s.dataset, s.method) for s in select(p, ["sweep", "rank", "noniid"],
                                                            decided("cpu"))]  # fmt: skip
    late = [i for i, (_, d, m) in enumerate(order) if m in LATE and d != "demo"]
    assert min(late) > max(i for i, (_, d, m) in enumerate(order) if m not in LATE and d != "demo")
    first = [o for o in order if o[1] == "ptb"][:2]
    assert first[0][0] == "sweep" and order.index(("rank", "ptb", "FedAvg")) < order.index(
        ("sweep", "wikitext-2", "FedAvg, client lr 0.3")
    )
    # the demo corpus's runs (minutes each), its costliest too, come before the datasets' (hours)
    demo = [i for i, o in enumerate(order) if o[1] == "demo"]
    assert max(demo) < min(i for i, o in enumerate(order) if o[1] != "demo")
    assert {order[i][2] for i in demo} >= set(LATE)
    assert order[-1] == ("noniid", "wikitext-2", "FedSGD")


def test_other_benches_results_keep_their_shape(tmp_path):
    """attacks, privacy and load keep their results with Bench too: no preset, no suite."""
    bench = Bench(tmp_path)
    bench.add({"id": "fedavg-scale-1of10", "command": "fedkey simulate"}, "fedkey-bench attacks")
    bench.add({"id": "fedavg-scale-1of10", "command": "fedkey simulate x"}, "fedkey-bench attacks")
    data = (tmp_path / "results.json").read_text()
    assert "lr_choices" not in data and bench.read() == [
        {"id": "fedavg-scale-1of10", "command": "fedkey simulate x"}]  # fmt: skip


def test_a_superseded_centralized_model_stays_the_reference_once_and_says_so():
    """The centralized run made before its lr was swept is the PTB table's reference until it is
    run again: one row, labelled superseded, the federated rows held against it."""
    from fedkey_bench.paper.report import ranking_sections

    p = PRESETS["cpu"]
    results = [{**r, "wall_seconds": 60.0} for r in decided("cpu")]  # centralized lr 1 chosen
    spec = next(s for s in select(p, ["rank"], results) if s.kind == "central")
    words = command(spec, p, Path("../data"), Path("runs/bench/cpu") / spec.id)
    words[words.index("--lr") + 1] = "3"  # as it ran before the sweep chose its own lr
    row = {"suite": "rank", "dataset": spec.dataset, "fraction": 0.1, "preset": "cpu",
           "top1": 0.2, "top3": 0.3, "ksr": 0.5, "rounds": 5, "wall_seconds": 60.0}  # fmt: skip
    central = {**row, "id": spec.id, "method": spec.method, "kind": "central", "test_ppl": 160.0,
               "best_round": 3, "command": shlex.join(words)}  # fmt: skip
    fedavg = {**row, "id": "rank-ptb-fedavg-c0.1", "method": "FedAvg", "kind": "federated",
              "test_ppl": 200.0, "best_round": 50, "rounds": 50, "command": "fedkey simulate",
              "weight_spread": []}  # fmt: skip
    md = "\n".join(ranking_sections([*results, central, fedavg], {}))
    ptb = md.split("### PTB")[1].split("###")[0]
    rows = [line for line in ptb.splitlines() if "centralized," in line]
    assert len(rows) == 1 and "(superseded: run again with the current command)" in rows[0]
    assert "| FedAvg | 0.1 | 200.00 | +25.0% |" in ptb


def test_a_run_stopped_at_a_time_limit_shows_how_far_it_got_until_it_is_done(tmp_path):
    """FedSGD (every phone every round) outlasts a session: results.md says it is begun and how
    many rounds it has, not "not run yet"; once done it is an ordinary row."""
    from fedkey_bench.paper.report import ranking_sections

    results = [{**r, "wall_seconds": 60.0} for r in decided("cpu")]
    bench = Bench(tmp_path)
    bench.stopped("cpu", "rank-ptb-fedsgd-c1", 12, 50)
    bench.stopped("cpu", "rank-ptb-centralized-5-epochs-as-many-examples-as-c-0-1-c0.1", 2, 5,
                  [131.25, 2])  # fmt: skip
    md = "\n".join(ranking_sections(results, {}, bench.begun()))
    ptb = md.split("### PTB")[1].split("###")[0]
    assert "| FedSGD | 1 | begun: round 12 of 50 |" in ptb
    assert ("| centralized, 5 epochs (as many examples as C 0.1) | - | begun: epoch 2 of 5 (best "
            "val ppl so far 131.25, epoch 2) |") in ptb  # fmt: skip
    assert "| AdaFL + FedAvg | - | not run yet |" in ptb
    assert "2 more begun: stopped at a time limit" in md

    row = {"id": "rank-ptb-fedsgd-c1", "preset": "cpu", "suite": "rank", "command": "x"}
    bench.add(row, "fedkey-bench paper --preset cpu --suite rank")
    assert list(bench.begun()) == [
        "cpu/rank-ptb-centralized-5-epochs-as-many-examples-as-c-0-1-c0.1"
    ]


def test_bench_paper_help_says_what_every_suite_runs():
    """--suite's help names each suite the bench accepts (the help is written by hand)."""
    import inspect

    from fedkey_bench.cli import bench_paper
    from fedkey_bench.paper.suites import SUITES

    text = inspect.signature(bench_paper).parameters["suite"].default.help
    assert [s for s in SUITES if f"{s}: " not in text] == []


def test_the_sweep_table_shows_a_run_stopped_at_a_time_limit(tmp_path):
    """A sweep run longer than a GPU lease (the gpu preset's centralized lr sweep: 25 epochs)
    stands in its knob's row of the sweep table with how far it got, where it used to be missing
    until done; the chosen value is unchanged."""
    from fedkey_bench.paper.learning_rates import sweep_sections

    p = PRESETS["gpu"]
    done = []
    for lr, val in (("0.01", 577.6), ("0.1", 259.7), ("1", 286.3)):
        spec = next(
            s for s in select(p, ["sweep"], [], only=["*-ptb-*"]) if s.group == f"client_lr={lr}"
        )
        done.append({**spec.fields(), "id": spec.id, "preset": "gpu", "best_val_ppl": val,
                     "best_round": 50, "rounds": 50,
                     "command": shlex.join(command(spec, p, Path("d"), Path("r")))})  # fmt: skip
    central = next(
        s for s in select(p, ["sweep"], done, only=["*-ptb-*"]) if s.group == "central_lr=1"
    )
    bench = Bench(tmp_path)
    bench.stopped("gpu", central.id, 18, 25, [124.6, 4])
    md = "\n".join(sweep_sections(done, {"gpu": {"ptb": {"client_lr": 0.1}}}, bench.begun()))
    rows = [line for line in md.splitlines() if line.startswith("| PTB")]
    assert rows == [
        "| PTB (100 IID phones) | client lr | 0.01, 0.1, 1 | 0.1 | 259.70 | 3 |",
        "| PTB (100 IID phones) | central lr | 1 | none yet | - | 0; 1 begun: epoch 18 of 25 |",
    ]
