"""`fedkey audit canary`'s bookkeeping: an arm already in results.json with the same command is
not run again (an interrupted audit resumes), and the report is written from results.json."""

import json

import pytest

import fedkey.runners.canary_audit as canary
import fedkey.runners.canary_report as canary_report
from fedkey.runners.canary_audit import AuditConfig, arms, canary_phone, run_audit, summarize

CFG = AuditConfig(rounds=2, clients=20, dp_noise_multipliers=(1.0,))


def rows(exposures: list[float], with_phone: set[int]) -> list[dict]:
    return [
        {
            "round": n,
            "aggregated": ["device-00", "device-03"] if n in with_phone else ["device-03"],
            "canary_exposure": e,
            "canary_rank": 2 ** (13.2877 - e),
            "val_ppl": 100.0 - n,
            "test_ppl": 101.0 - n,
            "best_test_ppl": 101.0 - n,
            "epsilon": None,
        }
        for n, e in enumerate(exposures)
    ]


@pytest.fixture
def fake_runs(monkeypatch):
    """run_arm without a child process: records which arms ran."""
    ran = []

    def run_arm(arm, cfg, runs_dir, on_round=lambda n: None, results=None):
        ran.append(arm.id)
        on_round(cfg.rounds)
        exposures = [0.6, 13.29, 13.29] if not arm.dp else [0.6, 1.1, 0.9 if arm.planted else 0.5]
        return {
            **summarize(rows(exposures, {1}), arm, cfg.clients),
            "wall_seconds": 1.0,
            "command": " ".join(canary.command(arm, cfg, runs_dir / arm.id)),
            "git_commit": "abc",
            "git_dirty": False,
            "device": "cpu",
            "config": {**CFG.__dict__},
        }

    monkeypatch.setattr(canary, "run_arm", run_arm)
    return ran


def test_an_interrupted_audit_resumes_with_the_arms_it_has_not_run(
    tmp_path, fake_runs, monkeypatch
):
    monkeypatch.setattr(canary_report, "plot", lambda *a: None)  # the report's plot: the next test
    out, runs = tmp_path / "out", tmp_path / "runs"
    run_audit(CFG, out, runs, only=["fedavg", "fedatt"])
    assert fake_runs == ["fedavg", "fedatt"]
    results = run_audit(CFG, out, runs)  # the DP arms only
    assert fake_runs[2:] == [
        "fedavg-dp-z1", "fedavg-dp-z1-control", "fedatt-dp-z1", "fedatt-dp-z1-control"
    ]  # fmt: skip
    assert [r["id"] for r in results] == [a.id for a in arms(CFG)]
    run_audit(CFG, out, runs)  # all done: nothing runs
    assert len(fake_runs) == 6
    run_audit(AuditConfig(rounds=3), out, runs, only=["fedavg"])  # another command: run again
    assert fake_runs[-1] == "fedavg"
    with pytest.raises(ValueError, match="no arm fedsgd"):
        run_audit(CFG, out, runs, only=["fedsgd"])


def test_the_report_shows_each_arm_per_round(tmp_path, fake_runs):
    out = tmp_path / "out"
    run_audit(CFG, out, tmp_path / "runs")
    saved = json.loads((out / "results.json").read_text())["runs"]
    fedavg = next(r for r in saved if r["id"] == "fedavg")
    assert (fedavg["exposure"], fedavg["max_exposure"], fedavg["canary_rounds"]) == (
        13.29,
        13.29,
        [1],
    )
    md = (out / "results.md").read_text()
    # arm, copies planted, last round, mean from the canary phone's first round, max
    assert "| FedAvg | 20 | 13.29 | 13.29 | 13.29 |" in md
    assert "| DP-FedAtt z 1 | 20 | 0.90 | 1.00 | 1.10 |" in md
    assert "| DP-FedAtt z 1, not planted | 0 | 0.50 | 0.80 | 1.10 |" in md
    # per round, * where the canary phone was aggregated; each DP arm beside its control
    assert "| 2 | 13.29 | 13.29 | 0.90 | 0.50 | 0.90 | 0.50 |" in md
    assert "| 1 | 13.29 * | 13.29 * | 1.10 * | 1.10 * | 1.10 * | 1.10 * |" in md
    assert "log2 |R| - log2 rank" in md and "13.29 bits" in md
    assert (out / "exposure.png").stat().st_size > 10_000


def test_the_canary_phone_is_named_as_the_shards_are():
    assert canary_phone(20) == "device-00" and canary_phone(5) == "device-0"


def test_a_round_whose_outlier_filter_rejected_the_canary_phone_does_not_count_as_its_round():
    """Without DP the cosine outlier filter may reject the planted phone's upload: it was in the
    cohort and uploaded, but its update is not in the aggregate (info.clip.outliers)."""
    got = rows([0.6, 2.0, 2.1], {1, 2})
    got[1]["info"] = {"clip": {"outliers": {"device-00": 10.4}}}
    summary = summarize(got, arms(CFG)[0], 20)
    assert (summary["canary_rounds"], summary["canary_rejected"]) == ([2], [1])
    assert [p["canary_phone"] for p in summary["curve"]] == [False, False, True]


def test_an_arm_whose_planted_phone_never_trained_says_so(tmp_path, monkeypatch, capsys):
    """A cohort that never drew the canary phone: the arm measured nothing, and the audit says so."""

    def run_arm(arm, cfg, runs_dir, on_round=lambda n: None, results=None):
        return {**summarize(rows([0.6, 1.2, 0.9], set()), arm, cfg.clients), "wall_seconds": 1.0,
                "command": " ".join(canary.command(arm, cfg, runs_dir / arm.id)),
                "git_commit": "abc", "git_dirty": False, "device": "cpu",
                "config": {**CFG.__dict__}}  # fmt: skip

    monkeypatch.setattr(canary, "run_arm", run_arm)
    monkeypatch.setattr(canary_report, "plot", lambda *a: None)
    (run,) = run_audit(CFG, tmp_path / "out", tmp_path / "runs", only=["fedavg"])
    assert run["canary_rounds"] == []
    said = "".join(capsys.readouterr())
    assert "FedAvg: device-00, the phone holding the secret, was in no round's aggregate" in said
    assert "| FedAvg | 20 | 0.90 | - | 1.20 | " in (tmp_path / "out" / "results.md").read_text()
