"""An export that mixes in an n-gram: the file beside the model, its entry in the metadata, the
weight (given, measured in the metrics row, chosen on held-out text, or 0.5), a vocabulary that
does not match refused before anything is written, and `fedkey export --ngram`."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.export import onnx_export
from fedkey.export.metadata import load_metadata
from fedkey.export.onnx_export import export_checkpoint
from fedkey.models.checkpoint import load_checkpoint, model_state, save_checkpoint
from fedkey.models.mixture import GRID
from fedkey.models.ngram import KneserNey
from fedkey.models.personal import DEFAULTS
from fedkey.models.tokenizers import WordTokenizer


@pytest.fixture(scope="module")
def ngram_file(demo, tmp_path_factory):
    tok = demo["tok"]
    lm = KneserNey(tok, order=3).fit(tok.encode(s) for s in demo["train"])
    return lm.save(
        tmp_path_factory.mktemp("ngram") / "kn.safetensors", corpus="demo, 400 sentences"
    )


def with_row(checkpoint, tmp_path, **row):
    """The checkpoint again, its metrics row extended by `row`."""
    model, tok, meta = load_checkpoint(checkpoint)
    path = tmp_path / "row.safetensors"
    metrics = {**meta["metrics"], **row}
    save_checkpoint(path, model_state(model), model.config, tok, round_idx=7,
                    strategy="fedatt", extra={"metrics": metrics})  # fmt: skip
    return path


def test_the_ngram_is_copied_beside_the_model_and_named_in_the_metadata(
    make_checkpoint, ngram_file, tmp_path, monkeypatch
):
    order = []
    real = onnx_export._atomic_write
    monkeypatch.setattr(
        onnx_export, "_atomic_write", lambda p, d: (order.append(p.name), real(p, d))
    )
    out = tmp_path / "kb" / "model.onnx"
    report = export_checkpoint(make_checkpoint(), out, ngram=ngram_file, ngram_weight=0.3)
    assert order == ["model.onnx", "model.ngram.safetensors", "model.json"]  # the .json last
    copied = out.parent / "model.ngram.safetensors"
    assert copied.read_bytes() == ngram_file.read_bytes()
    meta = load_metadata(out)
    entry = meta["ngram"]
    assert entry == report.ngram
    assert entry["file"] == "model.ngram.safetensors"
    assert entry["sha256"] == hashlib.sha256(copied.read_bytes()).hexdigest()
    assert (entry["weight"], entry["weight_source"]) == (0.3, "argument")
    assert (entry["order"], entry["corpus"], entry["min_count"]) == (3, "demo, 400 sentences", 1)
    assert entry["bytes"] == copied.stat().st_size and entry["held_out_ppl"] is None
    assert meta["personal"] == DEFAULTS


def test_without_an_ngram_the_metadata_has_none_but_the_personal_parameters(
    make_checkpoint, tmp_path
):
    out = tmp_path / "model.onnx"
    export_checkpoint(make_checkpoint(), out)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert "ngram" not in meta and meta["personal"] == DEFAULTS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.onnx"]


def test_the_weight_comes_from_the_row_else_held_out_text_else_one_half(
    make_checkpoint, ngram_file, demo, tmp_path
):
    measured = with_row(make_checkpoint(), tmp_path, ngram_weight=0.65)
    entry = export_checkpoint(measured, tmp_path / "a.onnx", ngram=ngram_file).ngram
    assert (entry["weight"], entry["weight_source"]) == (0.65, "metrics_row")

    # A row published without it (under DP, public_row keeps held-out scores out): not used.
    def public(row):
        return {k: v for k, v in row.items() if k != "ngram_weight"}

    entry = export_checkpoint(measured, tmp_path / "p.onnx", ngram=ngram_file, metrics=public).ngram
    assert (entry["weight"], entry["weight_source"]) == (0.5, "default")

    held_out = demo["held_out"][:60]
    entry = export_checkpoint(
        make_checkpoint(), tmp_path / "b.onnx", ngram=ngram_file, weight_text=held_out
    ).ngram
    assert entry["weight_source"] == "validation" and entry["weight"] in GRID
    # The chosen weight is the grid's best: recompute the perplexity at every weight.
    tok = demo["tok"]
    lm = KneserNey.load(ngram_file, tok)
    model, _, _ = load_checkpoint(make_checkpoint())
    seqs = [tok.encode(s) for s in held_out]
    nn, kn = _targets(model, lm, seqs)
    ppls = {w: float(np.exp(-np.log(w * np.exp(nn) + (1 - w) * kn).mean())) for w in GRID}
    assert entry["held_out_ppl"] == pytest.approx(min(ppls.values()), rel=1e-4)
    assert ppls[entry["weight"]] == pytest.approx(min(ppls.values()), rel=1e-4)

    entry = export_checkpoint(make_checkpoint(), tmp_path / "c.onnx", ngram=ngram_file).ngram
    assert (entry["weight"], entry["weight_source"]) == (0.5, "default")


def _targets(model, lm, seqs):
    """The PyTorch model's log-probabilities and the n-gram's probabilities of the targets."""
    import torch

    nn, kn = [], []
    with torch.no_grad():
        for ids in seqs:
            logits, _ = model(torch.tensor([ids[:-1]]), model.init_state(1))
            logp = torch.log_softmax(logits[0], -1).numpy().astype(np.float64)
            rows = np.arange(len(ids) - 1)
            nn.append(logp[rows, ids[1:]])
            kn.append(np.exp(lm.sentence_log_probs(ids)[rows, ids[1:]]))
    return np.concatenate(nn), np.concatenate(kn)


def test_an_ngram_of_another_vocabulary_is_refused_before_anything_is_written(
    make_checkpoint, demo, tmp_path
):
    other = WordTokenizer.build(demo["train"][:50])
    path = (
        KneserNey(other)
        .fit(other.encode(s) for s in demo["train"][:50])
        .save(tmp_path / "other.safetensors", corpus="c")
    )
    out = tmp_path / "out" / "model.onnx"
    with pytest.raises(ValueError, match="another vocabulary"):
        export_checkpoint(make_checkpoint(), out, ngram=path)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        export_checkpoint(make_checkpoint(), out, ngram=path, ngram_weight=1.5)
    assert not out.parent.exists()


def test_fedkey_export_ngram(make_checkpoint, ngram_file, tmp_path):
    out = tmp_path / "model.onnx"
    args = ["export", "--checkpoint", str(make_checkpoint()), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--ngram", str(ngram_file)])
    assert result.exit_code == 0, result.output
    # No weight in the checkpoint's row: the best on --data's validation split (never its test).
    assert load_metadata(out)["ngram"]["weight_source"] == "validation"
    assert (tmp_path / "model.ngram.safetensors").exists()
    given = [*args, "--ngram", str(ngram_file), "--ngram-weight", "0.3"]
    assert CliRunner().invoke(app, given).exit_code == 0
    assert (
        load_metadata(out)["ngram"]["weight"],
        load_metadata(out)["ngram"]["weight_source"],
    ) == (
        0.3,
        "argument",
    )
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 20)
    result = CliRunner().invoke(app, [*args, "--ngram", str(bad)])
    assert result.exit_code != 0 and "bad.safetensors" in result.output
