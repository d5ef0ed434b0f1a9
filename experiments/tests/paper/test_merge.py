"""`fedkey-bench merge`: a bench run on another machine (a GPU lent for a session took the cpu
preset's costliest runs) taken into this one's results, without losing what this one has."""

import json

import pytest
from typer.testing import CliRunner

from fedkey_bench.cli import app
from fedkey_bench.paper.presets import PRESETS
from fedkey_bench.paper.results import Bench
from fedkey_bench.paper.sweep import lr_choices
from tests.paper.test_paper import _finished, _smoke_data
from tests.paper.test_ranking import decided


def test_merge_takes_the_runs_and_notes_this_machine_lacks_and_keeps_its_own(tmp_path):
    here = Bench(tmp_path / "here")
    mine = {"id": "a", "preset": "cpu", "suite": "rank", "test_ppl": 140.0, "command": "x"}
    here.add(mine, "fedkey-bench paper --preset cpu")
    here.stopped("cpu", "b", 4, 50)
    here.stopped("cpu", "c", 10, 50, [300.0, 10])
    there = tmp_path / "there.json"
    sweep = decided("cpu")  # the sweep, run there: its choices open the ranking here too
    there.write_text(json.dumps({
        "bench_commands": ["fedkey-bench paper --preset cpu", "fedkey-bench paper --preset cpu "
                           "--suite rank --only rank-ptb-fedsgd-c1"],
        "begun": {"cpu/b": [2, 50], "cpu/c": [12, 50, 280.0, 12], "cpu/d": [3, 50]},
        "runs": [{**mine, "test_ppl": 150.0}, {"id": "b", "preset": "cpu", "suite": "rank"},
                 *sweep],
    }))  # fmt: skip

    taken, kept = here.merge(there)
    assert kept == ["cpu/a"] and taken[0] == "cpu/b" and len(taken) == 1 + len(sweep)
    runs = {(r["preset"], r["id"]): r for r in here.read()}
    assert runs["cpu", "a"]["test_ppl"] == 140.0  # this machine's own run, as it was
    assert "cpu/b" not in here.begun()  # done there: no longer begun
    assert here.begun()["cpu/c"] == [12, 50, 280.0, 12]  # the note with more rounds
    assert here.begun()["cpu/d"] == [3, 50]
    assert here.commands()[1].endswith("--only rank-ptb-fedsgd-c1") and len(here.commands()) == 2
    assert here.lr_choices()["cpu"] == lr_choices(sweep, PRESETS["cpu"])

    assert here.merge(there) == ([], ["cpu/a"])  # again: nothing new; the same runs not named

    # A run the other machine ran again at new settings: --theirs takes its record, in place.
    assert here.merge(there, take=["cpu/a"]) == (["cpu/a"], [])
    runs = [r for r in here.read() if r["id"] == "a"]
    assert len(runs) == 1 and runs[0]["test_ppl"] == 150.0
    with pytest.raises(ValueError, match="has no run cpu/zz"):
        here.merge(there, take=["cpu/zz"])


def test_bench_merge_takes_a_gpu_sessions_runs_and_rebuilds_the_report(tmp_path, monkeypatch):
    """Two machines run the same bench (the second with --backend stacked); merged, the report
    counts the runs of both, and bad input is one error line that changes nothing."""
    import fedkey_bench.paper.runner as paper

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        lr = {"0-3": 420.0, "1": 380.0, "3": 400.0}[spec.id.split("lr-")[1].rsplit("-c", 1)[0]]
        done = _finished(spec, preset, data_root, runs_dir)
        return {**done, **spec.fields(), "best_val_ppl": lr, "test_ppl": lr - 10}

    _smoke_data(tmp_path, monkeypatch, fake_run)
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)  # its own tests draw it
    here, there = tmp_path / "here", tmp_path / "there"
    lrs = ["sweep-ptb-fedavg-client-lr-0-3-c0.1", "sweep-ptb-fedavg-client-lr-1-c0.1",
           "sweep-ptb-fedavg-client-lr-3-c0.1"]  # fmt: skip
    paper.run_bench("cpu", ["sweep"], tmp_path, here, tmp_path / "runs", only=lrs[:1])
    paper.run_bench("cpu", ["sweep"], tmp_path, there, tmp_path / "gpu-runs", only=lrs[1:],
                    backend="stacked")  # fmt: skip
    before = (here / "cpu" / "results.json").read_text()

    for bad, why in [(tmp_path / "none.json", "no such file"), (tmp_path, "no such file")]:
        res = CliRunner().invoke(app, ["merge", str(bad), "--into", str(here / "cpu")])
        assert res.exit_code == 1 and why in res.stderr and len(res.stderr.splitlines()) == 1
    for odd in ['{"runs": [', '{"runs": [{"preset": "cpu"}]}', '{"runs": 3}', "[]",
                '{"runs": [], "begun": {"cpu/x": "round 3"}}']:  # fmt: skip
        (tmp_path / "odd.json").write_text(odd)  # a copy cut short, a run without its id, ...
        res = CliRunner().invoke(app, ["merge", str(tmp_path / "odd.json"), "--into",
                                       str(here / "cpu")])  # fmt: skip
        assert res.exit_code == 1 and "not a bench's results.json" in res.stderr, (odd, res)
        assert len(res.stderr.splitlines()) == 1
    assert (here / "cpu" / "results.json").read_text() == before

    res = CliRunner().invoke(app, ["merge", str(there / "cpu" / "results.json"),
                                   "--into", str(here / "cpu")])  # fmt: skip
    assert res.exit_code == 0 and "took 2 runs" in res.output, res.output
    runs = Bench(here / "cpu").read()
    assert sorted(r["id"] for r in runs) == sorted(lrs)
    assert Bench(here / "cpu").lr_choices()["cpu"]["ptb"]["client_lr"] == 1.0
    assert paper.superseded(PRESETS["cpu"], runs) == []  # the stacked runs are the preset's
