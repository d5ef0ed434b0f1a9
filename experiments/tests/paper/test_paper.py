"""`fedkey-bench paper`: every command of the code suite (the seed papers' measure) is a valid
fedkey command, its runs are judged by the seed papers' measure, a run's summary, the bench's
jobs, failures and interruptions, and a smoke run goes end to end and resumes."""

import json
import shlex
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey_bench.cli import app as bench_app
from fedkey_bench.common.runs import Stopped
from fedkey_bench.paper.runner import (
    PRESETS,
    SEEDS,
    Bench,
    RunSpec,
    command,
    seed_number,
    suite_runs,
    summarize,
)
from fedkey_bench.paper.tables import code_table

runner = CliRunner()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_run_of_every_suite_is_a_command_the_cli_accepts(preset):
    group = typer.main.get_command(app)
    suites = [s for s in PRESETS[preset].suites if s == "code"]
    specs = [s for suite in suites for s in suite_runs(suite, PRESETS[preset])]
    assert len({s.id for s in specs}) == len(specs)  # ids name the run folders
    for spec in specs:
        words = command(spec, PRESETS[preset], Path("data"), Path("runs") / spec.id)
        assert words[0] == "fedkey"
        sub = group.get_command(None, words[1])
        sub.make_context(words[1], words[2:])  # raises on an unknown flag or a bad value
        if spec.kind == "federated":
            assert "--paper-protocol" in words and words[words.index("--clients") + 1] == "100"


def test_gpu_preset_is_the_seeds_protocol():
    spec = RunSpec("rank", "ptb", "FedAvg", 0.1, ("--strategy", "fedavg"))
    words = command(spec, PRESETS["gpu"], Path("d"), Path("o"))

    def flag(name):
        return words[words.index(name) + 1]

    assert words[1] == "simulate"  # resumable; the HTTP path's weights bit for bit
    # a round's phones as one stacked model, one process a run (CUDA graphs on a GPU)
    assert flag("--backend") == "stacked" and "--workers" not in words
    assert flag("--rounds") == "50" and flag("--local-epochs") == "5"
    assert flag("--lr") == "0.01" and flag("--momentum") == "0.5"
    assert "--max-train-tokens" not in words and "--max-eval-sentences" not in words
    # a run still going keeps its latest 2 rounds' checkpoints and its best: a GPU machine's
    # disk holds 8 runs at once; the cpu preset's commands stay as its done runs ran them
    assert flag("--keep-checkpoints") == "2"
    assert "--keep-checkpoints" not in command(spec, PRESETS["cpu"], Path("d"), Path("o"))


def _run(dataset, method, fraction, ppls, suite="rank", kind="federated"):
    rows = [
        {
            "round": i,
            "val_ppl": p + 1,
            "test_ppl": p,
            "bytes_up": 10,
            "bytes_down": 20,
            "aggregated": ["a"] * (i > 0),
        }  # fmt: skip
        for i, p in enumerate(ppls)
    ]
    spec = RunSpec(suite, dataset, method, fraction, kind=kind)
    return {
        "id": spec.id,
        **summarize(rows, spec),
        "wall_seconds": 1.0,
        "command": "fedkey simulate ...",
        "git_commit": "abc",
        "git_dirty": False,
        "device": "cpu",
        "preset": "cpu",
        "seed_ppl": None,
    }


def test_summary_takes_the_best_validation_round_and_counts_rounds_to_90():
    r = _run("wikitext-2", "FedAvg", 0.1, [1000, 95, 85, 88])
    assert (r["test_ppl"], r["best_round"], r["final_test_ppl"]) == (85, 2, 88)
    assert r["rounds_to_ppl_90"] == 2
    assert (r["uplink_bytes"], r["downlink_bytes"], r["updates"]) == (40, 80, 3)


@pytest.mark.slow
@pytest.mark.needs_data
def test_smoke_bench_runs_end_to_end_and_resumes(tmp_path, data_dir):
    fedavg_id, ngram_id = "sweep-ptb-fedavg-client-lr-1-c0.1", "rank-ptb-kneser-ney-3-gram-auto"
    args = ["paper", "--preset", "smoke", "--suite", "sweep", "--suite", "rank",
            "--only", fedavg_id, "--only", ngram_id,
            "--data-root", str(data_dir), "--out", str(tmp_path / "results"),
            "--runs-dir", str(tmp_path / "runs"), "--jobs", "2"]  # fmt: skip
    result = runner.invoke(bench_app, args)
    assert result.exit_code == 0, result.output
    out = tmp_path / "results" / "smoke"
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert {r["id"] for r in runs} == {fedavg_id, ngram_id}
    fedavg = next(r for r in runs if r["id"] == fedavg_id)
    assert fedavg["git_commit"]
    assert fedavg["test_ppl"] < fedavg["curve"][0][2]  # better than the initial model
    assert shlex.split(fedavg["command"])[:2] == ["fedkey", "simulate"]
    assert "Kneser-Ney 3-gram" in (out / "results.md").read_text()
    assert (out / "curves_smoke_sweep_ptb.png").stat().st_size > 1000
    again = runner.invoke(bench_app, args)  # everything is in results.json already: nothing runs
    assert again.exit_code == 0 and "test ppl" not in again.output
    # of its checkpoints the finished run keeps its best round's and its last
    kept = sorted(
        p.name for p in (tmp_path / "runs" / "smoke" / fedavg["id"] / "checkpoints").iterdir()
    )
    assert kept == sorted(
        {f"round_{r:04d}.safetensors" for r in (fedavg["best_round"], fedavg["rounds"])}
    )


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_code_suite_runs_the_seeds_code_whatever_the_preset(preset):
    specs = suite_runs("code", PRESETS[preset])
    assert {(s.dataset, s.method, s.fraction) for s in specs} == {
        (ds, m, c)
        for ds in ("ptb", "wikitext-2")
        for m, c in (("FedAvg", 0.1), ("FedAtt", 0.1), ("FedAtt, epsilon 1, spectral norm", 0.1),
                     ("position-only unigram", None))
    }  # fmt: skip
    group = typer.main.get_command(app)
    for spec in specs:
        words = command(spec, PRESETS[preset], Path("d"), Path("o"))
        sub = group.get_command(None, words[1])
        params = sub.make_context(words[1], words[2:]).params  # the last of a repeated flag wins
        assert params["vocab_size"] == 50000 and params["max_train_tokens"] is None
        assert params["max_eval_sentences"] is None
        if spec.kind == "ngram":
            assert params["positional"]
            continue
        assert (params["rounds"], params["local_epochs"], params["lr"]) == (50, 5, 0.01)
        assert (params["clip"], params["batching"]) == (0, "columns")
        if "spectral" in spec.method:  # their code's FedAtt defaults, held against their FedAtt
            assert (params["epsilon"], params["norm"]) == (1.0, "spectral")
            seeds = seed_number(spec.suite, spec.dataset, spec.method, spec.fraction)
            assert seeds == SEEDS[("FedAtt", 0.1)][spec.dataset]


def test_code_runs_are_judged_by_the_seeds_measure():
    rows = [
        {"round": i, "val_ppl": v, "test_ppl": v - 1, "col_val_ppl": c, "col_test_ppl": c - 1}
        for i, (v, c) in enumerate([(1000, 900), (300, 200), (250, 210)])
    ]
    spec = suite_runs("code", PRESETS["cpu"])[0]
    summary = summarize(rows, spec)
    assert (summary["best_round"], summary["col_test_ppl"], summary["test_ppl"]) == (1, 199, 299)
    assert summary["col_curve"][1] == [1, 200, 199]
    run = {**summary, "seed_ppl": 138.13}
    line = code_table([run]).splitlines()[-1]
    assert line == "| PTB | 0.1 | FedAvg | 199.00 | 138.13 | +44% | 299.00 | 1 |"
    pos_spec = next(s for s in suite_runs("code", PRESETS["cpu"]) if s.kind == "ngram")
    pos = {**summarize([{**rows[0], "val_ppl": 700, "test_ppl": 650, "col_val_ppl": 130,
                         "col_test_ppl": 120}], pos_spec), "seed_ppl": None}  # fmt: skip
    line = code_table([run, pos]).splitlines()[-1]
    assert line == "| PTB | - | position-only unigram | 120.00 | - | - | 650.00 | 0 |"
    plain = [{k: r[k] for k in ("round", "val_ppl", "test_ppl")} for r in rows]
    plain_summary = summarize(plain, spec)
    assert plain_summary["best_round"] == 2 and "col_test_ppl" not in plain_summary


def _finished(spec, preset, data_root, runs_dir) -> dict:
    """What run_one returns for a run that ended (numbers that mean nothing)."""
    cmd = shlex.join(command(spec, preset, data_root, runs_dir / spec.id))
    return {"id": spec.id, "suite": spec.suite, "preset": preset.name, "command": cmd,
            "test_ppl": 1.0, "best_round": 1, "wall_seconds": 0.0}  # fmt: skip


def _smoke_data(tmp_path, monkeypatch, fake_run) -> None:
    """run_bench on the smoke preset with `fake_run` for run_one, over empty dataset folders."""
    import fedkey_bench.paper.runner as paper

    monkeypatch.setattr(paper, "run_one", fake_run)
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)
    for ds in ("ptb", "wikitext-2"):
        (tmp_path / ds).mkdir()


@pytest.mark.usefixtures("table_suite")
def test_jobs_refill_a_finished_runs_slot_without_waiting_for_the_slowest(tmp_path, monkeypatch):
    """With --jobs 2, a slow run holds one slot while the other slot runs the rest in turn (a
    batch of two would wait for the slow one before starting the third)."""
    import threading

    import fedkey_bench.paper.runner as paper

    ids = ["table-ptb-fedavg-c0.1", "table-ptb-fedatt-c0.1", "table-ptb-fedmed-c0.1"]
    slow_may_finish = threading.Event()
    started: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        started.append(spec.id)
        if spec.id == ids[0]:
            assert slow_may_finish.wait(timeout=60), "the slow run was never released"
        elif spec.id == ids[2]:
            slow_may_finish.set()  # the third started while the first still ran
        return _finished(spec, preset, data_root, runs_dir)

    _smoke_data(tmp_path, monkeypatch, fake_run)
    paper.run_bench("smoke", ["table"], tmp_path, tmp_path / "out", tmp_path / "runs",
                    only=ids, jobs=2)  # fmt: skip
    assert started[:2] == ids[:2] and started[2] == ids[2] and len(started) == 3
    done = json.loads((tmp_path / "out" / "smoke" / "results.json").read_text())["runs"]
    assert sorted(r["id"] for r in done) == sorted(ids)


@pytest.mark.usefixtures("table_suite")
def test_finished_runs_keep_their_best_and_last_checkpoints_and_a_begun_one_all(
    tmp_path, monkeypatch
):
    """A run finished before the bench pruned at the end of a run is pruned when the bench next
    starts: its best and last rounds' files stay (the model the tables score, the end). A run
    not done keeps every file: it resumes from its last checkpoint."""
    import fedkey_bench.paper.runner as paper
    from fedkey_bench.paper.presets import PRESETS

    done_id, begun_id = "table-ptb-fedavg-c0.1", "table-ptb-fedatt-c0.1"
    _smoke_data(tmp_path, monkeypatch, lambda spec, *a, **k: _finished(spec, *a[:3]))
    runs = tmp_path / "runs"
    for run_id in (done_id, begun_id):
        folder = runs / "smoke" / run_id / "checkpoints"
        folder.mkdir(parents=True)
        for r in range(4):
            for kind in ("round", "server_opt"):
                (folder / f"{kind}_{r:04d}.safetensors").write_bytes(b"x" * 10)
        (folder / "notes.safetensors").write_bytes(b"not a round's")
    spec = next(s for s in paper.select(PRESETS["smoke"], ["table"], []) if s.id == done_id)
    finished = {**_finished(spec, PRESETS["smoke"], tmp_path, runs / "smoke"), "rounds": 3}
    paper.Bench(tmp_path / "out" / "smoke").add(finished, "fedkey-bench paper --preset smoke")
    paper.run_bench("smoke", ["table"], tmp_path, tmp_path / "out", runs,
                    only=[done_id, begun_id])  # fmt: skip
    names = {p.name for p in (runs / "smoke" / done_id / "checkpoints").iterdir()}
    assert names == {"round_0001.safetensors", "server_opt_0001.safetensors",
                     "round_0003.safetensors", "server_opt_0003.safetensors",
                     "notes.safetensors"}  # fmt: skip
    assert len(list((runs / "smoke" / begun_id / "checkpoints").iterdir())) == 9


@pytest.mark.usefixtures("table_suite")
def test_a_failed_run_does_not_stop_the_others_and_the_bench_says_which(tmp_path, monkeypatch):
    """A bench runs for days: one run that fails (a full disk, a bug) leaves the others going;
    the bench ends with an error naming it, and results.json holds the others."""
    import fedkey_bench.paper.runner as paper

    ids = ["table-ptb-fedavg-c0.1", "table-ptb-fedatt-c0.1", "table-ptb-fedmed-c0.1"]
    started: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        started.append(spec.id)
        if spec.id == ids[0]:
            raise RuntimeError(f"{spec.id}: `fedkey simulate ...` exited 1\nTraceback ...")
        return _finished(spec, preset, data_root, runs_dir)

    _smoke_data(tmp_path, monkeypatch, fake_run)
    with pytest.raises(RuntimeError, match="1 runs failed") as failure:
        paper.run_bench("smoke", ["table"], tmp_path, tmp_path / "out", tmp_path / "runs",
                        only=ids, jobs=1)  # fmt: skip
    assert f"{ids[0]}: `fedkey simulate ...` exited 1" in str(failure.value)
    assert sorted(started) == sorted(ids)  # each tried once
    done = json.loads((tmp_path / "out" / "smoke" / "results.json").read_text())["runs"]
    assert sorted(r["id"] for r in done) == sorted(ids[1:])


@pytest.mark.usefixtures("table_suite")
def test_a_report_that_cannot_be_written_is_one_error_and_results_json_keeps_the_runs(
    tmp_path, monkeypatch
):
    """The report is written by a fresh interpreter (the code on disk may have changed during a
    bench of hours); when it fails the bench ends with one line saying so and how to rebuild it,
    and every run is in results.json."""
    import fedkey_bench.paper.runner as paper

    ids = ["table-ptb-fedavg-c0.1", "table-ptb-fedatt-c0.1"]
    real_write_fresh = paper.write_fresh
    _smoke_data(tmp_path, monkeypatch, lambda spec, *a, **k: _finished(spec, *a[:3]))
    # the real write_fresh, with a report module that cannot be imported
    monkeypatch.setattr(paper, "write_fresh", real_write_fresh)
    monkeypatch.setattr(paper, "REPORT_MODULE", "fedkey_bench.no_such_report")
    with pytest.raises(RuntimeError) as failure:
        paper.run_bench("smoke", ["table"], tmp_path, tmp_path / "out", tmp_path / "runs",
                        only=ids)  # fmt: skip
    message = str(failure.value)
    assert message.startswith("results.md was not written (") and "\n" not in message
    assert "No module named fedkey_bench.no_such_report" in message
    assert f"python -m fedkey_bench.no_such_report {tmp_path / 'out' / 'smoke'}" in message
    done = json.loads((tmp_path / "out" / "smoke" / "results.json").read_text())["runs"]
    assert sorted(r["id"] for r in done) == sorted(ids)


@pytest.mark.usefixtures("table_suite")
def test_an_interrupted_bench_stops_the_runs_going_before_it_ends(tmp_path, monkeypatch):
    """Ctrl-C, or a kill (SIGTERM, which fedkey_bench.cli makes the same), while a run goes on in
    another slot: the bench stops it (its child is terminated, its checkpoints kept) before it
    ends, so no child goes on writing its folder with nobody to record it, and notes how far it
    got (the report's "begun" row)."""
    import fedkey_bench.paper.runner as paper

    ids = ["table-ptb-fedavg-c0.1", "table-ptb-fedatt-c0.1"]
    ended: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        if spec.id == ids[1]:  # the long run: goes on until the bench stops it
            for _ in range(3000):  # 30 s at most
                if stop():
                    ended.append(spec.id)
                    raise Stopped(spec.id, 3)
                time.sleep(0.01)
            raise AssertionError("the bench never stopped its run")
        return _finished(spec, preset, data_root, runs_dir)

    def interrupted(self, result, bench_command):
        raise KeyboardInterrupt  # Ctrl-C, as the first run's result comes in

    _smoke_data(tmp_path, monkeypatch, fake_run)
    monkeypatch.setattr(paper.Bench, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        paper.run_bench("smoke", ["table"], tmp_path, tmp_path / "out", tmp_path / "runs",
                        only=ids, jobs=2)  # fmt: skip
    assert ended == [ids[1]]  # stopped, and over, when run_bench returned
    # and noted as begun, with the rounds it did, as a run stopped at a time limit is
    begun = json.loads((tmp_path / "out" / "smoke" / "results.json").read_text())["begun"]
    assert begun[f"smoke/{ids[1]}"][0] == 3


def test_a_bench_continued_with_other_jobs_or_hours_is_recorded_as_one_command(tmp_path):
    """results.md lists the bench commands that produced it: the options that say how a bench
    ran (--jobs, --hours, --advance) would add a line per session."""
    bench = Bench(tmp_path)
    base = "fedkey-bench paper --preset cpu --suite sweep --suite rank"
    for i, how in enumerate(["", " --jobs 2 --hours 2.5", " --hours=0.45 --no-advance --jobs=2"]):
        bench.add({"id": f"run-{i}", "preset": "smoke", "suite": "rank"}, base + how)
    bench.add({"id": "other", "preset": "smoke", "suite": "rank"}, base + " --only 'rank-ptb-*'")
    assert bench.commands() == [base, base + " --only 'rank-ptb-*'"]


def test_a_run_whose_command_a_done_run_ran_but_for_out_is_recorded_from_it_not_run_again(
    tmp_path, monkeypatch
):
    """On the gpu preset the sweep's whole 50-round runs at C 0.1 are the ranking's runs at the
    values it chose: the rank run is recorded from the sweep's (its numbers under its own id,
    suite and command, `same_run_as` naming the run that ran), costs no run time in the report's
    sums or the bench's pace, and is not run again: a GPU's scarce hours go to runs not done."""
    import fedkey_bench.paper.runner as paper
    from fedkey_bench.common.runs import run_seconds, what_it_computes
    from fedkey_bench.paper.spec import command_flag

    best_val = {"0.01": 577.6, "0.1": 259.7, "1": 286.3}  # the first 50-round sweep on an H200
    ran: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        ran.append(spec.id)
        done = _finished(spec, preset, data_root, runs_dir)
        val = best_val[command_flag(done["command"], "--lr")]
        return {**done, **spec.fields(), "best_val_ppl": val, "test_ppl": val - 10,
                "wall_seconds": 1100.0}  # fmt: skip

    _smoke_data(tmp_path, monkeypatch, fake_run)
    args = ("gpu", ["sweep", "rank"], tmp_path, tmp_path / "out", tmp_path / "runs")
    only = ["sweep-ptb-fedavg-client-lr-*", "rank-ptb-fedavg-c0.1"]
    paper.run_bench(*args, only=only)
    sweep = ["sweep-ptb-fedavg-client-lr-0-01-c0.1", "sweep-ptb-fedavg-client-lr-0-1-c0.1",
             "sweep-ptb-fedavg-client-lr-1-c0.1"]  # fmt: skip
    assert sorted(ran) == sweep
    runs = {r["id"]: r for r in Bench(tmp_path / "out" / "gpu").read()}
    rank, twin = runs["rank-ptb-fedavg-c0.1"], runs[sweep[1]]
    assert rank["same_run_as"] == twin["id"] and "same_run_as" not in twin
    assert (rank["suite"], rank["method"], rank["fraction"]) == ("rank", "FedAvg", 0.1)
    assert (rank["test_ppl"], rank["best_val_ppl"]) == (twin["test_ppl"], twin["best_val_ppl"])
    assert rank["command"] != twin["command"] and rank["command"].endswith(
        "--out " + str(tmp_path / "runs" / "gpu" / "rank-ptb-fedavg-c0.1")
        + " --fraction 0.1 --strategy fedavg --bound off")  # fmt: skip
    assert what_it_computes(rank["command"]) == what_it_computes(twin["command"])
    assert run_seconds(rank) == 0.0 and run_seconds(twin) == 1100.0
    report = (tmp_path / "out" / "gpu" / "results.json").read_text()
    assert json.loads(report)["lr_choices"]["gpu"]["ptb"]["client_lr"] == 0.1

    paper.run_bench(*args, only=only)  # again: everything is done
    assert len(ran) == 3 and len(Bench(tmp_path / "out" / "gpu").read()) == 4


def test_two_runs_that_compute_the_same_never_run_at_once_and_one_is_recorded_from_the_other(
    tmp_path, monkeypatch
):
    """The confirm suite's row at the sweep's lr is the rank run under another id: with two free
    slots the bench runs it once (not an hour twice over on two cores), and records the other
    from it when it ends."""
    import fedkey_bench.paper.runner as paper

    ran: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        ran.append(spec.id)
        done = _finished(spec, preset, data_root, runs_dir)
        val = 200.0 if spec.lr == 3 else 300.0  # the sweep chooses lr 3, inside its grid
        return {**done, **spec.fields(), "best_val_ppl": val, "test_ppl": val - 10}

    _smoke_data(tmp_path, monkeypatch, fake_run)
    args = ("cpu", ["sweep", "rank", "confirm"], tmp_path, tmp_path / "out", tmp_path / "runs")
    paper.run_bench(*args, only=["sweep-ptb-fedavg-client-lr-*"], jobs=2)
    ran.clear()
    paper.run_bench(*args, only=["rank-ptb-fedavg-c0.1", "confirm-ptb-fedavg-c0.1"], jobs=2)
    assert ran == ["rank-ptb-fedavg-c0.1"]
    runs = {r["id"]: r for r in Bench(tmp_path / "out" / "cpu").read()}
    assert runs["confirm-ptb-fedavg-c0.1"]["same_run_as"] == "rank-ptb-fedavg-c0.1"


def test_runs_done_with_trainer_processes_stay_done_when_the_preset_stacks_the_phones(
    tmp_path, monkeypatch
):
    """The gpu preset's first runs went with 4 trainer processes a run (`--workers 4`); it now
    trains a round's phones as one stacked model (`--backend stacked`). Where a run ran is not
    what it computes: those runs stay done (not run again, not superseded), while a run whose
    computation differs (another lr) is run."""
    import fedkey_bench.paper.runner as paper
    from fedkey_bench.paper.spec import command_flag

    best_val = {"0.01": 577.6, "0.1": 259.7, "1": 286.3}  # the grid's middle: no run added
    ran: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        ran.append(spec.id)
        done = _finished(spec, preset, data_root, runs_dir)
        val = best_val.get(command_flag(done["command"], "--lr"), 900.0)
        return {**done, **spec.fields(), "best_val_ppl": val, "test_ppl": val - 10,
                "wall_seconds": 1100.0}  # fmt: skip

    _smoke_data(tmp_path, monkeypatch, fake_run)
    args = ("gpu", ["sweep"], tmp_path, tmp_path / "out", tmp_path / "runs")
    only = ["sweep-ptb-fedavg-client-lr-*"]
    paper.run_bench(*args, only=only)
    assert len(ran) == 3
    results = tmp_path / "out" / "gpu" / "results.json"
    data = json.loads(results.read_text())
    assert all("--backend stacked" in r["command"] for r in data["runs"])
    for r in data["runs"]:  # as the first GPU session ran them
        r["command"] = r["command"].replace("--backend stacked", "--workers 4")
    data["runs"][0]["command"] = data["runs"][0]["command"].replace("--lr ", "--lr 9")  # another lr
    results.write_text(json.dumps(data))

    paper.run_bench(*args, only=only)
    assert ran[3:] == [data["runs"][0]["id"]]  # only the run that computed something else
    runs = Bench(tmp_path / "out" / "gpu").read()
    assert paper.superseded(PRESETS["gpu"], runs) == []
    assert sum("--workers 4" in r["command"] for r in runs) == 2


def test_a_bench_may_train_a_presets_runs_on_another_backend(tmp_path, monkeypatch):
    """`fedkey-bench paper --preset cpu --backend stacked` (a GPU lent for a session takes the
    cpu preset's costliest runs): its simulate runs go with --backend stacked in place of the
    preset's --workers 0, the runs done on the CPU stay done, and results.json records the
    bench command once, whichever backend a session used."""
    import fedkey_bench.paper.runner as paper
    from fedkey_bench.paper.spec import command_flag

    best_val = {"0.3": 420.0, "1": 380.0, "3": 400.0}  # the grid's middle: no run added
    ran: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        done = _finished(spec, preset, data_root, runs_dir)
        ran.append(done["command"])
        val = best_val[command_flag(done["command"], "--lr")]
        return {**done, **spec.fields(), "best_val_ppl": val, "test_ppl": val - 10}

    _smoke_data(tmp_path, monkeypatch, fake_run)
    args = ("cpu", ["sweep"], tmp_path, tmp_path / "out", tmp_path / "runs")
    line = "fedkey-bench paper --preset cpu --suite sweep"
    cpu = ["sweep-ptb-fedavg-client-lr-0-3-c0.1", "sweep-ptb-fedavg-client-lr-1-c0.1"]
    paper.run_bench(*args, only=cpu, bench_command=line)
    assert len(ran) == 2 and all("--workers 0" in c for c in ran)

    paper.run_bench(*args, only=["sweep-ptb-fedavg-client-lr-*"], backend="stacked",
                    bench_command=line + " --backend stacked")  # fmt: skip
    assert len(ran) == 3  # only the run not done yet
    assert "--backend stacked" in ran[2] and "--workers" not in ran[2]
    assert command_flag(ran[2], "--lr") == "3"
    bench = Bench(tmp_path / "out" / "cpu")
    assert bench.commands() == [line]
    assert paper.superseded(PRESETS["cpu"], bench.read()) == []
    # the preset's own backend named: the preset as it is
    assert paper.placed(PRESETS["cpu"], "local") is PRESETS["cpu"]
