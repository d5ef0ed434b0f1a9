"""The base that ships with fedkey (`--init base`): its provenance (public text, the committed
recipe, a vocabulary built from the Chit-Chat pretraining senders alone), the recipe still
training (a reduced run of `fedkey pretrain --shipped`), and a federation starting from it."""

import hashlib
import json

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.models.base import SHIPPED, read_base
from fedkey.runners.pretrain import SHIPPED_EPOCHS, SHIPPED_RECIPE

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_shipped_base_names_public_text_and_the_committed_recipe():
    meta = read_base("base")
    pretrain = meta["pretrain"]
    assert pretrain["corpora"] == [SHIPPED_RECIPE["data"]]
    recipe = pretrain["recipe"]
    assert recipe["epochs"] == SHIPPED_EPOCHS and recipe["max_train_tokens"] is None
    for name in ("lr", "lr_decay", "batch_size"):
        assert recipe[name] == SHIPPED_RECIPE[name], name
    assert pretrain["vocabulary"]["max_size"] == SHIPPED_RECIPE["vocab_size"]
    assert meta["model"]["hidden_size"] == SHIPPED_RECIPE["hidden_size"]
    with safe_open(str(SHIPPED), framework="numpy") as f:  # fp16: half the bytes in the wheel
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"float16"}


def test_the_shipped_vocabulary_is_built_from_the_public_text_alone():
    from fedkey.common.config import DataConfig
    from fedkey.corpora.dataset import server_data

    # As fedkey pretrain reads it: one pool of the whole training text.
    data = DataConfig(data="chitchat", vocab_size=SHIPPED_RECIPE["vocab_size"], clients=1)
    _, tokenizer = server_data(data)
    assert read_base("base")["tokenizer"]["words"] == tokenizer.itos


def test_the_recipe_still_trains_and_a_changed_one_is_not_shipped(tmp_path):
    before = digest(SHIPPED)
    out = tmp_path / "base"
    shown = invoke(
        "pretrain", "--shipped", "--max-train-tokens", "3000", "--max-eval-sentences", "20",
        "--ksr-sentences", "0", "--hidden-size", "16", "--out", out,
    )  # fmt: skip
    assert "not shipped: --max-train-tokens" in shown
    assert digest(SHIPPED) == before
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(SHIPPED_EPOCHS + 1))
    assert rows[-1]["val_ppl"] < rows[0]["val_ppl"]
    recipe = read_base(out / "base.safetensors")["pretrain"]["recipe"]
    assert (recipe["lr"], recipe["lr_decay"]) == (SHIPPED_RECIPE["lr"], SHIPPED_RECIPE["lr_decay"])


def test_a_federation_starts_from_the_shipped_base(tmp_path):
    out = tmp_path / "run"
    invoke(
        "simulate", "--init", "base", "--data", "demo", "--clients", "2", "--fraction", "1",
        "--rounds", "1", "--local-epochs", "1", "--max-train-tokens", "500",
        "--max-eval-sentences", "10", "--ksr-sentences", "0", "--workers", "0",
        "--precision", "fp32", "--device", "cpu", "--out", out,
    )  # fmt: skip
    with safe_open(str(out / "checkpoints" / "round_0000.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["fedkey"])
    assert meta["tokenizer"] == read_base("base")["tokenizer"]


def test_a_missing_shipped_base_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr("fedkey.models.base.SHIPPED", tmp_path / "absent.safetensors")
    with pytest.raises(ValueError, match="fedkey pretrain --shipped"):
        read_base("base")
