import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from fedkey.export import onnx_export
from fedkey.export.metadata import load_metadata, read_embedded_metadata
from fedkey.export.onnx_export import ExportParityError, export_checkpoint
from fedkey.models.checkpoint import load_checkpoint

VARIANTS = [(c, n, t) for c in ("gru", "lstm") for n in (1, 2) for t in (True, False)]


def session(path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def feeds(cell, tokens, h, c=None):
    f = {"tokens": np.asarray(tokens, dtype=np.int64), "h0": h}
    if cell == "lstm":
        f["c0"] = c if c is not None else np.zeros_like(h)
    return f


@pytest.mark.parametrize("cell,layers,tied", VARIANTS)
def test_fp32_export_matches_pytorch(make_checkpoint, tmp_path, cell, layers, tied):
    ckpt = make_checkpoint(cell, layers, tied)
    report = export_checkpoint(ckpt, tmp_path / "model.onnx")
    assert report.parity_max_abs_diff <= 1e-4
    assert report.path.exists() and report.json_path == tmp_path / "model.json"
    assert report.bytes == report.path.stat().st_size and not report.int8
    assert not list(tmp_path.glob(".tmp-*"))

    sess = session(report.path)
    names_in = [i.name for i in sess.get_inputs()]
    names_out = [o.name for o in sess.get_outputs()]
    if cell == "lstm":
        assert (names_in, names_out) == (["tokens", "h0", "c0"], ["logprobs", "hn", "cn"])
    else:
        assert (names_in, names_out) == (["tokens", "h0"], ["logprobs", "hn"])

    # Shapes the export never saw: batch 5, time 13, from a random state.
    model, _, _ = load_checkpoint(ckpt)
    model.eval()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (5, 13), generator=gen)
    h = torch.randn(layers, 5, 16, generator=gen) * 0.5
    c = torch.randn(layers, 5, 16, generator=gen)
    with torch.no_grad():
        logits, state = model(tokens, h if cell == "gru" else (h, c))
    got = sess.run(None, feeds(cell, tokens.numpy(), h.numpy(), c.numpy()))
    np.testing.assert_allclose(got[0], torch.log_softmax(logits, -1).numpy(), atol=1e-4, rtol=0)
    hn = state if cell == "gru" else state[0]
    np.testing.assert_allclose(got[1], hn.numpy(), atol=1e-5, rtol=0)
    if cell == "lstm":
        np.testing.assert_allclose(got[2], state[1].numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_one_step_at_a_time_equals_whole_sequence(make_checkpoint, tmp_path, cell):
    """The keyboard's use: one token per run, the state fed back."""
    report = export_checkpoint(make_checkpoint(cell, 2, True), tmp_path / "m.onnx")
    sess = session(report.path)
    tokens = np.array([[1, 5, 9, 4, 30, 2], [1, 7, 7, 8, 3, 12]], dtype=np.int64)
    h = np.zeros((2, 2, 16), np.float32)
    full = sess.run(None, feeds(cell, tokens, h))
    state = [h, np.zeros_like(h)] if cell == "lstm" else [h]
    steps = []
    for t in range(tokens.shape[1]):
        out = sess.run(None, feeds(cell, tokens[:, t : t + 1], *state))
        steps.append(out[0])
        state = out[1:]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full[0], atol=1e-5, rtol=0)
    for a, b in zip(state, full[1:], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_tied_embedding_is_stored_once(make_checkpoint, tmp_path, demo):
    vocab = demo["tok"].vocab_size
    for int8 in (False, True):
        report = export_checkpoint(make_checkpoint("gru", 1, True), tmp_path / "m.onnx", int8=int8)
        big = [
            i
            for i in onnx.load(str(report.path)).graph.initializer
            if len(i.dims) == 2 and vocab in i.dims
        ]
        assert len(big) == 1 and list(big[0].dims) == [16, vocab], [i.name for i in big]
    untied = export_checkpoint(make_checkpoint("gru", 1, False), tmp_path / "u.onnx")
    assert untied.fp32_bytes > report.fp32_bytes + 0.9 * vocab * 16 * 4


def test_metadata_round_trips(make_checkpoint, tmp_path):
    report = export_checkpoint(make_checkpoint("lstm", 1, True), tmp_path / "kb.onnx", int8=True)
    side = json.loads(report.json_path.read_text())
    embedded = read_embedded_metadata(report.path)
    assert side == embedded == load_metadata(report.path)
    _, tok, _ = load_checkpoint(make_checkpoint("lstm", 1, True))
    assert side["format"] == "fedkey-onnx-1" and side["int8"] is True
    assert side["model"]["cell"] == "lstm" and side["model"]["hidden_size"] == 16
    assert side["tokenizer"] == tok.to_config()
    assert (side["round"], side["strategy"]) == (7, "fedatt")
    assert side["metrics"] == {"val_ppl": 123.4, "test_ppl": 130.5}
    assert (side["data"], side["best_round"]) == (None, None)  # the row records neither
    assert "server" not in side
    assert side["inputs"] == ["tokens", "h0", "c0"] and side["outputs"] == ["logprobs", "hn", "cn"]
    assert side["export"]["parity_max_abs_diff"] == report.parity_max_abs_diff
    report.json_path.unlink()  # without the file beside, the ONNX metadata answers
    assert load_metadata(report.path) == embedded


def test_metadata_reader_does_not_import_torch(tmp_path):
    code = "import sys, fedkey.export.metadata; assert 'torch' not in sys.modules, 'torch imported'"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def test_json_is_written_after_the_model(make_checkpoint, tmp_path, monkeypatch):
    order = []
    real = onnx_export._atomic_write
    monkeypatch.setattr(
        onnx_export, "_atomic_write", lambda p, d: (order.append(p.suffix), real(p, d))
    )
    export_checkpoint(make_checkpoint("gru", 1, True), tmp_path / "m.onnx")
    assert order == [".onnx", ".json"]


def test_broken_export_raises_and_writes_nothing(make_checkpoint, tmp_path, monkeypatch):
    real = onnx_export._to_onnx

    def perturbed(model, opset=17):
        proto = real(model, opset)
        for init in proto.graph.initializer:  # nudge a recurrent weight: wrong, but loads fine
            if init.name.startswith("onnx::GRU"):
                arr = onnx.numpy_helper.to_array(init).copy()
                arr.flat[0] += 0.5
                init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
                break
        else:
            raise AssertionError("no GRU weight found")
        return proto

    monkeypatch.setattr(onnx_export, "_to_onnx", perturbed)
    with pytest.raises(ExportParityError, match="max abs diff"):
        export_checkpoint(make_checkpoint("gru", 1, True), tmp_path / "m.onnx", int8=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cell,tied", [("gru", True), ("gru", False), ("lstm", True)])
def test_int8_is_smaller_and_agrees(make_checkpoint, tmp_path, demo, cell, tied):
    held_out = demo["held_out"]
    ckpt = make_checkpoint(cell, 1, tied)
    report = export_checkpoint(ckpt, tmp_path / "q.onnx", int8=True, parity_text=held_out)
    assert report.int8 and report.bytes < report.fp32_bytes
    ops = {n.op_type for n in onnx.load(str(report.path)).graph.node}
    assert "MatMulInteger" in ops and "DequantizeLinear" in ops  # decoder and embedding
    assert ("DynamicQuantizeLSTM" in ops) == (cell == "lstm")
    assert report.top1_agreement >= 0.8
    assert np.isfinite(report.held_out_ppl_fp32) and np.isfinite(report.held_out_ppl_int8)
    assert abs(report.held_out_ppl_int8 / report.held_out_ppl_fp32 - 1) < 0.05

    # The onnxruntime fp32 perplexity is fedkey.models.metrics.evaluate's number.
    from fedkey.models.metrics import evaluate

    model, tok, _ = load_checkpoint(ckpt)
    assert report.held_out_ppl_fp32 == pytest.approx(evaluate(model, tok, held_out)["ppl"], 1e-4)

    sess = session(report.path)
    out = sess.run(None, feeds(cell, [[1, 4, 5]], np.zeros((1, 1, 16), np.float32)))
    assert out[0].shape == (1, 3, demo["tok"].vocab_size)
    meta = load_metadata(report.path)
    assert meta["int8"] and meta["export"]["held_out_ppl_int8"] == report.held_out_ppl_int8


def test_rejects_output_without_onnx_suffix(make_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=".onnx"):
        export_checkpoint(make_checkpoint("gru", 1, True), tmp_path / "model.bin")


def test_metadata_names_the_corpus_and_the_best_round():
    """The metrics row's corpus ("data") and best round reach the export's metadata; other row
    fields and a value of the wrong type do not."""
    from fedkey.export.onnx_export import public_metadata

    base = {"model": {}, "tokenizer": {}, "round": 12, "strategy": "fedatt"}
    row = {"round": 12, "data": "nus-sms", "best_round": 12, "val_ppl": 80.0, "top1": 0.2}
    meta = public_metadata({**base, "metrics": row})
    assert (meta["data"], meta["best_round"]) == ("nus-sms", 12)
    assert meta["metrics"] == {"val_ppl": 80.0}
    odd = public_metadata({**base, "metrics": {"data": 3, "best_round": "12"}})
    assert (odd["data"], odd["best_round"]) == (None, None)
