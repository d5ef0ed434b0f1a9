"""fedkey_bench.peers.runner without the peers' venvs: the cohorts every framework trains, the
rows, the repeats' medians and spread, the CPU seconds a round, the presets."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fedkey_bench.peers.runner import (
    TreeMonitor,
    Workload,
    check_cohorts,
    combine,
    cpu_at,
    cpu_per_round,
    cpu_seconds,
    error_row,
    fedkey_cohorts,
    fedkey_command,
    make_row,
    merge,
    preset,
    write_shards,
)
from tests.peers.helpers import DEMO, W, row

#: The fields every row of results.json carries (issue 67: "a benchmark nobody can argue with").
ROW_FIELDS = {"repeats", "seconds_per_round", "seconds_per_round_spread",
              "cpu_seconds_per_round", "precision", "cohort_seed", "final_test_ppl",
              "peak_rss_mb", "framework", "version", "workload", "device", "command"}  # fmt: skip


# -- the cohorts ---------------------------------------------------------------------------------


def test_the_cohorts_are_fedkeys_uniform_draw_from_seed_and_round():
    from fedkey.federation.strategies.selection import UniformSelector

    sizes = {f"device-{i:02d}": 10 + i for i in range(40)}
    w = Workload(clients=40, fraction=0.25, rounds=4, seed=3)
    got = fedkey_cohorts(w, sizes)
    ids = sorted(sizes)
    expected = [UniformSelector(0.25).select(r - 1, ids, np.random.default_rng([3, r]))
                for r in range(1, 5)]  # fmt: skip
    assert got == expected and all(len(c) == 10 for c in got)
    assert fedkey_cohorts(w, sizes) == got  # deterministic
    assert fedkey_cohorts(Workload(clients=40, fraction=0.25, rounds=4, seed=4), sizes) != got


def test_the_shards_carry_the_cohorts_and_fedkey_simulate_trains_them(tmp_path):
    # The list the peers get is the one `fedkey simulate` with the workload's flags selects:
    # fedkey runs here (2 rounds of the demo corpus), no peer does.
    w = Workload(**{**DEMO.__dict__, "rounds": 2})
    meta = write_shards(w, tmp_path / "s.npz")
    with np.load(tmp_path / "s.npz") as z:
        phones, seeds = z["cohorts"].tolist(), z["cohort_seeds"]
    assert phones == meta["cohort_phones"] and seeds.shape == (2, 6)
    assert [[f"device-{k:02d}" for k in c] for c in phones] == meta["cohorts"]
    assert meta["cohort_seed"] == w.seed and meta["cohort_size"] == 6

    env = {**os.environ, "FEDKEY_HIDDEN_SIZE": str(w.hidden_size), "OMP_NUM_THREADS": "1"}
    cmd = fedkey_command(Workload(**{**w.__dict__, "workers": 1}), tmp_path / "run")
    subprocess.run(cmd, check=True, env=env, capture_output=True, cwd=Path(__file__).parents[3])
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert check_cohorts(rows, meta["cohorts"]) is None
    assert [r["selected"] for r in rows[1:]] == meta["cohorts"]


def test_a_cohort_fedkey_did_not_train_fails_the_row_loudly():
    cohorts = [["device-1", "device-3"], ["device-0", "device-2"]]
    rows = [{"selected": []}, {"selected": ["device-1", "device-3"]},
            {"selected": ["device-0", "device-4"]}]  # fmt: skip
    why = check_cohorts(rows, cohorts)
    assert why is not None and why.startswith("COHORT MISMATCH: fedkey's round 2")
    assert "extra ['device-4'], missing ['device-2']" in why
    assert "ran 1 rounds" in str(check_cohorts(rows[:2], cohorts))
    assert check_cohorts(rows[:1] + [rows[1], {"selected": cohorts[1]}], cohorts) is None


# -- CPU seconds ---------------------------------------------------------------------------------


def test_cpu_seconds_are_interpolated_at_the_round_ends():
    # The tree busy on 2 cores from t = 10: 2 CPU s a second; before, 0.5 a second.
    samples = [(t / 2, (t / 2) * 0.5 if t <= 20 else 5 + (t / 2 - 10) * 2) for t in range(0, 81)]
    assert cpu_at(samples, 10.0) == pytest.approx(5.0)
    assert cpu_at(samples, 12.25) == pytest.approx(9.5)
    assert cpu_at(samples, -1) == 0.0 and cpu_at(samples, 99) == samples[-1][1]
    # rounds end at 8 (initial), 14 (round 1), 17, 20, 23: steady rounds 2..4 between 14 and 23
    assert cpu_per_round(samples, [8.0, 14.0, 17.0, 20.0, 23.0]) == pytest.approx(6.0)
    assert cpu_per_round(samples, [4.0, 10.0]) == pytest.approx(3.0)  # one round: round 1
    assert cpu_per_round([], [1.0, 2.0, 3.0]) is None


def test_the_tree_monitor_counts_a_busy_child():
    import sys
    import time

    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    with subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; "
                           f"subprocess.run([sys.executable, '-c', {code!r}])"]) as proc:  # fmt: skip
        tree = TreeMonitor(proc.pid, interval=0.05)
        tree.start()
        proc.wait()
        time.sleep(0.1)
        tree.stop()
    assert tree.cpu and max(c for _, c in tree.cpu) >= 0.4
    assert tree.peak > 0 and cpu_seconds(-1) == 0.0


# -- rows ----------------------------------------------------------------------------------------


def test_a_row_times_the_rounds_after_the_first():
    r = row("flower", [10.0, 30.0, 34.0, 38.5], 1500.0, cpu=7.5)
    assert r["seconds_per_round"] == pytest.approx(4.25)  # (38.5 - 30) / 2: rounds 2 and 3
    assert r["cpu_seconds_per_round"] == 7.5
    assert r["first_round_s"] == pytest.approx(20.0)
    assert r["train_s"] == pytest.approx(3.25) and r["eval_s"] == pytest.approx(1.0)
    assert r["final_test_ppl"] == 1500.0 and r["initial_test_ppl"] == 9000.0
    assert r["peak_rss_mb"] == 1024.0 and r["rounds"] == 3
    assert r["precision"] == "fp32" and r["cohort_seed"] == 0
    with pytest.raises(ValueError, match="round ends"):
        make_row("pfl", "0.6", W, "cpu", "x", [1.0], [9000.0], 1.0, 0, [])


def test_one_round_is_timed_alone():
    r = make_row("pfl", "0.6", W, "cpu", "x", [2.0, 7.0], [9000.0, 5000.0], 9.0, 0, [4.0])
    assert r["seconds_per_round"] == 5.0 and r["train_s"] == 4.0
    assert r["cpu_seconds_per_round"] is None


def test_repeats_give_the_median_their_spread_and_every_repeat():
    runs = [row("flower", [0, 30, 36, 42], 1040.0, rss=2**31, cpu=11.0),
            error_row("flower", W, "c", "c", "x"),
            row("flower", [0, 30, 34, 38], 1030.0, cpu=7.0),
            row("flower", [0, 30, 38, 46], 1050.0, cpu=15.0)]  # fmt: skip
    r = combine(runs)
    assert r["seconds_per_round"] == 6.0 and r["seconds_per_round_spread"] == [4.0, 8.0]
    assert r["cpu_seconds_per_round"] == 11.0 and r["cpu_seconds_per_round_spread"] == [7.0, 15.0]
    assert r["final_test_ppl"] == 1040.0 and r["repeats"] == 4
    assert [p["seconds_per_round"] for p in r["per_repeat"]] == [6.0, 4.0, 8.0]  # the order run
    assert [p["test_ppl"][-1] for p in r["per_repeat"]] == [1040.0, 1030.0, 1050.0]
    assert r["peak_rss_mb"] == 2048.0 and r["failed_repeats"] == ["x"]
    # an even count: the mean of the middle two
    two = combine([row("pfl", [0, 5, 8, 11], 1.0, cpu=5.0), row("pfl", [0, 5, 9, 13], 3.0)])
    assert two["seconds_per_round"] == 3.5 and two["final_test_ppl"] == 2.0
    assert two["cpu_seconds_per_round"] == 5.0  # the repeats that have it
    failed = combine([runs[1], runs[1]])
    assert failed["error"] == "x" and failed["repeats"] == 2


def test_every_row_carries_the_fields_the_page_and_its_readers_need():
    done = combine([row("fedkey", [0, 10, 14, 18], 1000.0, cpu=8.0)] * 3)
    failed = combine([error_row("pfl", W, "cpu", "c", "pip failed")])
    for r in (done, failed):
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
    assert done["repeats"] == 3 and done["seconds_per_round_spread"] == [4.0, 4.0]
    assert json.loads(json.dumps(done)) == done


def test_a_new_run_replaces_the_rows_of_its_framework_and_workload():
    old = [{"framework": "fedkey", "workload": "a", "v": 1},
           {"framework": "fedkey", "workload": "b", "v": 1}]  # fmt: skip
    new = [{"framework": "fedkey", "workload": "a", "v": 2}]
    assert merge(old, new) == [old[1], new[0]]


# -- the presets and the CLI ---------------------------------------------------------------------


def test_the_presets_name_their_workload_from_its_sizes():
    irc = preset("irc")
    assert irc.name == "irc500u-c25-h64-lr0.5-r10"
    assert irc.partition == "user" and irc.max_train_tokens is None
    assert preset("ptb").name == "ptb100k-h64-lr0.5-r10"
    assert preset("ptb", rounds=5, lr=1.0).name == "ptb100k-h64-lr1-r5"
    big = preset("irc5k")
    assert big.name == "irc5000u-c1000-h64-lr0.5-r3" and big.clients == 5000
    assert preset("ptb", precision="bf16").name == "ptb100k-h64-lr0.5-r10-bf16"
    assert preset("irc", name="mine").name == "mine"
    with pytest.raises(ValueError, match="--preset tff: choose from ptb, irc, irc5k"):
        preset("tff")
    with pytest.raises(ValueError, match="--precision fp16: choose from fp32, bf16"):
        preset("ptb", precision="fp16")


def test_fedkey_runs_in_the_workloads_precision():
    cmd = fedkey_command(preset("ptb", precision="bf16"), Path("out"))
    assert cmd[cmd.index("--precision") + 1] == "bf16"
    fp32 = fedkey_command(preset("ptb"), Path("o"))
    assert fp32[fp32.index("--precision") + 1] == "fp32"


def test_an_unknown_framework_is_one_error_line():
    from typer.testing import CliRunner

    from fedkey_bench.cli import app

    result = CliRunner().invoke(app, ["peers", "--framework", "tff"])
    assert result.exit_code != 0
    assert "--framework tff: choose from fedkey, flower, pfl" in result.output
    result = CliRunner().invoke(app, ["peers", "--preset", "ptb", "--preset", "irc",
                                      "--workload", "x"])  # fmt: skip
    assert result.exit_code != 0 and "--workload names one workload" in result.output
