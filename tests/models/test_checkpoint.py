import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedkey.models.checkpoint import (
    CheckpointError,
    build_model,
    load_checkpoint,
    model_state,
    save_checkpoint,
)
from fedkey.models.config import ModelConfig
from fedkey.models.tokenizers import WordTokenizer

TOK = WordTokenizer.build(["see you later", "see you soon"])


def small(**kw):
    return ModelConfig(vocab_size=TOK.vocab_size, emb_size=8, hidden_size=8, **kw)


def test_round_trip_rebuilds_model_tokenizer_and_metadata(tmp_path):
    torch.manual_seed(0)
    cfg = small(cell="lstm", num_layers=2)
    model = build_model(cfg)
    path = save_checkpoint(
        tmp_path / "c.safetensors", model_state(model), cfg, TOK, round_idx=3, strategy="fedatt"
    )
    loaded, tok, meta = load_checkpoint(path)
    assert (meta["round"], meta["strategy"], meta["model"]["cell"]) == (3, "fedatt", "lstm")
    assert tok.itos == TOK.itos
    x = torch.tensor([[1, 3, 4]])
    torch.testing.assert_close(loaded.eval()(x)[0], model.eval()(x)[0])
    with safe_open(str(path), "pt") as f:  # the JSON config is readable without fedkey
        assert json.loads(f.metadata()["fedkey"])["tokenizer"]["kind"] == "word"
    assert not list(tmp_path.glob(".tmp-*"))  # the atomic write left no temp file


def test_tied_weight_is_stored_once(tmp_path):
    cfg = small()
    state = model_state(build_model(cfg))
    assert "decoder.weight" not in state and "embedding.weight" in state


def test_mismatched_tensors_fail_clearly(tmp_path):
    cfg = small()
    path = save_checkpoint(
        tmp_path / "c.safetensors",
        model_state(build_model(cfg)),
        cfg,
        TOK,
        round_idx=0,
        strategy="fedavg",
    )
    tensors = load_file(path)
    meta = safe_open(str(path), "pt").metadata()
    tensors["embedding.weight"] = torch.zeros(TOK.vocab_size, 9)
    save_file(tensors, path, metadata=meta)
    with pytest.raises(CheckpointError, match=r"embedding.weight.*\(.*9\).*expects"):
        load_checkpoint(path)
    del tensors["embedding.weight"]
    save_file(tensors, path, metadata=meta)
    with pytest.raises(CheckpointError, match="missing \\['embedding.weight'\\]"):
        load_checkpoint(path)


def test_not_a_checkpoint(tmp_path):
    save_file({"x": torch.zeros(1)}, tmp_path / "plain.safetensors")
    with pytest.raises(CheckpointError, match="not a fedkey checkpoint"):
        load_checkpoint(tmp_path / "plain.safetensors")


def test_public_bytes_drop_the_servers_private_memory(tmp_path):
    from safetensors.torch import load

    from fedkey.models.checkpoint import public_bytes

    cfg = small()
    state = model_state(build_model(cfg))
    path = save_checkpoint(
        tmp_path / "c.safetensors",
        state,
        cfg,
        TOK,
        round_idx=2,
        strategy="fedavg",
        extra={"server": {"strategy": {"scores": {"device-00": 0.5}}}},
    )
    data = public_bytes(path)
    (tmp_path / "p.safetensors").write_bytes(data)
    meta = json.loads(safe_open(str(tmp_path / "p.safetensors"), "pt").metadata()["fedkey"])
    assert "server" not in meta and meta["round"] == 2 and meta["tokenizer"]["kind"] == "word"
    assert all(torch.equal(load(data)[k], state[k]) for k in state)
