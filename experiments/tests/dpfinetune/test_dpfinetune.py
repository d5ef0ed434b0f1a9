"""`fedkey-bench dpfinetune` (fedkey_bench.dpfinetune): the cells and their commands from a protocol,
S0 from the non-private run's first round, a cell's record from its rows, when a cell is done,
and the page from a synthetic results.json (the answer first, the multiples, a cell not run)."""

from __future__ import annotations

import json
import shlex

import pytest

from fedkey_bench.dpfinetune import cells as grid
from fedkey_bench.dpfinetune import report, runner
from fedkey_bench.dpfinetune.summary import first_median_norm, summarize

IRC = grid.POPULATIONS["ubuntu-irc"]


def test_the_cells_are_the_issues():
    p = grid.Protocol()
    ids = [c.id for c in grid.cells(p)]
    assert ids == ["fedavg-nodp", "fedatt-nodp", "fedavg-eps8", "fedavg-eps4", "fedavg-eps2",
                   "fedavg-eps1", "fedatt-eps8", "fedatt-eps4", "fedatt-eps2", "fedatt-eps1",
                   "fedavg-z0", "fedatt-z0"]  # fmt: skip
    # the non-private FedAvg is the reference even when only FedAtt is asked for
    only_att = grid.Protocol(strategies=("fedatt",), epsilons=(8.0,))
    assert [c.id for c in grid.cells(only_att)] == ["fedavg-nodp", "fedatt-nodp", "fedatt-eps8",
                                                    "fedatt-z0"]  # fmt: skip
    assert [c.id for c in grid.selected(grid.cells(p), ["fedavg-*", "fedatt-eps8"])] == [
        "fedavg-nodp", "fedavg-eps8", "fedavg-eps4", "fedavg-eps2", "fedavg-eps1", "fedatt-eps8",
        "fedavg-z0"]  # fmt: skip


def test_the_commands_share_everything_but_the_privacy():
    p = grid.Protocol(clients=200, fraction=0.1, rounds=2, workers=1, max_eval_sentences=200)
    nodp = " ".join(grid.argv(IRC, p, grid.Cell("fedavg", None), None))
    shared = ("fedkey simulate --init base --ngram base --data ubuntu-irc --partition user "
              "--clients 200 --fraction 0.1 --rounds 2 --local-epochs 1 --lr 0.5 --lr-decay 0.95 "
              "--precision fp32 --max-eval-sentences 200 --workers 1")  # fmt: skip
    assert nodp.startswith(shared) and "--strategy fedavg" in nodp
    assert nodp.endswith("--bound adaptive --bound-multiple 1 --trim 0 --outlier-z 0")
    assert "--dp-" not in nodp
    dp = " ".join(grid.argv(IRC, p, grid.Cell("fedatt", 2.0), "3.47"))
    assert dp.startswith(shared)
    assert "--strategy fedatt --fedatt-normalizer fixed --epsilon 1.2" in dp
    assert dp.endswith("--dp-mechanism blt --dp-clip-quantile 0.5 --dp-clip 3.47 "
                       "--dp-target-epsilon 2")  # fmt: skip
    assert "--bound" not in dp
    with pytest.raises(ValueError, match="needs its first clip"):
        grid.argv(IRC, p, grid.Cell("fedavg", 8.0), None)
    z0 = grid.Cell("fedavg", None, noise=False)
    quiet = " ".join(grid.argv(IRC, p, z0, "3.47"))
    assert z0.id == "fedavg-z0" and z0.private
    assert quiet.endswith("--dp-clip-quantile 0.5 --dp-clip 3.47 --dp-noise-multiplier 0")
    assert "--dp-target-epsilon" not in quiet
    # the population's own size and share unless the protocol says otherwise
    default = " ".join(grid.argv(IRC, grid.Protocol(), grid.Cell("fedavg", None), None))
    assert "--clients 15853 --fraction 0.0631 --rounds 3" in default


def _rows(path, rows: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_s0_is_the_non_private_runs_first_median_norm(tmp_path):
    p = grid.Protocol()
    with pytest.raises(ValueError, match="--only fedavg-nodp"):
        runner.first_clip(IRC, p, tmp_path)
    folder = runner.run_dir(tmp_path, IRC, grid.Cell("fedavg", None))
    _rows(folder, [{"round": 0, "info": {}},
                   {"round": 1, "info": {"clip": {"median_norm": 3.4667650310505707}}}])  # fmt: skip
    assert runner.first_clip(IRC, p, tmp_path) == ("3.47", "the median update norm of "
                                                   "fedavg-nodp's first round")  # fmt: skip
    assert runner.first_clip(IRC, grid.Protocol(clip=1.23456), tmp_path) == ("1.23", "--clip")
    assert first_median_norm([{"round": 1, "info": {"dp": {"clip": 3.0}}}]) is None


def _row(r: int, ppl: float, top1: float, best: int, **extra) -> dict:
    return {"round": r, "val_ppl": ppl - 10, "test_ppl": ppl, "all_top1": top1, "ksr": 0.3,
            "ngram_weight": 0.8, "mix_test_ppl": ppl - 5, "mix_all_top1": top1 + 0.01,
            "mix_ksr": 0.31, "unseen_test_ppl": ppl + 20, "best_round": best, **extra}  # fmt: skip


def test_a_cells_record_is_its_best_validation_round_and_what_dp_spent():
    dp0 = {"dp": {"mechanism": "blt", "noise_multiplier": 0.819, "clip": 3.0}}
    dp = {"num_updates": 317, "dp": {"noise_multiplier": 0.819, "clip": 2.5,
                                     "update_noise_multiplier": 0.82}}  # fmt: skip
    rows = [_row(0, 150.0, 0.11, 0, info=dp0, epsilon=0.0, delta=2.4e-5),
            _row(1, 130.0, 0.12, 1, info={**dp, "dp": {**dp["dp"], "clip": 3.0}}, epsilon=5.7),
            _row(2, 140.0, 0.115, 1, info=dp, epsilon=7.98, delta=2.4e-5)]  # fmt: skip
    got = summarize(rows, grid.Cell("fedavg", 8.0), 2)
    assert got["id"] == "fedavg-eps8" and got["best_round"] == 1 and got["rounds_done"] == 2
    assert got["test_ppl"] == 130.0 and got["mix_test_ppl"] == 125.0 and got["last_test_ppl"] == 140
    assert got["epsilon"] == 7.98 and got["delta"] == 2.4e-5 and got["noise_multiplier"] == 0.819
    assert got["cohort"] == 317 and (got["first_clip"], got["last_clip"]) == (3.0, 2.5)
    assert got["test_ppl_curve"] == [150.0, 130.0, 140.0]


def test_a_cell_is_done_once_with_the_same_command(tmp_path):
    p = grid.Protocol(rounds=2)
    cell = grid.Cell("fedavg", 8.0)
    cmd = runner.command_line(IRC, p, cell, "3.47", tmp_path)
    folder = runner.run_dir(tmp_path, IRC, cell)
    _rows(folder, [{"round": 0}, {"round": 1}, {"round": 2}])
    line = shlex.join(cmd).replace("--workers 2", "--workers 8")  # where it ran aside
    assert runner.is_done(cmd, folder, {"command": line, "rounds_done": 2})
    assert not runner.is_done(
        cmd, folder, {"command": line.replace("3.47", "3.5"), "rounds_done": 2}
    )
    assert not runner.is_done(cmd, folder, {"command": line, "error": "refused", "rounds_done": 2})
    assert not runner.is_done(cmd, folder, {"command": line, "rounds_done": 3})  # rows gone
    assert runner.refusal("x exited 1\nlog line\nerror: --dp-target-epsilon 1 is out of reach") == (
        "--dp-target-epsilon 1 is out of reach")  # fmt: skip


def _cell(id_: str, ppl: float, top1: float, eps: float | None = None) -> dict:
    return {"id": id_, "label": id_, "test_ppl": ppl, "all_top1": top1, "ksr": 0.30,
            "mix_test_ppl": ppl * 0.9, "mix_all_top1": top1 + 0.01, "mix_ksr": 0.32,
            "best_round": 10, "epsilon": eps, "delta": 2.4e-5 if eps else None,
            "command": f"fedkey simulate --out /home/someone/runs/{id_}", "rounds": 10,
            "rounds_done": 10}  # fmt: skip


def test_the_lead_compares_dp_fedatt_with_dp_fedavg_and_prices_the_noise():
    def cell(id_: str, ppl: float, top1: float, eps: float | None = None) -> dict:
        strategy, _, rest = id_.partition("-")
        target = float(rest[3:]) if rest.startswith("eps") else None
        return {**_cell(id_, ppl, top1, eps), "strategy": strategy, "target_epsilon": target}

    cells = {c["id"]: c for c in (
        cell("fedavg-nodp", 100.0, 0.14), cell("fedavg-z0", 103.0, 0.137),
        cell("fedavg-eps8", 104.03, 0.137, 7.99), cell("fedavg-eps1", 108.15, 0.13, 0.99),
        cell("fedatt-eps8", 110.0, 0.13, 7.99))}  # fmt: skip
    pop = {"label": "Ubuntu IRC", "cells": cells}
    att = report.attention_answer(pop)
    assert att is not None and "perplexity 1.057x (at most 1.05x: not met)" in att
    noise = report.noise_answer(pop)
    assert noise is not None and "(z 0, 103.00): epsilon 8 1.010x, epsilon 1 1.050x" in noise
    assert "against the non-private fine-tune: 1.030x" in noise
    del cells["fedavg-z0"], cells["fedatt-eps8"]
    assert report.noise_answer(pop) is None and report.attention_answer(pop) is None


def test_the_page_leads_with_the_answer_and_lists_what_did_not_run(tmp_path):
    planned = [{"id": i, "label": i} for i in ("fedavg-nodp", "fedatt-nodp", "fedavg-eps8",
                                               "fedavg-eps2", "fedatt-eps8", "fedatt-eps2")]  # fmt: skip
    pop = {
        "label": "Ubuntu IRC", "clients": 15853, "fraction": 0.02, "planned": planned,
        "settings": {"rounds": 10, "strategies": ["fedavg", "fedatt"], "init": "base",
                     "ngram": "base", "max_eval_sentences": 500},
        "base": {"test_ppl": 150.0, "all_top1": 0.11, "ksr": 0.31, "mix_test_ppl": 140.0,
                 "mix_all_top1": 0.12, "mix_ksr": 0.32},
        "cells": {
            "fedavg-nodp": _cell("fedavg-nodp", 100.0, 0.14),
            "fedavg-eps8": _cell("fedavg-eps8", 104.0, 0.1372, 7.99),
            "fedavg-eps2": _cell("fedavg-eps2", 160.0, 0.12, 1.99),
            "fedatt-eps8": {"id": "fedatt-eps8", "label": "fedatt-eps8", "error": "out of reach",
                            "command": "fedkey simulate --strategy fedatt"},
        },
        "command": "fedkey-bench dpfinetune", "first_clip": {"value": 3.47, "source": "--clip"},
    }  # fmt: skip
    results = {"populations": {"ubuntu-irc": pop}}
    page = report.save(tmp_path, results).read_text()
    lead = page.split("\n\n")[2]
    fedavg, fedatt = lead.splitlines()
    assert fedavg.startswith("- **Ubuntu IRC, DP-FedAvg**: At epsilon 8 (reached 7.99)")
    assert "alone, perplexity 1.040x the non-private fine-tune's (at most 1.05x: met)" in fedavg
    assert "top-1 0.980x (at least 0.97x: met)" in fedavg
    assert "At epsilon 2 against the base: alone, mixed (perplexity 1.067x the base's" in fedavg
    assert "with the 3-gram, mixed (perplexity 1.029x the base's, top-1 1.083x)" in fedavg
    assert "At epsilon 8: refused by fedkey: out of reach." in fedatt
    assert "At epsilon 2: not run yet" in fedatt
    assert page.index(lead) < page.index("## Ubuntu IRC")
    assert "| fedavg-eps8 | 1.040x | 0.980x | 1.000x |" in page  # x FT, alone: ppl, top-1, KSR
    assert (
        "Not in the tables: fedatt-nodp (not run yet); fedatt-eps8 (refused by fedkey: out of reach)"
        in page
    )
    assert "/home/" not in page and "[results.json](results.json)" in page
    assert json.loads((tmp_path / "results.json").read_text()) == results
    better, worse = _cell("a", 140.0, 0.12), _cell("b", 150.0, 0.11)
    assert report.against_base(better, pop["base"], "alone").startswith("alone, better")
    assert report.against_base(worse, pop["base"], "alone").startswith("alone, worse")
    assert report.rebuild(tmp_path).read_text() == page  # from results.json alone


def test_the_bench_runs_the_cells_in_turn_and_resumes(tmp_path, monkeypatch):
    """fedkey itself stood in for (the real runs: the README's smoke run): S0 goes from the
    non-private run's first round into the DP commands, a cell fedkey refuses is recorded and the
    others go on, and a second bench runs only what is not done."""
    calls: list[str] = []

    def fake_run(name, cmd, folder, on_round=None, resumable=False):
        calls.append(name)
        line = shlex.join(cmd)
        if "--dp-target-epsilon 1" in line:
            raise RuntimeError(f"{name}: `{line}` exited 1\nerror: epsilon 1 is out of reach")
        dp = "--dp-clip" in cmd
        info = ({"num_updates": 317, "dp": {"noise_multiplier": 0.8, "clip": 3.47}} if dp
                else {"clip": {"median_norm": 3.4712, "norm": 3.4712}})  # fmt: skip
        rows = [_row(0, 150.0, 0.11, 0, info={"dp": {"noise_multiplier": 0.8}} if dp else {}),
                _row(1, 110.0 if dp else 100.0, 0.13, 1, info=info, epsilon=7.9 if dp else None)]  # fmt: skip
        _rows(folder, rows)
        return rows, {"command": line, "wall_seconds": 1.0, "cpu_seconds": 1.0}

    monkeypatch.setattr(runner, "run_fedkey", fake_run)
    p = grid.Protocol(rounds=1, epsilons=(8.0, 1.0), strategies=("fedavg",))
    refused = runner.run_population(IRC, p, tmp_path, None, "fedkey-bench dpfinetune")
    assert refused == {"ubuntu-irc/fedavg-eps1": "epsilon 1 is out of reach"}
    assert calls == ["ubuntu-irc/fedavg-nodp", "ubuntu-irc/fedavg-eps8", "ubuntu-irc/fedavg-eps1",
                     "ubuntu-irc/fedavg-z0"]  # fmt: skip
    entry = report.load(tmp_path)["populations"]["ubuntu-irc"]
    assert "--dp-clip 3.47 " in entry["cells"]["fedavg-eps8"]["command"]
    assert entry["first_clip"]["value"] == 3.47 and entry["base"]["test_ppl"] == 150.0
    assert entry["cells"]["fedavg-eps1"]["error"] == "epsilon 1 is out of reach"
    page = (tmp_path / "results.md").read_text()
    assert "perplexity 1.100x the non-private fine-tune's (at most 1.05x: not met)" in page
    calls.clear()
    runner.run_population(IRC, p, tmp_path, None, "fedkey-bench dpfinetune")
    assert calls == ["ubuntu-irc/fedavg-eps1"]  # the refused one is asked again, the rest done


def test_a_refused_reference_run_is_named_when_s0_was_to_come_from_it(tmp_path, monkeypatch):
    def refuse(name, cmd, folder, on_round=None, resumable=False):
        raise RuntimeError(f"{name}: exited 1\nerror: --clients 20000: only 15853 senders")

    monkeypatch.setattr(runner, "run_fedkey", refuse)
    p = grid.Protocol(epsilons=(8.0,), strategies=("fedavg",))
    with pytest.raises(ValueError, match="fedavg-nodp: --clients 20000: only 15853 senders"):
        runner.run_population(IRC, p, tmp_path, None, "fedkey-bench dpfinetune")


def test_the_command_prints_its_cells_and_fails_in_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fedkey_bench.cli import app

    monkeypatch.setenv("FEDKEY_DATA_DIR", str(tmp_path / "data"))
    run = CliRunner().invoke
    missing = run(app, ["dpfinetune", "--out", str(tmp_path / "out")])
    assert missing.exit_code == 1 and "error: ubuntu-irc is not in" in missing.output
    (tmp_path / "data" / "ubuntu-irc" / "train").mkdir(parents=True)
    (tmp_path / "data" / "ubuntu-irc" / "train" / "2004-01-01.raw.txt").write_text("")
    bad = run(app, ["dpfinetune", "--strategy", "fedmed"])
    assert (
        bad.exit_code == 1 and "error: --strategy fedmed: choose from fedavg, fedatt" in bad.output
    )
    dry = run(app, ["dpfinetune", "--dry-run", "--epsilon", "8", "--strategy", "fedavg",
                    "--out", str(tmp_path / "out")])  # fmt: skip
    assert dry.exit_code == 0, dry.output
    lines = dry.output.splitlines()
    assert len(lines) == 3 and "--dp-clip S0 --dp-target-epsilon 8" in lines[1]
    assert "--dp-clip S0 --dp-noise-multiplier 0" in lines[2]
    assert not (tmp_path / "out").exists()  # nothing run, nothing written
