"""`fedkey pretrain` end to end on a small Chit-Chat dataset: a base model of public text only,
whose metadata says what it is, and a run that resumes as if never stopped."""

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.corpora import chitchat
from fedkey.corpora.loaders import load_corpus
from fedkey.models.checkpoint import read_metadata
from fedkey.models.tokenizers import BOS, EOS, UNK
from fedkey.testing.pretrain import chitchat_json

runner = CliRunner()
TINY = ["--hidden-size", "16", "--vocab-size", "200", "--max-eval-sentences", "40",
        "--ksr-sentences", "0", "--lr", "0.5", "--device", "cpu"]  # fmt: skip


@pytest.fixture
def public(tmp_path, monkeypatch):
    """The small dataset, read by `--data chitchat` in place of the installed one."""
    path = chitchat_json(tmp_path / "dataset.json")
    monkeypatch.setattr(chitchat, "dataset_path", lambda: path)
    return path


def pretrain(out, *args):
    result = runner.invoke(app, ["pretrain", *TINY, *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_base_names_its_corpus_and_knows_no_private_word(tmp_path, public):
    output = pretrain(tmp_path / "base", "--epochs", "1")
    base = tmp_path / "base" / "base.safetensors"
    assert f"--init {base}" in output
    meta = read_metadata(base)
    about = meta["pretrain"]
    assert about["corpora"] == ["chitchat"] and "server" not in meta
    words = meta["tokenizer"]["words"]
    assert about["vocabulary"]["size"] == len(words) == meta["model"]["vocab_size"]
    recipe = about["recipe"]
    assert (recipe["epochs"], recipe["lr"], recipe["batch_size"], recipe["seed"]) == (1, 0.5, 10, 0)
    assert recipe["model"]["hidden_size"] == 16
    public_words = {w for m in chitchat.read_messages(public) for w in m.text.split()}
    private = {w for s in load_corpus("demo").train for w in s.split()} - public_words
    assert "buzzing" in private  # the demo's phones say it; the public chat never does
    assert set(words) - {UNK, BOS, EOS} <= public_words
    assert not private & set(words)


def test_pretrain_resumes_as_if_never_stopped(tmp_path, public):
    pretrain(tmp_path / "stopped", "--epochs", "1")
    output = pretrain(tmp_path / "stopped", "--epochs", "2", "--resume")
    assert "resumed after epoch 1 of 2" in output
    pretrain(tmp_path / "straight", "--epochs", "2")
    resumed, straight = (
        load_file(tmp_path / run / "base.safetensors") for run in ("stopped", "straight")
    )
    assert resumed.keys() == straight.keys()
    assert all((resumed[k] == straight[k]).all() for k in resumed)
    assert (
        read_metadata(tmp_path / "stopped" / "base.safetensors")["pretrain"]["recipe"]["epochs"]
        == 2
    )


@pytest.mark.parametrize("private", ["nus-sms", "chitchat-heldout"])
def test_the_phones_text_is_refused_in_one_line(tmp_path, private):
    result = runner.invoke(app, ["pretrain", "--data", private, "--out", str(tmp_path)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {private}: a base model learns")
