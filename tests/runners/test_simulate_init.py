"""`--init`: a federation (simulate, train-central) starts from a base model of public text: round
0 holds the base's weights and scores as the base does, the phones' text is encoded with the
base's vocabulary, and a run started so resumes."""

import json

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.models.checkpoint import read_metadata
from fedkey.testing.pretrain import tiny_base

runner = CliRunner()
DATA = ["--data", "demo", "--max-eval-sentences", "20", "--ksr-sentences", "0",
        "--precision", "fp32", "--device", "cpu"]  # fmt: skip
PHONES = [*DATA, "--clients", "4", "--max-train-tokens", "1500", "--lr", "0.5"]
ROUNDS = [*PHONES, "--fraction", "1", "--local-epochs", "1", "--workers", "0"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("base"))


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def rows_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_simulate_starts_from_the_base_with_its_vocabulary_and_resumes(tmp_path, base):
    out = tmp_path / "run"
    invoke("simulate", "--init", base, "--rounds", "1", *ROUNDS, "--out", out)
    first = out / "checkpoints" / "round_0000.safetensors"
    start, weights = load_file(first), load_file(base)
    assert start.keys() == weights.keys() and all((start[k] == weights[k]).all() for k in start)
    for key in ("tokenizer", "model"):  # the base's vocabulary encodes the phones' text
        assert read_metadata(first)[key] == read_metadata(base)[key]
    scored = json.loads(invoke("evaluate", base, *DATA, "--json"))
    row0 = rows_of(out)[0]
    for key in ("val_ppl", "test_ppl", "top1", "top3"):
        assert row0[key] == pytest.approx(scored[key], rel=1e-9), key
    invoke("simulate", "--init", base, "--rounds", "2", "--resume", *ROUNDS, "--out", out)
    rows = rows_of(out)
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[0] == row0
    assert rows[2]["val_ppl"] < row0["val_ppl"]


def test_train_central_starts_from_the_base(tmp_path, base):
    out = tmp_path / "central"
    invoke("train-central", "--init", base, "--epochs", "1", *PHONES, "--out", out)
    scored = json.loads(invoke("evaluate", base, *DATA, "--json"))
    assert rows_of(out)[0]["val_ppl"] == pytest.approx(scored["val_ppl"], rel=1e-9)
