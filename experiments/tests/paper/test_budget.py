"""`fedkey-bench paper --hours H`: a bench with a time limit judges each run's length by the pace
of the runs it has done, starts only those that end in time, and lists the rest."""

import json
import shlex

import pytest

import fedkey_bench.paper.runner as paper
from fedkey_bench.common.runs import Stopped, device_label
from fedkey_bench.paper.budget import Pace, passes

# The tests that run a bench use the fixed `table` suite (conftest.py: table_runs).
pytestmark = pytest.mark.usefixtures("table_suite")


def _cmd(verb: str, *flags: str, data: str = "/d/ptb") -> str:
    return shlex.join(["fedkey", verb, "--data", data, *flags, "--out", "/r/x"])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--rounds", "50", "--local-epochs", "1", "--fraction", "0.1"), 5.0),
        (("--rounds", "50", "--local-epochs", "5", "--fraction", "0.5"), 125.0),
        # FedSGD takes every phone whatever --fraction says; AdaFL's fraction climbs 0.1 -> 0.5
        (("--rounds", "50", "-E", "1", "--fraction", "0.1", "--strategy", "fedsgd"), 50.0),
        (("--rounds", "50", "--local-epochs", "1", "--strategy", "fedavg", "--adafl"), 15.0),
        (("--rounds", "50", "--fraction", "0.1"), 25.0),  # the CLI's default E: the papers' 5
    ],
)
def test_a_federated_run_passes_over_the_training_text_rounds_times_c_times_e(flags, expected):
    assert passes(_cmd("simulate", *flags)) == pytest.approx(expected)


def test_centralized_and_ngram_runs_count_their_epochs_and_one_pass():
    assert passes(_cmd("train-central", "--epochs", "5")) == 5.0
    assert passes(_cmd("ngram", "--order", "3")) == 1.0


def _finished(dataset: str, cmd: str, wall: float, **extra) -> dict:
    return {"id": f"done-{wall}", "dataset": dataset, "command": cmd, "wall_seconds": wall,
            **extra}  # fmt: skip


@pytest.fixture
def data_root(tmp_path):
    for name, size in (("ptb", 1000), ("wikitext-2", 2000)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.txt").write_text("x" * size)
    return tmp_path


def test_a_run_is_judged_by_the_pace_of_those_done_scaled_to_its_work_and_its_text(data_root):
    ptb = str(data_root / "ptb")
    one_pass = _cmd("simulate", "--rounds", "10", "--fraction", "0.1", data=ptb)
    pace = Pace([_finished("ptb", one_pass, 600.0),
                 # resumed: 100 s after 900 s of earlier attempts; 10 s after attempts not timed
                 _finished("ptb", one_pass, 100.0, resumed=True, earlier_seconds=900.0),
                 _finished("ptb", one_pass, 10.0, resumed=True)],
                data_root)  # fmt: skip
    five = _cmd("simulate", "--rounds", "50", "--fraction", "0.1", data=ptb)
    assert pace.seconds("ptb", five) == pytest.approx(5 * 800.0)  # the median of 600 and 1,000
    # WikiText-2 has no run yet: PTB's pace, for twice the text
    wiki = _cmd(
        "simulate", "--rounds", "50", "--fraction", "0.1", data=str(data_root / "wikitext-2")
    )
    assert pace.seconds("wikitext-2", wiki) == pytest.approx(2 * 5 * 800.0)
    # a GPU's runs say nothing of this machine's pace
    assert Pace([_finished("ptb", one_pass, 600.0, device="cuda (NVIDIA H200)")], data_root,
                device="cpu (AMD EPYC, 2 cores)").seconds("ptb", five) is None  # fmt: skip
    # nothing to judge by: another verb, or the demo corpus, whose start-up costs outweigh its text
    assert pace.seconds("ptb", _cmd("train-central", "--epochs", "5", data=ptb)) is None
    assert pace.seconds("demo", _cmd("simulate", "--rounds", "10", data="demo")) is None


def test_evaluation_is_charged_per_round_where_the_runs_split_their_time(data_root):
    """A C 0.1 run of 10 rounds: one pass of training (650 s of its rounds' own seconds) and 10
    evaluations (350 s). FedSGD's 50 rounds are 50 passes but 50 evaluations, not 500; a run
    from before `train_seconds` keeps the one rate per pass for everything it judges."""
    ptb = str(data_root / "ptb")
    one_pass = _cmd("simulate", "--rounds", "10", "--fraction", "0.1", "-E", "1", data=ptb)
    fedsgd = _cmd("simulate", "--rounds", "50", "--strategy", "fedsgd", "--local-epochs", "1",
                  data=ptb)  # fmt: skip
    split = Pace([_finished("ptb", one_pass, 1000.0, train_seconds=650.0)], data_root)
    assert split.seconds("ptb", fedsgd) == pytest.approx(50 * 650.0 + 50 * 35.0)
    assert split.step_seconds("ptb", fedsgd) == pytest.approx(650.0 + 35.0)
    assert split.seconds("ptb", one_pass) == pytest.approx(1000.0)  # the same run: the same
    older = Pace([_finished("ptb", one_pass, 1000.0, train_seconds=650.0),
                  _finished("ptb", one_pass, 1000.0)], data_root)  # fmt: skip
    assert older.seconds("ptb", fedsgd) == pytest.approx(50 * 1000.0)
    # WikiText-2 judged by PTB's split, scaled to twice the text
    wiki = fedsgd.replace(ptb, str(data_root / "wikitext-2"))
    assert split.seconds("wikitext-2", wiki) == pytest.approx(2 * (50 * 650.0 + 50 * 35.0))


def test_a_cpu_run_counts_by_its_cpu_time_so_a_crowded_machine_misjudges_nothing(data_root):
    """The same one-pass run done twice: alone (600 s wall, 590 s CPU) and beside three others on
    2 cores (1,200 s wall, 600 s CPU). Judged by CPU time, a run takes about 600 s with a core of
    its own, and twice that when the bench runs two per core; a run that did not record its CPU
    time, and a GPU's, count by their wall time."""
    ptb = str(data_root / "ptb")
    one_pass = _cmd("simulate", "--rounds", "10", "--fraction", "0.1", data=ptb)
    cpu = "cpu (AMD EPYC, 2 cores)"
    runs = [_finished("ptb", one_pass, 600.0, cpu_seconds=590.0, device=cpu),
            _finished("ptb", one_pass, 1200.0, cpu_seconds=600.0, device=cpu),
            _finished("ptb", one_pass, 1200.0, device=cpu)]  # fmt: skip
    assert Pace(runs, data_root, cpu).seconds("ptb", one_pass) == pytest.approx(600.0)
    assert Pace(runs, data_root, cpu, crowd=2.0).seconds("ptb", one_pass) == pytest.approx(1200.0)
    assert Pace(runs, data_root, cpu, crowd=0.5).seconds("ptb", one_pass) == pytest.approx(600.0)
    # the split of a run's time into training and evaluation keeps its shares of the CPU time
    split = Pace([_finished("ptb", one_pass, 2000.0, train_seconds=1300.0, cpu_seconds=1000.0,
                            device=cpu)], data_root, cpu)  # fmt: skip
    assert split.step_seconds("ptb", one_pass) == pytest.approx(100.0)  # 65 + 35 a round
    gpu = "cuda (NVIDIA H200)"
    on_gpu = [_finished("ptb", one_pass, 600.0, cpu_seconds=300.0, device=gpu)]
    assert Pace(on_gpu, data_root, gpu).seconds("ptb", one_pass) == pytest.approx(600.0)


def test_the_latest_runs_set_the_pace_so_a_faster_trainer_shows_at_once(data_root):
    ptb = str(data_root / "ptb")
    one_pass = _cmd("simulate", "--rounds", "10", "--fraction", "0.1", data=ptb)
    walls = [900.0, 900.0, 900.0, 900.0, 600.0, 600.0]  # in the order they finished
    pace = Pace([_finished("ptb", one_pass, w) for w in walls], data_root)
    assert pace.seconds("ptb", one_pass) == pytest.approx(600.0)  # not the median of all, 900


def test_an_interrupted_run_that_can_resume_counts_only_its_rounds_still_to_do(data_root, tmp_path):
    ptb = str(data_root / "ptb")
    pace = Pace([_finished("ptb", _cmd("simulate", "--rounds", "10", "--fraction", "0.1",
                                       data=ptb), 600.0)], data_root)  # fmt: skip
    cmd = _cmd("simulate", "--rounds", "50", "--fraction", "0.1", data=ptb)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "command.txt").write_text(cmd + "\n")
    (run_dir / "checkpoints" / "round_20.safetensors").write_bytes(b"")
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"round": r}) + "\n" for r in range(21))
    )
    assert pace.seconds("ptb", cmd, run_dir) == pytest.approx(3000.0 * 30 / 50)
    # another command left that folder: it starts again, all of it to do
    (run_dir / "command.txt").write_text(cmd.replace("--rounds 50", "--rounds 40") + "\n")
    assert pace.seconds("ptb", cmd, run_dir) == pytest.approx(3000.0)


def _timing(preset, data_root) -> dict:
    """A finished FedAvg run at C 0.1 that took half an hour: the pace of the others."""
    return {"id": "timing", "suite": "table", "preset": preset.name, "dataset": "ptb",
            "wall_seconds": 1800.0, "device": device_label(), "command": shlex.join(paper.command(
                paper.RunSpec("table", "ptb", "FedAvg", 0.1), preset, data_root,
                data_root / "runs" / "timing"))}  # fmt: skip


def test_with_hours_the_bench_starts_the_runs_that_fit_and_lists_the_rest(
    data_root, monkeypatch, capsys
):
    """The smoke preset's table suite on PTB, one of whose runs at C 0.1 took half an hour: in
    1.5 hours the C 0.1 runs (0.5 h each) and AdaFL (1 h: its C averages 0.2 over 2 rounds) start,
    in their order; C 0.5 (2.5 h) and FedSGD (5 h) are listed, not started (nor advanced: the
    next test)."""
    preset = paper.PRESETS["smoke"]
    out = data_root / "out"
    paper.Bench(out / preset.results_folder).add(_timing(preset, data_root), "")
    started: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        started.append(spec.id)
        cmd = shlex.join(paper.command(spec, preset, data_root, runs_dir / spec.id))
        return {"id": spec.id, "suite": spec.suite, "preset": preset.name, "command": cmd,
                "dataset": spec.dataset, "test_ppl": 1.0, "best_round": 1,
                "wall_seconds": 0.0}  # fmt: skip

    monkeypatch.setattr(paper, "run_one", fake_run)
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)
    paper.run_bench("smoke", ["table"], data_root, out, data_root / "runs",
                    only=["table-ptb-*"], jobs=2, hours=1.5, advance=False)  # fmt: skip
    specs = [s.id for s in paper.select(preset, ["table"], [], only=["table-ptb-*"])]
    short = [i for i in specs if i.endswith("c0.1") or "adafl" in i]
    assert started == short  # in the bench's own order
    printed = capsys.readouterr().out
    left = [i for i in specs if i not in short]
    assert left and f"{len(left)} runs left" in printed
    assert all(i in printed for i in left) and not any(f"  {i} " in printed for i in short)
    assert "table-ptb-fedsgd-c1 (about 5.0 h to run)" in printed
    assert "table-ptb-fedavg-c0.5 (about 2.5 h to run)" in printed


class Clock:
    """time.monotonic for fedkey_bench.paper.runner: a run stopped at the limit moves it there."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def run_until_stopped(self, stop, run_id: str, rounds: int):
        """A fake run going on, a minute at a time, until the bench stops it (100 min at most)."""
        for _ in range(100):
            if stop():
                raise Stopped(run_id, rounds)
            self.now += 60.0
        raise AssertionError("the run was never stopped")


def test_when_no_run_fits_the_free_slots_advance_the_runs_that_resume(
    data_root, monkeypatch, capsys
):
    """The same runs with 0.4 h left: no run fits (C 0.1: 0.5 h), but a round of one does
    (0.25 h of 2), so both slots start C 0.1 runs to stop at the limit, the one an earlier bench
    began first, and the next bench continues them; C 0.5 (1.25 h a round) waits."""
    preset = paper.PRESETS["smoke"]
    out, runs = data_root / "out", data_root / "runs"
    paper.Bench(out / preset.results_folder).add(_timing(preset, data_root), "")
    specs = [s for s in paper.select(preset, ["table"], [], only=["table-ptb-*"])]
    tenth = [s for s in specs if s.id.endswith("c0.1") and "adafl" not in s.id]
    begun = tenth[2]  # an earlier bench stopped it in its first round
    begun_dir = runs / preset.results_folder / begun.id
    (begun_dir / "checkpoints").mkdir(parents=True)
    (begun_dir / "checkpoints" / "round_0000.safetensors").write_bytes(b"")
    (begun_dir / "metrics.jsonl").write_text('{"round": 0}\n')
    (begun_dir / "command.txt").write_text(
        shlex.join(paper.command(begun, preset, data_root, begun_dir)) + "\n"
    )
    clock = Clock()
    monkeypatch.setattr(paper, "time", clock)
    calls: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        calls.append(spec.id)
        clock.run_until_stopped(stop, spec.id, 1)

    monkeypatch.setattr(paper, "run_one", fake_run)
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)
    paper.run_bench("smoke", ["table"], data_root, out, runs, only=["table-ptb-*"], jobs=2,
                    hours=0.4)  # fmt: skip
    assert calls == [begun.id, tenth[0].id]
    assert 1000.0 + 0.4 * 3600 <= clock.now <= 1000.0 + 0.4 * 3600 + 120  # stopped at the limit
    printed = capsys.readouterr().out
    assert f"{begun.id} (about 30 min to run, stopped after round 1: the next bench" in printed
    assert f"{tenth[0].id} (about 30 min to run, stopped after round 1" in printed
    assert "table-ptb-fedavg-c0.5 (about 2.5 h to run)" in printed
    results = paper.Bench(out / preset.results_folder)
    assert [r["id"] for r in results.read()] == ["timing"]
    assert results.begun() == {f"smoke/{begun.id}": [1, 2], f"smoke/{tenth[0].id}": [1, 2]}

    calls.clear()  # --no-advance: the slots stay free
    paper.run_bench("smoke", ["table"], data_root, out, runs, only=["table-ptb-*"], jobs=2,
                    hours=0.4, advance=False)  # fmt: skip
    assert calls == []


def test_a_dry_run_adds_up_the_runs_not_done(data_root, capsys):
    preset = paper.PRESETS["smoke"]
    out = data_root / "out"
    fedavg = next(s for s in paper.select(preset, ["table"], []) if s.id == "table-ptb-fedavg-c0.1")
    took = {"id": fedavg.id, "suite": "table", "preset": "smoke", "dataset": "ptb",
            "wall_seconds": 1800.0, "device": device_label(), "command": shlex.join(paper.command(
                fedavg, preset, data_root, data_root / "runs" / "smoke" / fedavg.id))}  # fmt: skip
    paper.Bench(out / preset.results_folder).add(took, "")
    ids = [fedavg.id, "table-ptb-fedsgd-c1", "table-ptb-fedavg-c0.5"]
    paper.run_bench("smoke", ["table"], data_root, out, data_root / "runs", only=ids,
                    dry_run=True)  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert [line.split("--out ")[1].split()[0].rsplit("/", 1)[1] for line in printed[:3]] == [
        "table-ptb-fedsgd-c1",
        fedavg.id,
        "table-ptb-fedavg-c0.5",
    ]  # every command line, the done one too
    # FedSGD 5 h (every phone) and C 0.5 2.5 h, at the pace of the C 0.1 run done in 0.5 h
    assert printed[3].startswith("# 2 of them not done: about 7.5 h of run time")
    assert "do not set it" not in printed[3]

    # The same run done on another machine's device (a lent GPU) sets no pace here, and says so.
    paper.Bench(out / preset.results_folder).add({**took, "device": "cuda (NVIDIA H200)"}, "")
    paper.run_bench("smoke", ["table"], data_root, out, data_root / "runs", only=ids,
                    dry_run=True)  # fmt: skip
    last = capsys.readouterr().out.splitlines()[3]
    assert last.startswith("# 2 of them not done: no run time to tell: no run done judges them; "
                           "the pace is this machine's (")  # fmt: skip
    assert "), and runs done on cuda (NVIDIA H200) do not set it; the ranking" in last


def test_a_run_that_cannot_resume_is_not_noted_as_begun(data_root, monkeypatch, capsys):
    """An n-gram stopped at the limit keeps nothing: results.md must not call it begun, and the
    next bench starts it again."""
    clock = Clock()
    monkeypatch.setattr(paper, "time", clock)

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        clock.run_until_stopped(stop, spec.id, 0)

    monkeypatch.setattr(paper, "run_one", fake_run)
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)
    ngram = "rank-ptb-kneser-ney-3-gram-auto"
    paper.run_bench("smoke", ["sweep", "rank"], data_root, data_root / "out", data_root / "runs",
                    only=[ngram], hours=0.5)  # fmt: skip
    printed = capsys.readouterr().out
    assert f"{ngram}: stopped at the time limit; the next bench starts it again" in printed
    assert f"  {ngram} (about ? to run)" in printed
    assert paper.Bench(data_root / "out" / "smoke").begun() == {}


def test_a_run_stopped_at_the_limit_is_noted_with_its_best_validation_so_far(
    data_root, monkeypatch
):
    """A run that outlasts the time (a lent GPU's lease) is noted begun with its rounds and its
    best validation perplexity so far (the initial model's round 0 aside), which results.md
    shows until the next bench finishes it."""
    clock = Clock()
    monkeypatch.setattr(paper, "time", clock)
    run_id = "table-ptb-fedavg-c0.1"

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        rows = [{"round": 0, "val_ppl": 9000.0}, {"round": 1, "val_ppl": 450.5}]
        (runs_dir / spec.id).mkdir(parents=True)
        (runs_dir / spec.id / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
        clock.run_until_stopped(stop, spec.id, 1)

    monkeypatch.setattr(paper, "run_one", fake_run)
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)
    paper.run_bench("smoke", ["table"], data_root, data_root / "out", data_root / "runs",
                    only=[run_id], hours=0.5)  # fmt: skip
    assert paper.Bench(data_root / "out" / "smoke").begun() == {f"smoke/{run_id}": [1, 2, 450.5, 1]}


def test_a_run_noted_begun_whose_checkpoints_are_not_here_is_said_to_start_again(
    data_root, monkeypatch, capsys
):
    """results.json travels with the repository, a run's folder does not: on a new machine a run
    noted as begun starts again from its first round, and the bench says so instead of letting
    results.md's "begun: round 36 of 50" suggest that it continues."""
    clock = Clock()
    monkeypatch.setattr(paper, "time", clock)
    monkeypatch.setattr(paper, "run_one", lambda spec, p, d, r, stop=None: clock.run_until_stopped(
        stop, spec.id, 1))  # fmt: skip
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)
    preset, out, runs = paper.PRESETS["smoke"], data_root / "out", data_root / "runs"
    here, gone = "table-ptb-fedavg-c0.1", "table-ptb-fedatt-c0.1"
    for run_id in (here, gone):
        paper.Bench(out / preset.results_folder).stopped("smoke", run_id, 1, 2, [450.5, 1])
    spec = next(s for s in paper.select(preset, ["table"], []) if s.id == here)
    folder = runs / preset.results_folder / here
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "round_0001.safetensors").write_bytes(b"")
    (folder / "command.txt").write_text(shlex.join(paper.command(spec, preset, data_root, folder)))
    paper.run_bench("smoke", ["table"], data_root, out, runs, only=[here, gone], jobs=2,
                    hours=0.5)  # fmt: skip
    printed = capsys.readouterr().out
    assert (f"1 runs noted as begun have no checkpoint under {runs / 'smoke'} (a run's folder "
            f"stays on the machine that ran it): they start again from their first round: "
            f"{gone}\n") in printed  # fmt: skip


def test_a_run_left_whose_twin_is_left_too_is_listed_as_recorded_from_it(
    data_root, monkeypatch, capsys
):
    """The cpu preset's confirm row at the sweep's lr is its rank run: when the limit stops the
    rank run, the list of runs left names the confirm row as the same run, not as hours more."""
    clock = Clock()
    monkeypatch.setattr(paper, "time", clock)
    ran: list[str] = []

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        ran.append(spec.id)
        if spec.suite == "sweep":  # the sweep chooses FedAvg's client lr 3
            cmd = shlex.join(paper.command(spec, preset, data_root, runs_dir / spec.id))
            val = 200.0 if spec.lr == 3 else 300.0
            return {"id": spec.id, **spec.fields(), "preset": preset.name, "command": cmd,
                    "best_val_ppl": val, "test_ppl": val, "best_round": 1,
                    "wall_seconds": 0.0}  # fmt: skip
        clock.run_until_stopped(stop, spec.id, 1)

    monkeypatch.setattr(paper, "run_one", fake_run)
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)
    args = ("cpu", ["sweep", "rank", "confirm"], data_root, data_root / "out", data_root / "runs")
    paper.run_bench(*args, only=["sweep-ptb-fedavg-client-lr-*"], jobs=2)
    ran.clear()
    capsys.readouterr()
    paper.run_bench(*args, only=["rank-ptb-fedavg-c0.1", "confirm-ptb-fedavg-c0.1"], jobs=2,
                    hours=0.1)  # fmt: skip
    assert ran == ["rank-ptb-fedavg-c0.1"]
    printed = capsys.readouterr().out
    assert "2 runs left for want of time" in printed
    assert "  rank-ptb-fedavg-c0.1 (about ? to run, stopped after round 1" in printed
    assert "  confirm-ptb-fedavg-c0.1 (the same run as rank-ptb-fedavg-c0.1: recorded from it)" in (
        printed
    )


def test_a_run_past_its_last_round_at_the_limit_is_let_end_and_recorded(data_root, monkeypatch):
    """A run whose metrics hold its last round when the time is up has only its results to write
    (seconds): stopped there, its every round would be lost with a lent GPU's folder. It is let
    end and recorded done, not noted begun; a run short of its last round still stops."""
    clock = Clock()
    monkeypatch.setattr(paper, "time", clock)
    last, short = "table-ptb-fedavg-c0.1", "table-ptb-fedatt-c0.1"

    def fake_run(spec, preset, data_root, runs_dir, stop=None):
        rounds = preset.rounds if spec.id == last else preset.rounds - 1
        (runs_dir / spec.id).mkdir(parents=True)
        (runs_dir / spec.id / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"round": r, "val_ppl": 500.0 - r}) + "\n" for r in range(rounds + 1)
            )
        )
        clock.now += 3600.0  # past the limit
        if stop():
            raise Stopped(spec.id, rounds)
        cmd = shlex.join(paper.command(spec, preset, data_root, runs_dir / spec.id))
        return {"id": spec.id, "preset": preset.name, "suite": "table", "test_ppl": 480.0,
                "best_round": rounds, "wall_seconds": 3600.0, "command": cmd}  # fmt: skip

    monkeypatch.setattr(paper, "run_one", fake_run)
    monkeypatch.setattr(paper, "write_fresh", lambda folder: None)
    paper.run_bench("smoke", ["table"], data_root, data_root / "out", data_root / "runs",
                    only=[last, short], jobs=2, hours=0.5)  # fmt: skip
    results = paper.Bench(data_root / "out" / "smoke")
    assert [r["id"] for r in results.read()] == [last]
    assert list(results.begun()) == [f"smoke/{short}"]
