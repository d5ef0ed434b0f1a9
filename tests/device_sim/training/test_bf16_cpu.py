"""The local trainer's bf16 step on the CPU (fedkey.device_sim.training.bf16_cpu): the loss and the gradients of
torch's model, up to bf16 rounding, for every cell and layout the trainer takes."""

from __future__ import annotations

import pytest
import torch

import fedkey.device_sim.training.bf16_cpu as bf16_cpu
from fedkey.common.config import TrainConfig
from fedkey.device_sim.training.trainer import train_local
from fedkey.models.batching import IGNORE, pad_batch
from fedkey.models.checkpoint import build_model, model_state
from fedkey.models.config import ModelConfig
from fedkey.models.tokenizers import WordTokenizer

TEXT = ["see you later", "see you soon", "on my way home", "see you at the station", "ok"]
TOK = WordTokenizer.build(TEXT)


def test_longest_first_sorts_the_sentences_and_counts_the_rows_still_words():
    inputs, targets = pad_batch([[1, 5, 2], [1, 5, 6, 7, 2], [1, 2]])
    ids, wanted, rows = bf16_cpu.longest_first(inputs, targets)
    assert (wanted != IGNORE).sum(1).tolist() == [4, 2, 1]
    assert ids[0].tolist() == [1, 5, 6, 7]
    assert rows == [3, 2, 1, 1]  # at time step t, the sentences longer than t


@pytest.mark.filterwarnings("ignore:precision bf16:RuntimeWarning")  # a CPU without native bf16
@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16),
        ModelConfig(vocab_size=TOK.vocab_size, cell="lstm", num_layers=2, tied=False),
    ],
    ids=["gru-tied", "lstm-2-layers-untied"],
)
def test_the_written_step_has_the_models_loss_and_gradients(cfg):
    torch.manual_seed(0)
    model = build_model(cfg)
    inputs, targets = pad_batch([TOK.encode(s) for s in TEXT])
    assert (targets == IGNORE).any()  # padding, which the written recurrence stops at

    loss, n, embedded = bf16_cpu.bf16_loss(model, inputs, targets)
    loss.backward()
    bf16_cpu.add_embedding_grad(model, embedded)
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    keep = targets != IGNORE
    logits = model.logits_at(inputs, keep)  # torch's GRU/LSTM in fp32: the reference
    expected = torch.nn.functional.cross_entropy(logits, targets[keep], reduction="sum")
    expected.backward()

    assert n == int(keep.sum())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)
    for name, p in model.named_parameters():
        assert ours[name].dtype == torch.float32, name
        cos = torch.nn.functional.cosine_similarity(ours[name].flatten(), p.grad.flatten(), 0)
        assert cos > 0.99, name


@pytest.mark.filterwarnings("ignore:precision bf16:RuntimeWarning")
def test_train_local_runs_bf16_on_the_cpu_through_the_written_step(monkeypatch):
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)
    torch.manual_seed(0)
    state = model_state(build_model(cfg))
    steps = []
    loss = bf16_cpu.bf16_loss
    monkeypatch.setattr(bf16_cpu, "bf16_loss", lambda *a: steps.append(1) or loss(*a))
    seqs = [TOK.encode(s) for s in TEXT]
    for precision in ("fp32", "bf16"):
        train = TrainConfig(epochs=1, batch_size=2, lr=0.5, precision=precision)
        train_local(cfg, state, seqs, train, seed=0, device="cpu")
    assert len(steps) == 3  # bf16's three batches; fp32 runs torch's GRU as it always did
