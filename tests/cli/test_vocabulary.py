"""`fedkey vocabulary discover`: the words released, the release's (epsilon, delta) and the
out-of-vocabulary rate before and after in one table; bad input in one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.models.base import read_base
from fedkey.testing.vocabulary import SECRET, SLANG, phones_corpus, write_base

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-cli")
    return write_base(root / "base.safetensors"), phones_corpus(root / "phones.jsonl")


def table(text: str) -> dict[str, str]:
    """The printed table's rows: label -> value."""
    cells = [line.split("│")[1:3] for line in text.splitlines() if line.startswith("│")]
    return {label.strip(): value.strip() for label, value in cells}


def discover(*args):
    return runner.invoke(app, ["vocabulary", "discover", *map(str, args)])


def test_discover_prints_the_release_and_writes_the_extended_base(setup, tmp_path):
    base, corpus = setup
    out = tmp_path / "new.safetensors"
    result = discover("--init", base, "--data", corpus, "--clients", 40, "--epsilon", 8,
                      "--delta", 1e-9, "-k", 2, "--out", out, "--no-progress")  # fmt: skip
    assert result.exit_code == 0, result.output
    text = result.output
    rows = table(text)
    assert (rows["epsilon"], rows["delta"], rows["phones"]) == ("8", "1e-09", "40")
    assert rows["words released"] == "2"
    test = next(
        value for label, value in rows.items() if label.startswith("out of vocabulary, test")
    )
    before, after = (float(x.strip(" %")) for x in test.split("->"))
    assert before > after
    listing = text.split("released (noisy phone counts):")[1]
    assert all(f"{w} (" in listing for w in SLANG) and SECRET not in text
    assert f"--init {out}" in text
    assert read_base(out)["tokenizer"]["words"][-2:] in (list(SLANG), list(SLANG)[::-1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clients", 40, "--epsilon", 1], "error: --init is required"),
        (["--init", "BASE", "--clients", 40, "--epsilon", 0], "error: --epsilon 0.0: must be > 0"),
        (
            ["--init", "BASE", "--clients", 40, "--epsilon", -2],
            "error: --epsilon -2.0: must be > 0",
        ),
        (["--init", "SP", "--clients", 40, "--epsilon", 1], "SentencePiece base"),
        (["--init", "BASE", "--epsilon", 1], "error: Missing option '--clients'"),
    ],
)
def test_bad_input_is_one_line(setup, tmp_path, monkeypatch, args, message):
    monkeypatch.delenv("FEDKEY_INIT", raising=False)
    base, corpus = setup
    sp = write_base(tmp_path / "sp.safetensors", kind="sentencepiece")
    named = {"BASE": str(base), "SP": str(sp)}
    args = [named.get(str(a), a) for a in args]
    result = discover(*args, "--data", corpus, "--out", tmp_path / "new.safetensors")
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "new.safetensors").exists()
