"""Turning encoded sentences into padded (input, target) batches.

Each sentence <s> w_1 .. w_n </s> gives input <s> w_1 .. w_n and target w_1 .. w_n </s>.
Targets past a sentence's end are IGNORE, so padding never counts in the loss.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

IGNORE = -100


def split_long(seqs: list[list[int]], max_len: int) -> list[list[int]]:
    """Cut sequences longer than max_len + 1 into overlapping-by-one chunks (training only)."""
    out: list[list[int]] = []
    for s in seqs:
        if len(s) <= max_len + 1:
            out.append(s)
            continue
        for start in range(0, len(s) - 1, max_len):
            out.append(s[start : start + max_len + 1])
    return out


def pad_batch(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    """-> inputs [B, T] (padded with 0) and targets [B, T] (padded with IGNORE)."""
    width = max(len(s) for s in seqs) - 1
    inputs = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s) - 1
        inputs[i, :n] = torch.tensor(s[:-1])
        targets[i, :n] = torch.tensor(s[1:])
    return inputs, targets


def batches(
    seqs: list[list[int]],
    batch_size: int,
    order: list[int] | None = None,
    max_words: int | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield padded batches of `batch_size` sentences, in `order` (default: as given). With
    `max_words` a batch also ends before it would predict more words than that (a longer
    sentence is a batch of its own)."""
    order = list(range(len(seqs))) if order is None else order
    batch: list[list[int]] = []
    words = 0
    for j in order:
        n = len(seqs[j]) - 1
        if batch and (len(batch) == batch_size or (max_words and words + n > max_words)):
            yield pad_batch(batch)
            batch, words = [], 0
        batch.append(seqs[j])
        words += n
    if batch:
        yield pad_batch(batch)


def column_batches(
    seqs: list[list[int]], batch_size: int, order: list[int] | None = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield the batches the seed papers' published code (fed-att) trained and evaluated on.

    It fed lists of token ids of unequal length to a DataLoader with the default collate, which
    in the PyTorch of its day transposed each batch and let zip() cut it to the shortest
    sentence (pytorch/pytorch#23141; later versions raise "each element in list of batch should
    be of equal size"). So its "sequences" are columns: sequence j holds token j of every
    sentence in the batch, and the model predicts token j of sentence i + 1 from token j of
    sentences 1..i. A batch of B sentences whose shortest has L tokens gives L sequences of B
    tokens. Column 0 is all <s>, and a sentence contributes only its first L tokens, so this is
    a far easier task than language modelling: its perplexity is not comparable with
    :func:`batches`'. Batches of one sentence predict nothing and are skipped.
    """
    order = list(range(len(seqs))) if order is None else order
    for i in range(0, len(order), batch_size):
        chunk = [seqs[j] for j in order[i : i + batch_size]]
        if len(chunk) < 2:
            continue
        width = min(len(s) for s in chunk)
        yield pad_batch([[s[j] for s in chunk] for j in range(width)])


def seeded_order(n: int, seed: int) -> list[int]:
    """A shuffled order of n sentences that depends on the seed alone."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def count_targets(seqs: list[list[int]]) -> int:
    """Number of predicted tokens: everything after <s>."""
    return sum(len(s) - 1 for s in seqs)
