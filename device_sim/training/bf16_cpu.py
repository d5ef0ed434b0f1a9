"""The local trainer's forward and backward under bf16 on the CPU (fedkey.device_sim.training.trainer.train_local).

There torch's GRU/LSTM runs cell by cell (autocast does not list it on the CPU): its hidden state
stays float32, cast to bf16 for every time step's product and back, and autograd makes the
recurrent weights' gradient at every time step, a [3H, H] product and a sum a step. With a
profile of one thread training PTB's first 300 sentences (the small model, batches of 10), those
per-step products and sums, the casts, and the embedding's dense zero gradient (10k x 300, a
fill and an add a step) were what kept bf16 at 1.5-1.6x fp32's tokens/s while its products ran
2x. Here a step runs as the stacked backend's does for one phone: the recurrent layers written
out (fedkey.device_sim.training.stacked_rnn: in bf16 throughout, the recurrent weights' gradient one product
over all time steps), the batch's sentences longest first so the recurrence stops at each
sentence's end, and the embedding's gradient added by hand to the tied decoder's. The weights,
the loss (from logits cast to float32), the gradients and the optimizer stay float32. The same
training as torch's GRU under autocast, rounded to bf16 in other places: not the same bits.

Most of what this step gains is the written recurrence's, not bf16's: run in fp32 arithmetic it
was 1.17x torch's GRU in fp32 too (one thread, thread CPU time, the same workload; bf16 on it
1.69x fp32 on it). fp32 keeps torch's GRU so that its weights stay bit for bit those of runs
begun before (the paper bench resumes them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fedkey.device_sim.training.stacked_rnn import recurrent
from fedkey.models.batching import IGNORE
from fedkey.models.model import LanguageModel

#: A step's embedded inputs: the ids [B, T] and their embedding [B, T, H] (a leaf whose gradient
#: add_embedding_grad adds to the embedding's).
Embedded = tuple[Tensor, Tensor]


def longest_first(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    """A batch [B, T] with its sentences longest first, and how many rows are still words at
    each time step (stacked_rnn.recurrent's `rows`). The loss is a sum over the sentences, so
    their order changes only its float rounding."""
    lengths = (targets != IGNORE).sum(1)
    order = torch.sort(lengths, descending=True, stable=True)
    steps = torch.arange(inputs.shape[1]).unsqueeze(1)
    rows = (order.values.unsqueeze(0) > steps).sum(1).clamp(min=1).tolist()
    return inputs[order.indices], targets[order.indices], rows


def bf16_loss(
    model: LanguageModel, inputs: Tensor, targets: Tensor
) -> tuple[Tensor, int, Embedded]:
    """A batch's summed cross-entropy over its real words (as LanguageModel.logits_at and
    train_local score them), the forward under bf16 autocast, the loss in float32; the number of
    words; the embedded inputs, for add_embedding_grad after the backward pass."""
    inputs, targets, rows = longest_first(inputs, targets)
    keep = (targets != IGNORE).flatten()
    index = keep.nonzero().squeeze(1)
    c = model.config
    drop = _dropout(c.dropout if model.training else 0.0)
    weights = {k: v.unsqueeze(0) for k, v in model.rnn.named_parameters(prefix="rnn")}
    x = F.embedding(inputs, model.embedding.weight.detach()).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = drop(x).unsqueeze(0)  # [1, B, T, H]: one phone's stack
        for layer in range(c.num_layers):
            if layer > 0:  # nn.GRU's dropout between layers
                h = drop(h)
            h = recurrent(h, weights, layer, c.cell, rows)
        logits = model.decoder(drop(h[0].flatten(0, 1).index_select(0, index)))
    loss = F.cross_entropy(logits.float(), targets.flatten()[index], reduction="sum")
    return loss, len(index), (inputs, x)


def _dropout(p: float) -> Callable[[Tensor], Tensor]:
    """Dropout with probability `p` (the model's masks, from torch's generator), none at 0."""
    return (lambda t: F.dropout(t, p)) if p > 0 else (lambda t: t)


def add_embedding_grad(model: LanguageModel, embedded: Embedded) -> None:
    """Add the embedded inputs' gradient to the embedding's rows (where a tied decoder's
    gradient already is): autograd would make a dense zero [V, H] tensor a step, and add it."""
    ids, x = embedded
    weight = model.embedding.weight
    if x.grad is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    with torch.no_grad():
        weight.grad.index_add_(0, ids.flatten(), x.grad.flatten(0, 1))
