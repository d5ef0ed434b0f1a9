"""fedkey_bench.privacy.runner: the noise calibration hits its epsilon under each mechanism, a simulated
deployment cohort gets the deployment's noise, the tables render, a resumed bench skips the cells it
has."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fedkey_bench.privacy.noise import calibrate_noise, epsilon_after, epsilon_of
from fedkey_bench.privacy.report import table, write_report
from fedkey_bench.privacy.runner import (
    WORKLOADS,
    Cell,
    Protocol,
    calibrate_cell,
    run_privacy,
    usable_mechanisms,
)


@pytest.mark.parametrize("target", [2.0, 32.0])
def test_calibrated_noise_reaches_the_target_epsilon_within_one_percent(target):
    z = calibrate_noise(target, epsilon_of("gaussian", 20, 1000, 100, 1e-5))
    reached = epsilon_after(z, 20, 1000, 100, 1e-5)
    assert reached == pytest.approx(target, rel=0.01)
    # More noise, less epsilon: the calibration found the root, not any z.
    assert epsilon_after(z * 1.1, 20, 1000, 100, 1e-5) < target * 0.99


def test_the_tree_is_calibrated_on_the_servers_zcdp_at_the_default_separation():
    from fedkey.federation.privacy.tree import tree_rho, zcdp_epsilon

    z = calibrate_noise(8.0, epsilon_of("tree", 12, 2000, 100, 2000**-1.1))
    # b = floor(2000 / 100) = 20 >= 12 rounds: one participation, ceil(log2 13) = 4 nodes
    assert tree_rho(12, z, 20) == pytest.approx(4 / (2 * z**2))
    assert zcdp_epsilon(tree_rho(12, z, 20), 2000**-1.1) == pytest.approx(8.0, rel=0.01)


def test_an_unreachable_target_is_refused():
    with pytest.raises(ValueError, match="positive"):
        calibrate_noise(0.0, epsilon_of("gaussian", 5, 1000, 100, 1e-5))


def test_a_blt_without_a_shipped_factorization_is_left_out_with_the_reason():
    protocol = Protocol(rounds=100_000, mechanisms=("gaussian", "blt"))
    usable, why = usable_mechanisms(protocol)
    assert usable == ("gaussian",)
    assert "--dp-mechanism blt" in why["blt"]


@pytest.mark.parametrize("mechanism", ["gaussian", "tree"])
def test_a_simulated_cohort_gets_the_deployments_noise_on_its_average(mechanism):
    """pfl-research's noise_cohort_size: our cohort m trains with z = z' m / M, so its noise
    on the average, z 2S / m, is the deployment's z' 2S / M, and z' buys the target epsilon for
    the deployment (population N M / m, the same sampling rate and separation, its own delta)."""
    protocol = Protocol(clients=2000, fraction=0.05, rounds=12, delta=None)
    cell = calibrate_cell(protocol, Cell("fedavg", 8.0, mechanism=mechanism, noise_cohort=5000))
    assert cell.id == f"fedavg{'' if mechanism == 'gaussian' else '-tree'}-eps8-M5000"
    assert cell.deployment_z is not None and cell.noise_multiplier is not None
    assert cell.noise_multiplier * 2 / 100 == pytest.approx(cell.deployment_z * 2 / 5000)
    big_n = 2000 * 5000 // 100
    reached = epsilon_of(mechanism, 12, big_n, 5000, big_n**-1.1)(cell.deployment_z)
    assert reached == pytest.approx(8.0, rel=0.01)
    # Our own population at the run's z would spend far more than 8.
    ours = calibrate_cell(protocol, Cell("fedavg", 8.0, mechanism=mechanism))
    assert ours.noise_multiplier is not None and ours.noise_multiplier > 10 * cell.noise_multiplier


def _cell(strategy, target, ppl, noise=None, eps=None, z=None):
    return {
        "id": f"{strategy}-{'nodp' if target is None else f'eps{target:g}'}",
        "strategy": strategy,
        "target_epsilon": target,
        "epsilon": eps,
        "noise_multiplier": z,
        "clip": 0.5,
        "sensitivity": None if noise is None else noise / z,
        "noise_std": noise,
        "rounds": 3,
        "initial_test_ppl": 9959.0,
        "final_test_ppl": ppl,
        "best_round": 3,
        "best_val_ppl": ppl + 1,
        "best_test_ppl": ppl,
        "clipped_per_round": 50.0,
        "num_params": 10_000,
        "test_ppl_curve": [9959.0, ppl],
        "wall_seconds": 10.0,
        "config": "{}",
        "git_commit": "abc",
        "git_dirty": False,
    }


FAKE = [
    {"id": "probe-fedavg-nodp", "median_norms": [0.4, 0.6], "clip": 0.5, "wall_seconds": 5.0},
    _cell("fedatt", 8.0, 2100.0, noise=0.02, eps=7.99, z=1.0),
    _cell("fedavg", None, 900.0),
    _cell("fedavg", 8.0, 1500.0, noise=0.004, eps=7.99, z=1.0),
    _cell("fedatt", None, 880.0),
    {**_cell("fedatt", 2.0, 1.24e13, noise=0.05, eps=2.0, z=2.5), "best_round": 0},
]


def test_the_table_renders_from_a_results_file(tmp_path):
    write_report(FAKE, tmp_path, ["fedkey-bench privacy --rounds 3"], vars_protocol())
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# Privacy-utility table")
    rows = [line for line in table(FAKE).splitlines() if line.startswith("| ")][1:]
    # fedavg before fedatt, no DP before the epsilons; the probe is not a row
    assert [r.split("|")[1].strip() for r in rows] == [
        "fedavg",
        "DP-FedAvg",
        "fedatt",
        "DP-FedAtt",
        "DP-FedAtt",
    ]
    assert "| DP-FedAtt | 8 | 7.99 | 1.000 | 0.02 | 0.02 | 2100.0 | 2100.0 (3) |" in md
    # a diverged model's perplexity stays readable; a run that never beat round 0 says so
    assert "| DP-FedAtt | 2 | 2.00 | 2.500 | 0.02 | 0.05 | 1.24e+13 | 1.24e+13 (0) |" in md
    assert "at epsilon 2 no round's model beat the initial one" in md
    assert "5.00x DP-FedAvg's" in md  # the noise ratio, from the numbers
    # the least noise's norm, std x sqrt(parameters), against the clip
    assert "has norm about 0.4 per round, below the clip S = 0.5" in md
    assert "fedkey-bench privacy --rounds 3" in md
    assert "S = 0.5: the median" in md
    assert (tmp_path / "privacy.png").stat().st_size > 0


def vars_protocol() -> dict:
    from dataclasses import asdict

    return asdict(Protocol(rounds=3, clients=20, fraction=0.5))


def test_a_resumed_bench_skips_the_cells_it_has(tmp_path, monkeypatch):
    # The report and git provenance are tested elsewhere; here only what runs.
    monkeypatch.setattr("fedkey_bench.privacy.runner._provenance", lambda: {})
    monkeypatch.setattr("fedkey_bench.privacy.report.plot", lambda runs, path: None)
    monkeypatch.setattr("fedkey_bench.privacy.runner.z_for", lambda target, *a: 8.0 / target)
    protocol = Protocol(rounds=3, clients=20, fraction=0.5, epsilons=(8.0,), clip=0.5)
    ran: list[str] = []

    def fake_runner(fields, rounds, protocol, run_dir: Path):
        ran.append(run_dir.name)
        dp = fields.get("dp_noise_multiplier")
        info: dict[str, dict[str, float]] = {"clip": {"clipped": 1}}
        if dp is not None:
            info["dp"] = {"sensitivity": 0.1, "noise_std": 0.1 * dp}
        rows = [
            {"round": 0, "test_ppl": 100.0, "epsilon": None},
            {
                "round": rounds,
                "test_ppl": 50.0,
                "best_round": rounds,
                "best_val_ppl": 51.0,
                "best_test_ppl": 50.0,
                "epsilon": 8.0 if dp else None,
                "info": info,
            },
        ]
        return rows, 1.0

    out = tmp_path / "out"
    run_privacy(out, tmp_path / "runs", protocol, progress=False, runner=fake_runner)
    assert sorted(ran) == ["fedatt-eps8", "fedatt-nodp", "fedavg-eps8", "fedavg-nodp"]
    first = json.loads((out / "results.json").read_text())
    assert {r["id"] for r in first["runs"]} == set(ran)

    ran.clear()
    run_privacy(out, tmp_path / "runs", protocol, progress=False, runner=fake_runner)
    assert ran == []  # everything was done

    # Another setting of the same cells (more rounds) is a different result: run again.
    run_privacy(
        out,
        tmp_path / "runs",
        Protocol(**{**vars(protocol), "rounds": 4}),
        progress=False,
        runner=fake_runner,
        only=["fedavg-*"],
    )
    assert sorted(ran) == ["fedavg-eps8", "fedavg-nodp"]


def test_the_committed_cells_rebuild_their_page(tmp_path):
    """experiments/results/privacy/results.md is rebuilt from its results.json alone (the
    protocol read back from the cells' settings): the question, then the table."""
    import shutil
    from pathlib import Path

    from fedkey_bench.privacy.report import rebuild

    committed = Path(__file__).resolve().parents[2] / "results" / "privacy"
    shutil.copy(committed / "results.json", tmp_path / "results.json")
    md = rebuild(tmp_path).read_text()
    assert md == (committed / "results.md").read_text()
    assert md.startswith("# Privacy-utility table") and "What does differential privacy" in md
    assert md.index("| strategy | target epsilon |") < md.index("## How it was made")
    assert len(md.encode()) <= 30 * 1024


def _fake_irc_runner(ran: list[tuple[str, dict]]):
    """A runner that records each run's folder name and fields and learns a little (top-1)."""

    def runner(fields, rounds, protocol, run_dir: Path):
        ran.append((run_dir.name, fields))
        z = fields.get("dp_noise_multiplier")
        info: dict = {"clip": {"clipped": 1, "median_norm": 2.0}}
        if z is not None:
            info["dp"] = {"sensitivity": 0.04, "noise_std": 0.04 * z, "min_separation": 2}
        ppl, top1 = (100.0, 0.20) if z is None else (110.0 + 10 * z, 0.19)
        rows = [
            {"round": 0, "test_ppl": 2000.0, "bar_top1": 0.0, "epsilon": None},
            {"round": rounds, "test_ppl": ppl, "bar_top1": top1, "best_round": rounds,
             "best_val_ppl": ppl, "best_test_ppl": ppl, "epsilon": 8.0 if z else None,
             "info": info},
        ]  # fmt: skip
        return rows, 1.0

    return runner


def test_the_irc_workload_runs_its_mechanisms_and_writes_a_page_with_top1_and_what_is_left(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("fedkey_bench.privacy.runner._provenance", lambda: {})
    monkeypatch.setattr("fedkey_bench.privacy.grid_report.plot", lambda runs, path: None)
    protocol = replace(
        WORKLOADS["irc"], clients=40, fraction=0.05, rounds=4, epsilons=(8.0,),
        mechanisms=("gaussian", "tree"), noise_cohorts=(1000,), clip=0.5,
    )  # fmt: skip
    ran: list[tuple[str, dict]] = []
    out = tmp_path / "out"
    only = ["fedavg-nodp", "fedatt-fixed-nodp", "*-tree-eps8", "fedavg-eps8-M1000"]
    run_privacy(out, tmp_path / "runs", protocol, only, progress=False,
                runner=_fake_irc_runner(ran))  # fmt: skip
    fields = dict(ran)
    assert sorted(fields) == ["fedatt-fixed-nodp", "fedatt-fixed-tree-eps8", "fedatt-tree-eps8",
                              "fedavg-eps8-M1000", "fedavg-nodp", "fedavg-tree-eps8"]  # fmt: skip
    # The fixed normalizer reaches the server; the tree is the server's mechanism; no fixed delta.
    assert fields["fedatt-fixed-tree-eps8"]["fedatt_normalizer"] == "fixed"
    assert fields["fedatt-fixed-tree-eps8"]["dp_mechanism"] == "tree"
    assert "fedatt_normalizer" not in fields["fedatt-tree-eps8"]
    assert fields["fedavg-tree-eps8"]["dp_delta"] is None
    data = json.loads((out / "results.json").read_text())
    sim = next(r for r in data["runs"] if r["id"] == "fedavg-eps8-M1000")
    assert sim["deployment_population"] == 40 * 1000 // 2  # N M / m, m = 2
    assert sim["epsilon"] == pytest.approx(8.0, rel=0.01)  # the deployment's, not the server's
    md = (out / "results.md").read_text()
    assert md.startswith("# Privacy-utility on the IRC population")
    assert "| DP-FedAvg | gaussian | 1,000 (simulated) | 8 |" in md
    # top-1 and the cost against the same strategy without DP: 0.19 / 0.20 - 1
    assert "| 19.0% | " in md and "-5.0%" in md
    assert "Not run yet (" in md and "fedavg-eps8, " in md
    assert "Target 2 (DP-FedAtt within 5%" in md
    # The page rebuilds from results.json alone.
    from fedkey_bench.privacy.report import rebuild

    assert rebuild(out).read_text() == md
    # Resumed: nothing left of what was asked.
    ran.clear()
    run_privacy(out, tmp_path / "runs", protocol, only, progress=False,
                runner=_fake_irc_runner(ran))  # fmt: skip
    assert ran == []
