"""The seed papers' code's batches and measure (fedkey.models.batching.column_batches,
column_perplexity), checked against that code's own evaluation loop run on the collate of their
PyTorch."""

import math

import torch
from torch import nn

from fedkey.models.batching import IGNORE, batches, column_batches
from fedkey.models.checkpoint import build_model
from fedkey.models.config import ModelConfig
from fedkey.models.metrics import column_perplexity
from fedkey.models.tokenizers import WordTokenizer

TEXT = [
    "see you later",
    "see you soon my friend",
    "on my way home now",
    "see you at the station tonight",
    "call me",
    "running late again sorry",
    "are you coming to the party",
] * 5
TOK = WordTokenizer.build(TEXT)
CFG = ModelConfig(vocab_size=TOK.vocab_size, emb_size=12, hidden_size=12)


def legacy_collate(batch: list[list[int]]) -> list[torch.Tensor]:
    """PyTorch's default_collate before it refused lists of unequal length: zip() transposes
    the batch and stops at the shortest list; each column becomes a tensor."""
    return [torch.tensor(column) for column in zip(*batch, strict=False)]


def seeds_evaluate(model, seqs: list[list[int]], order: list[int], batch_size: int) -> float:
    """fed-att's LocalUpdateLM.evaluate (2 ** mean -log2 p over packed columns), our model."""
    entropy, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(order), batch_size):
            batch = [seqs[j] for j in order[i : i + batch_size]]
            if len(batch) < 2:
                continue
            sents = legacy_collate(batch)
            x = nn.utils.rnn.pack_sequence([s[:-1] for s in sents])
            y = nn.utils.rnn.pack_sequence([s[1:] for s in sents])
            emb = nn.utils.rnn.PackedSequence(model.embedding(x.data), x.batch_sizes)
            out, _ = model.rnn(emb)
            logp = torch.log_softmax(model.decoder(out.data), dim=-1)
            prob = logp.exp()[torch.arange(y.data.shape[0]), y.data]
            entropy += float(prob.log2().neg().sum())
            count += y.data.shape[0]
    return 2 ** (entropy / count)


def test_columns_are_the_transposed_batch_cut_to_its_shortest_sentence():
    seqs = [TOK.encode(s) for s in TEXT[:4]]  # 5, 7, 7 and 8 tokens with <s> and </s>
    (inputs, targets), = list(column_batches(seqs, batch_size=4))  # fmt: skip
    shortest = min(len(s) for s in seqs)
    assert inputs.shape == targets.shape == (shortest, 3)  # a column per position, B - 1 steps
    assert (targets != IGNORE).all()  # no padding: every column is as long as the batch
    for j, column in enumerate(legacy_collate(seqs)):
        assert inputs[j].tolist() == column[:-1].tolist()
        assert targets[j].tolist() == column[1:].tolist()
    assert set(inputs[0].tolist()) == {TOK.bos_id}  # column 0: every sentence's start token


def test_a_batch_of_one_sentence_predicts_nothing_and_is_skipped():
    seqs = [TOK.encode(s) for s in TEXT[:3]]
    assert len(list(column_batches(seqs, batch_size=2))) == 1


def test_column_perplexity_is_what_the_seeds_code_reported():
    torch.manual_seed(0)
    model = build_model(CFG).eval()
    seqs = [TOK.encode(s) for s in TEXT]
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(3)).tolist()
    theirs = seeds_evaluate(model, seqs, order, batch_size=8)
    ours = column_perplexity(model, TOK, TEXT, batch_size=8, seed=3)
    assert math.isclose(ours, theirs, rel_tol=1e-5)


def test_column_batches_see_fewer_tokens_than_sentence_batches():
    seqs = [TOK.encode(s) for s in TEXT]
    scored = sum(int((t != IGNORE).sum()) for _, t in batches(seqs, 10))
    scored_cols = sum(t.numel() for _, t in column_batches(seqs, 10))
    assert scored_cols < scored
