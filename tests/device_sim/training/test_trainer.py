import gc
import os
import subprocess
import sys
import weakref
from dataclasses import replace

import pytest
import torch

from fedkey.common.config import TrainConfig
from fedkey.device_sim.training.trainer import resolve_device, train_local
from fedkey.models.checkpoint import build_model, model_state
from fedkey.models.config import ModelConfig
from fedkey.models.metrics import evaluate
from fedkey.models.tokenizers import WordTokenizer

TEXT = ["see you later", "see you soon", "on my way home", "see you at the station"] * 10
TOK = WordTokenizer.build(TEXT)
CFG = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)


def initial_state():
    torch.manual_seed(0)
    return model_state(build_model(CFG))


def test_training_lowers_loss_and_reports_tokens():
    seqs = [TOK.encode(s) for s in TEXT]
    state = initial_state()
    before = evaluate(build_model(CFG, state), TOK, TEXT)["ppl"]
    res = train_local(
        CFG, state, seqs, TrainConfig(epochs=3, batch_size=4, lr=0.5), seed=1, device="cpu"
    )
    after = evaluate(build_model(CFG, res.state), TOK, TEXT)["ppl"]
    assert after < before / 2
    assert res.num_tokens == sum(len(s.split()) + 1 for s in TEXT)
    assert 0 < res.train_loss < 10
    assert set(res.state) == set(state)
    assert not torch.equal(res.state["embedding.weight"], state["embedding.weight"])


def test_same_seed_same_weights_other_seed_differs():
    seqs = [TOK.encode(s) for s in TEXT]
    cfg = TrainConfig(epochs=1, batch_size=3, lr=0.1)
    a = train_local(CFG, initial_state(), seqs, cfg, seed=7, device="cpu")
    b = train_local(CFG, initial_state(), seqs, cfg, seed=7, device="cpu")
    c = train_local(CFG, initial_state(), seqs, cfg, seed=8, device="cpu")
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert not torch.equal(a.state["rnn.weight_hh_l0"], c.state["rnn.weight_hh_l0"])


def test_long_sentences_are_chunked_not_dropped():
    long = " ".join(["see you later"] * 60)  # 180 words > max_len
    res = train_local(
        CFG,
        initial_state(),
        [TOK.encode(long)],
        TrainConfig(epochs=1, max_len=50),
        seed=0,
        device="cpu",
    )
    assert res.num_tokens == 181


def test_padding_changes_nothing_the_phone_learns():
    # The trainer runs the softmax on the real words only (LanguageModel.logits_at); one step
    # on a batch of unequal sentences must equal the plain loop's over the padded batch.
    from fedkey.models.batching import IGNORE, pad_batch

    seqs = [TOK.encode(s) for s in ("see you", "on my way home", "see you at the station")]
    state = initial_state()
    cfg = TrainConfig(
        epochs=1, batch_size=len(seqs), lr=0.5, momentum=0.0, clip=0.0, precision="fp32"
    )
    ours = train_local(CFG, state, seqs, cfg, seed=0, device="cpu").state
    model = build_model(CFG, state)
    inputs, targets = pad_batch(seqs)
    assert (targets == IGNORE).any()  # the batch has padding
    logits, _ = model(inputs)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE
    )
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.detach() - 0.5 * p.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_optimizer_gives_the_same_weights_bit_for_bit(monkeypatch, precision):
    # The paper bench resumes runs begun before the trainer took the fused SGD kernel: every
    # step (momentum, clipping, a large lr) must leave exactly the weights the default one did.
    import fedkey.device_sim.training.trainer as trainer

    seqs = [TOK.encode(s) for s in TEXT] * 3
    cfg = TrainConfig(epochs=2, batch_size=4, lr=3.0, momentum=0.5, precision=precision)
    fused = train_local(CFG, initial_state(), seqs, cfg, seed=5, device="cpu")
    monkeypatch.setattr(trainer, "FUSED_SGD_DEVICES", ())
    default = train_local(CFG, initial_state(), seqs, cfg, seed=5, device="cpu")
    assert fused.train_loss == default.train_loss
    for name, weight in default.state.items():
        assert torch.equal(fused.state[name], weight), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_reused_model_trains_bit_for_bit_as_a_new_one(monkeypatch, precision):
    # A thread trains each phone on the model it trained the last one on (no new random
    # initialization to overwrite): every phone's weights and loss must be exactly those of a
    # model built for it, as before, and one phone's upload must not change when the next trains.
    import fedkey.device_sim.training.trainer as trainer

    seqs = [TOK.encode(s) for s in TEXT]
    cfg = TrainConfig(epochs=2, batch_size=4, lr=1.0, momentum=0.5, precision=precision)
    phones = [(seqs[:15], 3), (seqs[10:], 4), (seqs[:15], 3)]  # the first phone twice

    def round_of_three():
        return [train_local(CFG, initial_state(), s, cfg, seed=k, device="cpu") for s, k in phones]

    reused = round_of_three()
    monkeypatch.setattr(trainer, "REUSE_MODELS", False)
    built = round_of_three()
    assert trainer._reused.model.config == CFG  # the first round did reuse this thread's model
    for a, b in zip(reused, built, strict=True):
        assert a.train_loss == b.train_loss
        for name, weight in b.state.items():
            assert torch.equal(a.state[name], weight), name
    assert all(torch.equal(reused[0].state[k], reused[2].state[k]) for k in reused[0].state)


def test_with_dropout_each_phone_gets_a_new_model_and_its_old_masks(monkeypatch):
    # Building a model moves torch's generator, which the dropout masks draw from: with dropout a
    # phone must keep getting a new model, so its masks and weights stay what they were.
    import fedkey.device_sim.training.trainer as trainer

    drop = replace(CFG, dropout=0.3)
    seqs = [TOK.encode(s) for s in TEXT]
    cfg = TrainConfig(epochs=1, batch_size=4, lr=1.0)
    state = model_state(build_model(drop))
    cpu = torch.device("cpu")
    assert trainer.phone_model(drop, state, cpu) is not trainer.phone_model(drop, state, cpu)
    got = [train_local(drop, state, seqs, cfg, seed=k, device="cpu").state for k in (9, 9)]
    monkeypatch.setattr(trainer, "REUSE_MODELS", False)
    built = train_local(drop, state, seqs, cfg, seed=9, device="cpu").state
    for name, weight in built.items():
        assert torch.equal(got[0][name], weight) and torch.equal(got[1][name], weight), name


def test_cuda_request_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"


def test_column_batching_trains_on_the_seeds_columns():
    from fedkey.models.metrics import column_perplexity

    seqs = [TOK.encode(s) for s in TEXT]
    state = initial_state()
    cfg = TrainConfig(epochs=3, batch_size=4, lr=0.5, batching="columns")
    cols = train_local(CFG, state, seqs, cfg, seed=1, device="cpu")
    sents = train_local(CFG, state, seqs, TrainConfig(epochs=3, batch_size=4, lr=0.5), seed=1)
    assert not torch.equal(cols.state["rnn.weight_hh_l0"], sents.state["rnn.weight_hh_l0"])
    before = column_perplexity(build_model(CFG, state), TOK, TEXT, batch_size=4)
    after = column_perplexity(build_model(CFG, cols.state), TOK, TEXT, batch_size=4)
    assert after < before / 2
    assert cols.num_tokens == sents.num_tokens  # FedAvg still weighs phones by their words


@pytest.mark.filterwarnings("ignore:precision bf16:RuntimeWarning")  # a CPU without native bf16
def test_bf16_keeps_fp32_master_weights_and_uploads_finite_fp32_updates():
    seqs = [TOK.encode(s) for s in TEXT]
    state = initial_state()
    bf16 = TrainConfig(epochs=2, batch_size=4, lr=0.5, precision="bf16")
    a = train_local(CFG, state, seqs, bf16, seed=3, device="cpu")
    b = train_local(CFG, state, seqs, bf16, seed=3, device="cpu")
    fp32 = train_local(CFG, state, seqs, replace(bf16, precision="fp32"), seed=3, device="cpu")
    assert (a.precision, fp32.precision) == ("bf16", "fp32")
    assert set(a.state) == set(state)
    for k, v in a.state.items():
        assert v.dtype == torch.float32 == state[k].dtype, k  # what the server's checks expect
        assert torch.isfinite(v).all(), k
        assert torch.equal(v, b.state[k]), k  # deterministic within one precision
    assert not torch.equal(a.state["decoder.bias"], state["decoder.bias"])  # it trained
    assert not torch.equal(a.state["decoder.bias"], fp32.state["decoder.bias"])  # in bf16
    assert a.train_loss == pytest.approx(fp32.train_loss, rel=0.05)
    delta = {k: a.state[k] - state[k] for k in state}
    delta32 = {k: fp32.state[k] - state[k] for k in state}
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([v.flatten() for v in delta.values()]),
        torch.cat([v.flatten() for v in delta32.values()]),
        dim=0,
    )
    assert cos > 0.95  # the same update, up to bf16 rounding


def test_a_returned_state_is_freed_when_the_caller_drops_it():
    """Memory that does not grow with the phones trained: train_local keeps nothing of a phone's
    result (its state is a copy, not the reused model's weights), so one the caller lets go is
    freed, while the next phone trains on the same reused model."""
    seqs = [TOK.encode(s) for s in TEXT]
    cfg = TrainConfig(epochs=1, batch_size=4, lr=0.5)
    state = initial_state()
    first = train_local(CFG, state, seqs[:8], cfg, seed=1, device="cpu")
    refs = [weakref.ref(v) for v in first.state.values()]
    second = train_local(CFG, state, seqs[8:], cfg, seed=2, device="cpu")
    assert second.state["embedding.weight"].data_ptr() != refs[0]().data_ptr()  # type: ignore[union-attr]
    del first
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_the_onednn_cache_is_bounded_unless_the_environment_says_otherwise():
    """Importing the trainer bounds oneDNN's cache of compiled products (one a shape it has
    run: bf16 products on a CPU with native bf16), before any product; a value the user set is
    kept."""
    code = ("import os, fedkey.device_sim.training.trainer as t; "
            "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], t.ONEDNN_CACHE_CAPACITY)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    got, capacity = run.stdout.split()
    assert got == capacity and 0 < int(capacity) < 1024  # oneDNN's default: 1,024
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "7"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.split()[0] == "7"
