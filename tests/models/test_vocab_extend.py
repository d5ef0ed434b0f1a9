"""A base extended with new words (fedkey.models.vocab_extend): before fine-tuning it scores the
base's words exactly as the base did, the new words share <unk>'s probability, and the result is a
base checkpoint like any other."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from fedkey.models.base import read_base
from fedkey.models.checkpoint import build_model, initial_state, load_checkpoint, save_checkpoint
from fedkey.models.config import ModelConfig
from fedkey.models.metrics import evaluate, token_log_probs
from fedkey.models.tokenizers import EOS, UNK, SentencePieceTokenizer, WordTokenizer
from fedkey.models.vocab_extend import extend_base, extend_tokenizer, oov_rate

WORDS = "i am at home see you later ok , ?".split()
NEW = ["lor", "tmr", "lah"]
TEXT = ["see you later lor", "i am at home ok", "ok see you tmr lah ?", "i am at xyz"]
NOTE = {"epsilon": 4.0, "delta": 1e-3, "phones": 30}


def write_base(path, tied: bool = True, dtype=torch.float32):
    torch.manual_seed(0)
    tok = WordTokenizer.build([" ".join(WORDS)], max_size=None)
    config = ModelConfig(vocab_size=tok.vocab_size, emb_size=8, hidden_size=8, tied=tied)
    model = build_model(config)
    with torch.no_grad():
        model.decoder.bias.normal_()  # a bias that is not zero, as a trained one
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if tied:
        state.pop("decoder.weight")
    save_checkpoint(path, state, config, tok, round_idx=0, strategy="pretrain",
                    extra={"pretrain": {"corpora": ["chitchat"]}})  # fmt: skip
    return path


def log_probs(path, sentences):
    model, tok, _ = load_checkpoint(path)
    model.float()
    return tok, [(t, lp) for t, lp in token_log_probs(model, tok, sentences, batch_size=64)]


@pytest.mark.parametrize("tied", [True, False])
def test_the_extended_model_scores_the_bases_words_exactly_as_the_base(tmp_path, tied):
    base = write_base(tmp_path / "base.safetensors", tied)
    out = extend_base(base, tmp_path / "new.safetensors", NEW, NOTE)
    old_tok, old = log_probs(base, TEXT)
    new_tok, new = log_probs(out, TEXT)
    (old_t, old_lp), (new_t, new_lp) = old[0], new[0]
    assert new_lp.shape[1] == old_lp.shape[1] + len(NEW)
    n = old_tok.vocab_size
    known = (old_t != old_tok.unk_id).nonzero().squeeze(1)
    # Every word of the base, after every context (the new words read as <unk> was): unchanged.
    torch.testing.assert_close(new_lp[:, 1:n], old_lp[:, 1:n], atol=1e-5, rtol=0)
    torch.testing.assert_close(new_lp[known, new_t[known]], old_lp[known, old_t[known]])
    # <unk> and the new words share <unk>'s old probability equally.
    shared = torch.logsumexp(new_lp[:, [0, *range(n, n + len(NEW))]], dim=1)
    torch.testing.assert_close(shared, old_lp[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        new_lp[:, n], old_lp[:, 0] - math.log(len(NEW) + 1), atol=1e-5, rtol=0
    )
    # On text without the new words (nor any other unknown word), the same perplexity.
    clean = ["see you later", "i am at home ok ?"]
    before, after = (evaluate(*load_checkpoint(p)[:2], clean) for p in (base, out))
    assert after["ppl"] == pytest.approx(before["ppl"], rel=1e-5)
    assert after["bar_top1"] == before["bar_top1"]


def test_the_extended_base_is_a_base_that_init_takes(tmp_path):
    base = write_base(tmp_path / "base.safetensors")
    out = extend_base(base, tmp_path / "new.safetensors", NEW, NOTE)
    meta = read_base(out)
    words = meta["tokenizer"]["words"]
    assert words[: len(words) - 3] == read_base(base)["tokenizer"]["words"] and words[-3:] == NEW
    assert meta["model"]["vocab_size"] == len(words)
    assert meta["pretrain"] == {"corpora": ["chitchat"]}  # the rest of the metadata unchanged
    assert meta["vocabulary"] == [{**NOTE, "added": NEW, "size_before": len(words) - 3}]
    state = initial_state(ModelConfig(**meta["model"]), out)
    assert state["embedding.weight"].shape[0] == len(words)
    torch.testing.assert_close(state["embedding.weight"][-1], state["embedding.weight"][0])
    # A second extension keeps the first's note.
    again = extend_base(out, tmp_path / "again.safetensors", ["leh"], {"epsilon": 1.0})
    assert [n["added"] for n in read_base(again)["vocabulary"]] == [NEW, ["leh"]]


def test_a_half_precision_base_stays_half(tmp_path):
    base = write_base(tmp_path / "base.safetensors", dtype=torch.float16)
    out = extend_base(base, tmp_path / "new.safetensors", NEW, NOTE)
    assert {v.dtype for v in load_file(out).values()} == {torch.float16}


def test_words_already_known_repeated_or_spaced_are_refused(tmp_path):
    tok = WordTokenizer.build(WORDS, max_size=None)
    for words, message in ((["home"], "already"), (["lor", "lor"], "repeat"), (["a b"], "single")):
        with pytest.raises(ValueError, match=message):
            extend_tokenizer(tok, words)


def test_a_sentencepiece_base_is_refused_in_one_line(tmp_path):
    sp = SentencePieceTokenizer.train([" ".join(WORDS)] * 50, vocab_size=30)
    config = ModelConfig(vocab_size=sp.vocab_size, emb_size=8, hidden_size=8)
    path = tmp_path / "sp.safetensors"
    state = build_model(config).state_dict()
    state.pop("decoder.weight")
    save_checkpoint(path, state, config, sp, round_idx=0, strategy="pretrain")
    with pytest.raises(ValueError, match="SentencePiece base") as e:
        extend_base(path, tmp_path / "new.safetensors", NEW, NOTE)
    assert "\n" not in str(e.value)


def test_the_oov_rate_is_the_share_of_real_words_that_are_unk():
    tok = WordTokenizer.build(WORDS, max_size=None)
    assert tok.itos[:3] == [UNK, "<s>", EOS]
    # 4 + 5 + 6 + 4 words (</s> not counted); "lor", "tmr", "lah", "xyz" unknown.
    assert oov_rate(tok, TEXT) == pytest.approx(4 / 19)
    assert oov_rate(extend_tokenizer(tok, NEW), TEXT) == pytest.approx(1 / 19)
    assert oov_rate(tok, []) is None
