"""`--init BASE` fixes the model and its vocabulary: an option that contradicts the base, or a
base that is missing or no checkpoint, is one line before anything starts."""

import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.models.checkpoint import read_metadata
from fedkey.server.settings import Settings
from fedkey.testing.pretrain import tiny_base

runner = CliRunner()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("base"))


def error_line(args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("command", [["simulate", "--out"], ["server", "--storage"],
                                     ["run", "--out"], ["train-central", "--out"]])  # fmt: skip
def test_an_option_that_contradicts_the_base_is_refused(tmp_path, base, command):
    line = error_line([*command, tmp_path, "--init", base, "--cell", "lstm", "--vocab-size", 50])
    size = read_metadata(base)["model"]["vocab_size"]
    assert line == (
        f"error: --init {base} fixes the model and its vocabulary: drop --cell lstm (the base's: "
        f"--cell gru); --vocab-size 50 (the base's: --vocab-size {size})"
    )


def test_the_size_of_a_preset_and_an_other_tokenizer_are_refused(tmp_path, base):
    args = ["simulate", "--out", tmp_path, "--init", base, "--model", "small", "--untied"]
    line = error_line([*args, "--tokenizer", "sentencepiece"])
    assert "drop --model small (size 300) (the base's: --hidden-size 16); --untied (the base's: " \
        "--tied); --tokenizer sentencepiece (the base's: --tokenizer word)" in line  # fmt: skip


def test_a_missing_or_foreign_base_is_one_line(tmp_path):
    missing = tmp_path / "nope.safetensors"
    line = error_line(["simulate", "--out", tmp_path, "--init", missing])
    assert line == f"error: --init {missing}: no such file (a checkpoint of fedkey pretrain)"
    foreign = tmp_path / "notes.safetensors"
    foreign.write_text("not a checkpoint")
    line = error_line(["simulate", "--out", tmp_path, "--init", foreign])
    assert line == f"error: --init {foreign}: not a fedkey checkpoint"


def test_options_that_agree_with_the_base_and_dropout_are_taken(base):
    size = read_metadata(base)["model"]["vocab_size"]
    assert size < 200  # the small dataset's words, below the --vocab-size 200 it was asked
    for asked in (size, 200):
        settings = Settings(init=str(base), cell="gru", vocab_size=asked, dropout=0.2)
        config = settings.build_model_config(10_000)  # the vocabulary's size is the base's
        assert (config.vocab_size, config.hidden_size, config.dropout) == (size, 16, 0.2)
    assert Settings(init=str(base)).build_model_config(10_000).dropout == 0.0
