"""`fedkey-bench attacks`: its matrix, its resume, and its report from a small fake results.json."""

from __future__ import annotations

import json
import shlex

import pytest

import fedkey_bench.attacks.runner as attacks
from fedkey_bench.attacks.matrix import Cell, Protocol, cells
from fedkey_bench.attacks.report import acceptance, write_report
from fedkey_bench.attacks.runner import command


def fake(
    cell: Cell, ppl: float, top1: float | None = None, refused: int = 0, top3=None, **kw
) -> dict:
    if top3 is None:
        top3 = None if top1 is None else min(1.0, top1 + 0.1)
    return {
        "id": cell.id,
        "strategy": cell.strategy,
        "defence": cell.defence,
        "clients": cell.clients,
        "attackers": cell.attackers,
        "attack": cell.attack,
        "rounds": 2,
        "final_test_ppl": ppl,
        "final_top1": 0.2,
        "backdoor_top1": top1,
        "backdoor_top3": top3,
        "refused_uploads": refused,
        "refused_reasons": ["422 tensor 'x' contains NaN values"] if refused else [],
        "aggregated_per_round": [cell.clients, cell.clients],
        "curve": [[0, 1800.0, 0.0, 0.0], [1, 200.0, top1, top3], [2, ppl, top1, top3]],
        "wall_seconds": 60.0,
        "command": "fedkey simulate ...",
        "git_commit": "abc",
        "git_dirty": False,
        "device": "cpu (2 cores)",
        **kw,
    }


def test_the_matrix_and_its_commands():
    ids = [c.id for c in cells()]
    assert len(ids) == len(set(ids)) == 2 * 3 * 2 * 4 + 4
    off = command(Cell("fedatt", "off", 30, 3, "backdoor"), Protocol(rounds=3), attacks.Path("r"))
    assert off[:2] == ["fedkey", "simulate"]
    line = shlex.join(off)
    assert "--bound off" in line and "--clients 30" in line and "--malicious 3" in line
    assert "--attack backdoor" in line and "--rounds 3" in line and "--fraction 1.0" in line
    assert "--precision fp32" in line  # one precision for every arm, on any machine
    clean = shlex.join(command(Cell("fedavg", "on", 10, 1, "clean"), Protocol(), attacks.Path("r")))
    assert "--malicious 0 --attack backdoor" in clean and "--bound" not in clean
    assert "--trim" not in clean  # "on" is the server's defaults
    clip = shlex.join(
        command(Cell("fedavg", "clip", 10, 1, "backdoor"), Protocol(), attacks.Path("r"))
    )
    assert "--trim 0 --outlier-z 0" in clip and "--bound" not in clip


def test_report_leads_with_the_acceptance_and_compares_with_the_clean_run(tmp_path):
    runs = [
        fake(Cell("fedavg", "off", 10, 1, "clean"), 100.0, top1=0.0),
        fake(Cell("fedavg", "off", 10, 1, "scale"), 200.0),
        fake(Cell("fedavg", "off", 10, 1, "signflip"), 4.8e7),  # diverged
        fake(Cell("fedatt", "off", 10, 1, "scale"), float("inf")),  # past the float range
        fake(Cell("fedatt", "off", 10, 1, "clean"), 50.0),
        fake(Cell("fedatt", "off", 30, 3, "signflip"), 3.6e289),  # the plot's ticks overflowed
        fake(Cell("fedavg", "off", 10, 1, "backdoor"), 110.0, top1=0.8),
        fake(Cell("fedavg", "on", 10, 1, "clean"), 100.0, top1=0.0),
        fake(
            Cell("fedavg", "on", 10, 1, "backdoor"),
            101.0,
            top1=0.05,
            clip_multiple=1.0,
            outlier_z=3.5,
            outliers_per_round=[["device-8", "device-9"], ["device-9"]],
        ),
        fake(Cell("fedavg", "clip", 10, 1, "backdoor"), 104.0, top1=0.6),
        fake(Cell("fedavg", "on", 10, 1, "nan"), 102.0, refused=2),
        fake(Cell("fedatt", "off", 10, 1, "backdoor"), 5e9, top1=0.9),  # a wrecked model
        fake(
            Cell("fedatt", "on", 10, 1, "backdoor"),
            100.0,
            top1=0.3,
            curve=[[0, 1800.0, 0.0, 0.0], [1, 200.0, 0.0, 0.1], [2, 100.0, 0.3, 0.4]],
        ),
        fake(Cell("fedavg", "off", 30, 3, "backdoor"), 100.0, top1=0.4),
        fake(Cell("fedavg", "on", 30, 3, "backdoor"), 100.0, top1=0.0),
        fake(Cell("fedatt", "off", 30, 3, "backdoor"), 100.0, top1=0.9),
        fake(Cell("fedatt", "on", 30, 3, "backdoor"), 100.0, top1=0.02, top3=0.09),
    ]
    verdicts = {(a["strategy"], a["population"]): a["verdict"] for a in acceptance(
        {r["id"]: r for r in runs})}  # fmt: skip
    assert verdicts[("fedavg", "1 of 10")].startswith("**top-1 only**")  # 5% / 15%
    assert verdicts[("fedatt", "3 of 30")] == "met"  # 2% / 9%
    assert verdicts[("fedatt", "1 of 10")] == "**not met**"
    assert verdicts[("fedavg", "3 of 30")].startswith("no test")
    md = write_report(runs, tmp_path, ["fedkey-bench attacks"]).read_text()
    assert md.index("## Acceptance") < md.index("## Every cell")
    assert "FedAtt, 1 of 10, undefended: the boosted updates wrecked the model (final test " in md
    assert "FedAvg, 1 of 10, undefended" not in md  # 110 against 100 clean: not wrecked
    assert "| FedAvg | 1 of 10 | 80% / 90% | 60% / 70% | 5% / 15% | 101.00 / 110.00 | **top-1" in md
    assert "| FedAtt | 3 of 30 | 90% / 100% | - | 2% / 9% | 100.00 / 100.00 | met |" in md
    assert "| FedAtt | 1 of 10 | 90% / 100% | - | 30% / 40% |" in md  # no clip-only run yet
    assert "| FedAvg | off | - | - | 1 of 10 | scale | 200.00 | 100.00 | 2.00x | 0 | - | - |" in md
    assert "| FedAvg | on | 1.00 | z > 3.5: 3 rejected | 1 of 10 | backdoor | 101.00 |" in md
    assert (
        "FedAvg, 1 of 10, defended: the cosine filter rejected every attacker in 2 of 2 rounds, "
        "and 1 honest phone-round(s) of 18." in md
    )
    # The filter's rejections per round, beside the attackers' names.
    assert "| `fedavg-on-1of10-backdoor` | device-9 | device-8, device-9 | device-9 |" in md
    assert "| signflip | 4.8e+07 | 100.00 | 4.8e+05x | 0 |" in md  # not 10 digits
    assert "| FedAtt | off | - | - | 1 of 10 | scale | inf | 50.00 | infx | 0 |" in md
    assert "| `fedavg-on-1of10-nan` | 2 | 2 | 422 tensor 'x' contains NaN values |" in md
    assert "1.020x | yes |" in md
    # Past the bar and higher than after round 1: the note shows it per round.
    assert "grows round after round (top-1 / top-3, FedAtt 1 of 10: 0% / 10% -> 30% / 40%)" in md
    assert (tmp_path / "attacks.png").stat().st_size > 0


def test_cells_already_in_results_json_are_not_run_again(tmp_path, monkeypatch):
    out, runs_dir, protocol = tmp_path / "out", tmp_path / "runs", Protocol(rounds=2)
    done = Cell("fedavg", "off", 10, 1, "clean")
    old = fake(
        done, 100.0, top1=0.0, command=shlex.join(command(done, protocol, runs_dir / done.id))
    )
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"bench_commands": [], "runs": [old]}))
    ran = []

    def run_cell(cell, protocol_, runs_dir_):
        ran.append(cell.id)
        cmd = shlex.join(command(cell, protocol_, runs_dir_ / cell.id))
        return fake(cell, 150.0, top1=0.5, command=cmd)

    monkeypatch.setattr(attacks, "run_cell", run_cell)
    runs = attacks.run_attacks(
        out, runs_dir, protocol, only=["fedavg-off-1of10-*"], progress=False, bench_command="b"
    )
    assert sorted(ran) == [
        "fedavg-off-1of10-backdoor",
        "fedavg-off-1of10-scale",
        "fedavg-off-1of10-signflip",
    ]
    assert len(runs) == 4 and (out / "results.md").exists()
    ran.clear()
    attacks.run_attacks(out, runs_dir, protocol, only=["fedavg-off-1of10-*"], progress=False)
    assert ran == []  # every cell is there now: nothing runs
    with pytest.raises(ValueError, match="matches no cell"):
        attacks.select(["nothing-*"])


def test_a_failed_cell_does_not_stop_the_others_and_is_named_at_the_end(tmp_path, monkeypatch):
    def run_cell(cell, protocol, runs_dir):
        if cell.attack == "scale":
            raise RuntimeError(f"{cell.id}: `fedkey simulate ...` exited 1")
        return fake(
            cell, 100.0, top1=0.0, command=shlex.join(command(cell, protocol, runs_dir / cell.id))
        )

    monkeypatch.setattr(attacks, "run_cell", run_cell)
    with pytest.raises(RuntimeError, match="1 cell.s. failed.*fedavg-on-1of10-scale"):
        attacks.run_attacks(
            tmp_path, tmp_path / "runs", Protocol(), only=["fedavg-on-1of10-*"], progress=False
        )
    done = {r["id"] for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert done == {
        f"fedavg-on-1of10-{a}" for a in ("clean", "signflip", "backdoor", "nan", "shape")
    }


def test_the_clip_multiple_is_read_from_the_last_adaptive_round():
    rows = [
        {"round": 0},
        {"round": 1, "info": {"clip": {"mode": "adaptive", "norm": 8.0, "median_norm": 4.0}}},
        {"round": 2, "info": {"clip": {"mode": "adaptive", "norm": 5.0, "median_norm": 5.0}}},
    ]
    assert attacks.clip_multiple(rows) == 1.0
    assert attacks.clip_multiple(rows[:2]) == 2.0
    assert attacks.clip_multiple([{"round": 1, "info": {"clip": {"mode": "dp"}}}]) is None
    assert attacks.clip_multiple([{"round": 1, "info": {}}]) is None


def test_the_cosine_filter_is_read_per_round_and_absent_when_off():
    clip = {"mode": "adaptive", "outlier_z": 3.5}
    rows = [
        {"round": 0},
        {"round": 1, "info": {"clip": {**clip, "outliers": {"device-9": 31.0, "device-8": 13.0}}}},
        {"round": 2, "info": {"clip": {**clip, "outliers": {}}}},
    ]
    assert attacks.outlier_filter(rows) == (3.5, [["device-8", "device-9"], []])
    off = [{"round": 0}, {"round": 1, "info": {"clip": {"mode": "adaptive", "outliers": {}}}}]
    assert attacks.outlier_filter(off) == (None, [[]])
    clip_arm = shlex.join(
        command(Cell("fedatt", "clip", 10, 1, "backdoor"), Protocol(), attacks.Path("r"))
    )
    assert "--trim 0 --outlier-z 0" in clip_arm  # the clip alone: no trim, no filter


def test_the_committed_cells_rebuild_a_page_that_leads_with_the_answer(tmp_path):
    """experiments/results/attacks/results.md from its results.json alone: the question, the
    acceptance table, then every cell; the protocol at the end."""
    from pathlib import Path

    committed = Path(__file__).resolve().parents[2] / "results" / "attacks"
    data = json.loads((committed / "results.json").read_text())
    md = write_report(data["runs"], tmp_path, data["bench_commands"]).read_text()
    assert md == (committed / "results.md").read_text()
    assert md.startswith("# fedkey-bench attacks\n\nCan a few malicious phones")
    assert md.index("## Acceptance") < md.index("## Every cell") < md.index("## How it was run")
    assert len(md.encode()) <= 30 * 1024
