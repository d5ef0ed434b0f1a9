"""`fedkey simulate` end to end, in-process: perplexity falls, runs are reproducible bit for bit."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.federation.engine import Federation

runner = CliRunner()
FAST = [
    "--rounds",
    "3",
    "--local-epochs",
    "1",
    "--batch-size",
    "10",
    "--lr",
    "0.5",
    "--max-eval-sentences",
    "150",
]


def simulate(out, *args):
    result = runner.invoke(app, ["simulate", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, result.output


def weights(out, r):
    return load_file(out / "checkpoints" / f"round_{r:04d}.safetensors")


@pytest.mark.slow
def test_demo_three_rounds_perplexity_falls(tmp_path):
    rows, output = simulate(
        tmp_path / "run",
        "--data",
        "demo",
        "--clients",
        "20",
        "--partition",
        "user",
        "--fraction",
        "0.2",
        "--strategy",
        "fedatt",
        "--max-train-tokens",
        "30000",
        "--workers",
        "2",
        *FAST,
    )
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["test_ppl"] < rows[1]["test_ppl"] < rows[0]["test_ppl"]
    assert all(len(r["aggregated"]) == 4 for r in rows[1:])
    assert rows[3]["top3"] > rows[0]["top3"] and rows[3]["ksr"] > rows[0]["ksr"]
    for key in (
        "selected",
        "val_ppl",
        "top1",
        "ksr",
        "bytes_up",
        "bytes_down",
        "epsilon",
        "seconds",
    ):
        assert key in rows[3]
    assert (
        rows[1]["bytes_up"] == rows[1]["bytes_down"] > 0
    )  # 4 downloads, 4 uploads of the same size
    assert (tmp_path / "run" / "perplexity.png").stat().st_size > 0
    assert "perplexity per round" in output
    # --eval-device auto: the GPU where torch sees one (tests/test_cuda_smoke.py), else the CPU
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert {r["eval_device"] for r in rows} == {want}


@pytest.mark.slow
def test_same_seed_gives_identical_weights_whatever_the_workers(tmp_path):
    def args(seed):
        return [
            "--data",
            "demo",
            "--clients",
            "10",
            "--fraction",
            "0.3",
            "--max-train-tokens",
            "8000",
            "--seed",
            str(seed),
            *FAST,
        ]

    simulate(tmp_path / "a", *args(3), "--workers", "2")
    simulate(tmp_path / "b", *args(3), "--workers", "0")
    simulate(tmp_path / "c", *args(4), "--workers", "0")
    a, b, c = (weights(tmp_path / x, 3) for x in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["rnn.weight_hh_l0"], c["rnn.weight_hh_l0"])


#: A DP-FTRL run with adaptive clipping, its noise from a passphrase (the same in both runs).
DP = ["--dp-clip", "0.5", "--dp-noise-multiplier", "0.3", "--dp-mechanism", "blt",
      "--dp-clip-quantile", "0.5", "--dp-clip-count-stddev", "1", "--dp-secret", "summed-test",
      "--dp-publish-scores"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("bounding", [["--bound", "off"], DP], ids=["bound off", "dp"])
def test_a_fedavg_round_summed_in_the_workers_is_the_same_run(tmp_path, monkeypatch, bounding):
    """FedAvg with --bound off, or under DP (each delta clipped where its phone trained), sums
    each round where the phones train (fedkey.federation.updates.summed: no per-phone update
    reaches the server) and the resident workers score the held-out sets: two worker processes
    and this process give the same rows and the same weights to float rounding, every phone
    aggregated."""

    def per_phone(*_: object) -> None:
        raise AssertionError("a summable round reached the server as per-phone updates")

    monkeypatch.setattr(Federation, "complete_round", per_phone)
    args = ["--data", "demo", "--clients", "10", "--fraction", "0.4", "--max-train-tokens",
            "8000", "--ksr-sentences", "5", *bounding, *FAST]  # fmt: skip
    two, _ = simulate(tmp_path / "two", *args, "--workers", "2")
    here, _ = simulate(tmp_path / "here", *args, "--workers", "0")
    for a, b in zip(two, here, strict=True):
        assert a["selected"] == b["selected"] and a["aggregated"] == a["selected"]
        assert a["test_ppl"] == pytest.approx(b["test_ppl"], rel=1e-5)
        assert (a["bar_top1"], a["ksr"]) == pytest.approx((b["bar_top1"], b["ksr"]), rel=1e-4)
        assert a.get("epsilon") == b.get("epsilon")
    if bounding is DP:  # a public row under DP: the mechanism, no per-phone weights
        assert two[1]["info"]["dp"]["mechanism"] == "blt" and two[-1]["epsilon"] > 0
    else:
        assert two[1]["info"]["clip"]["mode"] == "off" and len(two[1]["info"]["weights"]) == 4
    a, b = weights(tmp_path / "two", 3), weights(tmp_path / "here", 3)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert not torch.equal(a["rnn.weight_hh_l0"], weights(tmp_path / "two", 0)["rnn.weight_hh_l0"])


@pytest.mark.slow
def test_keep_checkpoints_leaves_the_latest_rounds_and_the_best_and_still_resumes(tmp_path):
    """--keep-checkpoints 1: after each round only the newest round's files (the model and the
    server optimizer's buffers, what a resume reads) and the best round's stay on disk."""
    base = ["--data", "demo", "--clients", "6", "--max-train-tokens", "4000", "--workers", "0",
            "--server-opt", "momentum", "--max-eval-sentences", "30", "--keep-checkpoints", "1",
            "--local-epochs", "1"]  # fmt: skip
    out = tmp_path / "run"
    rows, _ = simulate(out, *base, "--rounds", "3")

    def kept() -> set[str]:
        return {p.name for p in (out / "checkpoints").iterdir()}

    def files(*rounds: int) -> set[str]:  # round 0, the initial model, has no buffers
        return {f"round_{r:04d}.safetensors" for r in rounds} | {
            f"server_opt_{r:04d}.safetensors" for r in rounds if r
        }

    assert kept() == files(3, rows[-1]["best_round"])
    rows, output = simulate(out, *base, "--rounds", "4", "--resume")  # from what was kept
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    # the progress bar opens at the round it continues from, not the initial model's figures
    assert f"test_ppl={rows[3]['test_ppl']:.1f}, val_ppl={rows[3]['val_ppl']:.1f}" in output
    assert kept() == files(4, rows[-1]["best_round"])


def test_a_server_lr_decay_leaves_round_1_alone_and_changes_round_2(tmp_path):
    """The engine hands the server optimizer its round: with --server-lr-decay 0.5, round 1
    steps at the server lr as a constant schedule does (the same weights), round 2 at half of
    it (other weights)."""
    base = ["--data", "demo", "--clients", "6", "--max-train-tokens", "3000", "--workers", "0",
            "--max-eval-sentences", "20", "--ksr-sentences", "0", "--local-epochs", "1",
            "--rounds", "2", "--server-opt", "momentum", "--server-momentum", "0"]  # fmt: skip
    simulate(tmp_path / "constant", *base)
    simulate(tmp_path / "decayed", *base, "--server-lr-decay", "0.5")

    def same(r: int) -> bool:
        a, b = weights(tmp_path / "constant", r), weights(tmp_path / "decayed", r)
        return all(torch.equal(a[k], b[k]) for k in a)

    assert same(1) and not same(2)


@pytest.mark.slow
def test_resume_continues_exactly_where_the_run_stopped(tmp_path):
    """A run killed during round 3, after writing checkpoint 2 but not its metrics row, resumes
    to the same weights and selections (AdaFL scores and server momentum included, and both lr
    schedules: round 3 steps at its own local and server lr) as a run never interrupted."""
    base = [
        "--data",
        "demo",
        "--clients",
        "10",
        "--max-train-tokens",
        "8000",
        "--adafl",
        "--server-opt",
        "momentum",
        "--server-lr-decay",
        "0.8",
        "--lr-decay",
        "0.9",
        "--workers",
        "0",
        "--local-epochs",
        "1",
        "--max-eval-sentences",
        "50",
        "--rounds",
        "3",
    ]
    simulate(tmp_path / "straight", *base)
    simulate(tmp_path / "resumed", *base)
    (tmp_path / "resumed" / "checkpoints" / "round_0003.safetensors").unlink()
    metrics = tmp_path / "resumed" / "metrics.jsonl"
    metrics.write_text(
        "".join(metrics.read_text().splitlines(keepends=True)[:2])
    )  # rows 0 and 1 only
    rows, _ = simulate(tmp_path / "resumed", *base, "--resume")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    a, b = weights(tmp_path / "straight", 3), weights(tmp_path / "resumed", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    straight = [
        json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["selected"] for r in rows] == [r["selected"] for r in straight]


@pytest.mark.slow
@pytest.mark.needs_data
def test_ptb_slice_perplexity_falls(tmp_path, data_dir):
    rows, _ = simulate(
        tmp_path / "ptb",
        "--data",
        str(data_dir / "ptb"),
        "--paper-protocol",
        "--clients",
        "10",
        "--fraction",
        "0.2",
        "--strategy",
        "fedavg",
        "--max-train-tokens",
        "20000",
        "--vocab-size",
        "5000",
        "--workers",
        "2",
        *FAST,
    )
    # A fresh model's first high-lr round can overshoot; from then on perplexity must fall.
    assert rows[3]["test_ppl"] < rows[2]["test_ppl"] < rows[1]["test_ppl"]
    assert rows[3]["test_ppl"] < rows[0]["test_ppl"]


@pytest.mark.slow
def test_sentencepiece_run_reports_per_word_perplexity(tmp_path):
    rows, _ = simulate(
        tmp_path / "sp",
        "--data",
        "demo",
        "--tokenizer",
        "sentencepiece",
        "--vocab-size",
        "1000",
        "--clients",
        "10",
        "--fraction",
        "0.3",
        "--max-train-tokens",
        "10000",
        "--workers",
        "0",
        "--rounds",
        "2",
        "--local-epochs",
        "1",
        "--max-eval-sentences",
        "100",
    )
    assert rows[2]["test_ppl"] < rows[0]["test_ppl"]
    assert rows[2]["top1"] is None  # word accuracy is not defined on pieces


def test_bad_arguments_are_refused_with_a_message(tmp_path):
    result = runner.invoke(app, ["simulate", "--strategy", "fedfoo", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "fedfoo" in result.output
    result = runner.invoke(
        app, ["simulate", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path)]
    )
    assert result.exit_code != 0


@pytest.mark.slow
def test_train_central_writes_the_same_metrics_format(tmp_path):
    out = tmp_path / "central"
    result = runner.invoke(
        app,
        [
            "train-central",
            "--data",
            "demo",
            "--clients",
            "10",
            "--max-train-tokens",
            "8000",
            "--epochs",
            "2",
            "--max-eval-sentences",
            "100",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert {r["strategy"] for r in rows} == {"central"}
    assert rows[2]["test_ppl"] < rows[1]["test_ppl"] < rows[0]["test_ppl"]
    assert (out / "checkpoints" / "round_0002.safetensors").exists()


@pytest.mark.slow
def test_train_central_resumes_after_its_last_epoch(tmp_path):
    """A centralized run stopped during epoch 3 (checkpoint 2 written, its metrics row not)
    resumes with --resume to the weights of a run never stopped, without training epochs 1-2
    again; without --resume it starts afresh."""
    base = ["train-central", "--data", "demo", "--clients", "10", "--max-train-tokens", "6000"]
    base += ["--epochs", "3", "--max-eval-sentences", "50", "--ksr-sentences", "0"]

    def central(out, *extra):
        result = runner.invoke(app, [*base, "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return rows, result.output

    central(tmp_path / "straight")
    central(tmp_path / "resumed")
    (tmp_path / "resumed" / "checkpoints" / "round_0003.safetensors").unlink()
    metrics = tmp_path / "resumed" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))  # rows 0, 1
    rows, output = central(tmp_path / "resumed", "--resume")
    assert "resumed after epoch 2 of 3" in output
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    a, b = weights(tmp_path / "straight", 3), weights(tmp_path / "resumed", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows, output = central(tmp_path / "resumed")  # no --resume: from epoch 0
    assert "resumed after" not in output and [r["round"] for r in rows] == [0, 1, 2, 3]


@pytest.mark.slow
def test_train_central_lr_decay_lowers_each_epochs_lr(tmp_path):
    """--lr-decay d trains epoch e at lr * d^(e-1): epoch 1 is the constant-lr run's bit for bit,
    and at a tiny d epoch 2 barely moves the weights, where at lr it moves them a lot."""
    base = ["train-central", "--data", "demo", "--clients", "10", "--max-train-tokens", "6000"]
    base += ["--epochs", "2", "--max-eval-sentences", "20", "--ksr-sentences", "0", "--lr", "1"]
    for name, extra in (("constant", ()), ("decayed", ("--lr-decay", "1e-6"))):
        result = runner.invoke(app, [*base, "--out", str(tmp_path / name), *extra])
        assert result.exit_code == 0, result.output
    first = [weights(tmp_path / name, 1) for name in ("constant", "decayed")]
    assert all(torch.equal(first[0][k], first[1][k]) for k in first[0])

    def moved(name):
        a, b = weights(tmp_path / name, 1), weights(tmp_path / name, 2)
        return max((b[k].float() - a[k].float()).abs().max().item() for k in a)

    assert moved("decayed") < 1e-4 < 1e-2 < moved("constant")


@pytest.mark.slow
def test_column_batching_reports_the_seeds_measure_and_picks_the_best_round_by_it(tmp_path):
    small = ("--data", "demo", "--clients", "10", "--fraction", "0.3", "--workers", "0",
             "--max-train-tokens", "8000", *FAST)  # fmt: skip
    rows, _ = simulate(tmp_path / "run", *small, "--batching", "columns")
    assert all(r["col_val_ppl"] > 0 and r["col_test_ppl"] > 0 for r in rows)
    assert rows[-1]["col_test_ppl"] < rows[0]["col_test_ppl"]
    last = rows[-1]
    best = min(rows, key=lambda r: r["col_val_ppl"])
    assert last["best_round"] == best["round"]
    assert (last["best_col_test_ppl"], last["best_test_ppl"]) == (
        best["col_test_ppl"],
        best["test_ppl"],
    )
    plain, _ = simulate(tmp_path / "plain", *small, "--rounds", "1")
    assert "col_val_ppl" not in plain[-1] and "best_col_test_ppl" not in plain[-1]
