"""fedkey_bench.paper.verify: a results table's row scored again from the checkpoint kept for it, on the
held-out text its recorded command names; a figure that does not come back is named."""

import json
import shlex

from typer.testing import CliRunner

from fedkey.cli import app
from fedkey_bench.paper.verify import held_out_flags, verify


def _run(tmp_path) -> tuple[dict, object]:
    """A 2-round demo run in RUNS/<id>, and its results.json object as the bench writes it."""
    runs = tmp_path / "runs"
    out = runs / "rank-demo-fedavg-c0.5"
    cmd = ["fedkey", "simulate", "--data", "demo", "--max-eval-sentences", "60", "--ksr-sentences",
           "5", "--clients", "4", "--fraction", "0.5", "--rounds", "2", "--local-epochs", "1",
           "--max-train-tokens", "3000", "--workers", "0", "--seed", "0", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, cmd[1:])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = min(rows[1:], key=lambda r: r["val_ppl"])
    run = {"id": out.name, "suite": "rank", "kind": "federated", "best_round": best["round"],
           "best_val_ppl": best["val_ppl"], "test_ppl": best["test_ppl"],
           "command": shlex.join(cmd)}  # fmt: skip
    return run, runs


def test_a_row_comes_back_from_its_kept_checkpoint_and_a_wrong_figure_is_named(tmp_path):
    run, runs = _run(tmp_path)
    [row] = verify([run], runs)
    assert row[0] == run["id"] and row[-1] == "yes"
    assert row[5] == f"{run['test_ppl']:.2f}"
    # a figure results.json holds that the model does not give (the wrong round kept, say)
    [row] = verify([{**run, "test_ppl": run["test_ppl"] * 1.05}], runs)
    assert row[-1] == "no: test_ppl of results.json"
    # a twin is checked through the run it was recorded from; a run without a folder here is
    # listed, not failed
    [twin, gone] = verify([{**run, "id": "confirm-demo-fedavg-c0.5", "same_run_as": run["id"]},
                           {**run, "id": "rank-demo-fedatt-c0.5"}], runs)  # fmt: skip
    assert twin[-1] == "yes" and gone[-1] == "no checkpoint here"


def test_the_held_out_text_is_read_from_the_recorded_command():
    cmd = ("fedkey simulate --data ../shared/data/ptb --paper-protocol --vocab-size 10000 "
           "--ksr-sentences 100 --seed 1 --out runs/x")  # fmt: skip
    assert held_out_flags(cmd) == {"data": "../shared/data/ptb", "paper_protocol": True,
                                   "max_eval_sentences": None, "ksr_sentences": 100,
                                   "seed": 1, "clients": 100, "partition": "iid"}  # fmt: skip
    short = ("fedkey train-central --data demo --max-eval-sentences 40 --out runs/y "
             "--clients 300 --partition user")  # fmt: skip
    assert held_out_flags(short) == {"data": "demo", "paper_protocol": False,
                                     "max_eval_sentences": 40, "ksr_sentences": 100, "seed": 0,
                                     "clients": 300, "partition": "user"}  # fmt: skip


def test_the_command_fails_when_a_figure_does_not_come_back(tmp_path, capsys):
    """`python -m fedkey_bench.paper.verify FOLDER`: exit 0 when every run with a checkpoint here gives
    its figures again, 1 when one does not (a check to run after a bench)."""
    from fedkey_bench.paper.results import Bench
    from fedkey_bench.paper.verify import main

    run, runs = _run(tmp_path)  # runs/<id>: RUNS_DIR/<folder name>/<id> with RUNS_DIR = tmp_path
    folder = tmp_path / "runs"
    Bench(folder).add(run, "fedkey-bench paper")
    assert main([str(folder), "--runs-dir", str(tmp_path)]) == 0
    assert "1 of 1 runs with a checkpoint here give their recorded figures again" in (
        capsys.readouterr().out
    )
    Bench(folder).add({**run, "best_val_ppl": run["best_val_ppl"] * 0.9}, "fedkey-bench paper")
    assert main([str(folder), "--runs-dir", str(tmp_path)]) == 1
    assert "no: val_ppl of results.json" in capsys.readouterr().out


def test_record_keeps_each_machines_checks_for_the_next_machine(tmp_path, capsys):
    """`--record`: a check made here goes into FOLDER/verified.json; on a machine without the
    checkpoint the row shows that check, naming where and when it was made, while the run's
    figures are still those checked (a rerun with other figures is not covered by it)."""
    import shutil

    from fedkey_bench.paper.results import Bench
    from fedkey_bench.paper.verify import RECORD, main

    run, runs = _run(tmp_path)
    folder = tmp_path / "runs"
    Bench(folder).add(run, "fedkey-bench paper")
    assert main([str(folder), "--runs-dir", str(tmp_path), "--record"]) == 0
    capsys.readouterr()
    kept = json.loads((folder / RECORD).read_text())["runs"][run["id"]]
    assert kept["agrees"] == "yes" and kept["best_round"] == run["best_round"]
    shutil.rmtree(runs / run["id"])  # another machine: the checkpoint is not here
    assert main([str(folder), "--runs-dir", str(tmp_path), "--record"]) == 0
    out = capsys.readouterr().out
    assert f"| yes (on {kept['device']}, {kept['day']}) |" in out
    assert "0 of 0 runs with a checkpoint here" in out
    assert "(1 without one; of those, 1 of 1 checked on an earlier machine gave them)" in out
    # without --record the record is not read; a rerun's new figures are not the checked ones
    assert main([str(folder), "--runs-dir", str(tmp_path)]) == 0
    assert "| no checkpoint here |" in capsys.readouterr().out
    Bench(folder).add({**run, "test_ppl": run["test_ppl"] * 1.05}, "fedkey-bench paper")
    main([str(folder), "--runs-dir", str(tmp_path), "--record"])
    assert "| no checkpoint here |" in capsys.readouterr().out
    assert json.loads((folder / RECORD).read_text())["runs"][run["id"]] == kept  # kept as it was


def test_a_damaged_record_is_named_in_one_line(tmp_path, capsys):
    from fedkey_bench.paper.results import Bench
    from fedkey_bench.paper.verify import RECORD, main

    run, _ = _run(tmp_path)
    folder = tmp_path / "runs"
    Bench(folder).add(run, "fedkey-bench paper")
    (folder / RECORD).write_text("{not json")
    assert main([str(folder), "--runs-dir", str(tmp_path), "--record"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("move it aside and run again")
    assert (folder / RECORD).read_text() == "{not json"  # left as it was
