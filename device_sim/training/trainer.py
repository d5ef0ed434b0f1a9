"""Local training on a phone: SGD with momentum over the phone's private sentences.

The same function runs in the in-process simulator's worker processes and in the HTTP device
simulator, so both paths produce the same weights for the same seed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from fedkey.common.config import TrainConfig
from fedkey.common.noise import randomize
from fedkey.models.batching import IGNORE, batches, column_batches, count_targets, split_long
from fedkey.models.checkpoint import build_model, load_model_state, model_state
from fedkey.models.config import ModelConfig
from fedkey.models.model import LanguageModel
from fedkey.models.precision import Resolved, autocast, resolve_device, resolve_precision

#: How many compiled products oneDNN keeps (ONEDNN_PRIMITIVE_CACHE_CAPACITY; its default 1,024).
#: On a CPU with native bf16, torch's bf16 products are oneDNN's, and oneDNN compiles and keeps
#: one primitive (its kernels and buffers) for every distinct shape it runs, up to that many. A
#: phone's batches have shapes of their own (the softmax on each batch's real words: [words, H]
#: x [H, V]), so the cache grows as a cohort trains: the cause, as far as measured, of one process
#: training 1,000 IRC phones under bf16 growing to 5.8 GB there (experiments/results/cohorts). On
#: a CPU without native bf16 no product is oneDNN's, and the same cohort stays flat at 0.5 GB, in
#: fp32 and in emulated bf16 alike. Set at import, before any product: oneDNN reads it once, at
#: its first primitive. A value in the environment (the user's) is kept.
ONEDNN_CACHE_CAPACITY = 128
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
#: Where torch.optim.SGD has a fused kernel that this project runs (the CPU and CUDA).
FUSED_SGD_DEVICES = ("cpu", "cuda")
#: Train each phone on the model its thread trained the last phone on, the global weights
#: copied in, instead of building one (see `phone_model`).
REUSE_MODELS = True
_reused = threading.local()  # .key, .model: this thread's last model and its (config, device)


@dataclass
class TrainResult:
    state: dict[str, torch.Tensor]
    num_tokens: int  # training tokens in the shard (n_k for FedAvg weighting)
    train_loss: float  # mean loss per token over all local epochs
    seconds: float
    precision: Resolved = "fp32"  # what config.precision resolved to on the training device


def local_batches(
    sentences: list[list[int]], config: TrainConfig, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every (inputs, targets) batch a phone trains on, all epochs in order: each epoch a
    permutation of its sentences drawn from `seed` (train_local's and the stacked backend's)."""
    if config.batching == "columns":
        seqs, make_batches = sentences, column_batches
    else:
        seqs, make_batches = split_long(sentences, config.max_len), batches
    gen = torch.Generator().manual_seed(seed)
    for _ in range(config.epochs):
        order = torch.randperm(len(seqs), generator=gen).tolist()
        yield from make_batches(seqs, config.batch_size, order)


def train_local(
    model_config: ModelConfig,
    global_state: dict[str, torch.Tensor],
    sentences: list[list[int]],
    config: TrainConfig,
    seed: int,
    device: str = "auto",
) -> TrainResult:
    """Train a copy of the global model on `sentences` (encoded ids) and return the new weights.

    Under config.precision bf16 (fedkey.models.precision) the forward runs in bf16 autocast; the
    weights, the loss, the gradients and the returned state stay float32. On the CPU a bf16
    step is fedkey.device_sim.training.bf16_cpu's (the recurrence written out: 1.2x torch's GRU there)."""
    start = time.perf_counter()
    dev = resolve_device(device)
    precision = resolve_precision(config.precision, dev)
    torch.manual_seed(seed)  # dropout masks
    model = phone_model(model_config, global_state, dev)
    model.train()
    # The fused kernel updates each weight and its momentum in one pass over memory. On the CPU
    # it leaves the default's weights bit for bit (tests/device_sim/training/test_trainer.py), and bf16
    # training ran 8.8% faster (fp32 2.9%: one thread, PTB, interleaved, best of 5).
    fused = dev.type in FUSED_SGD_DEVICES
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum, fused=fused)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total_loss, total_tokens = torch.zeros((), device=dev), 0
    written = (
        precision == "bf16" and dev.type == "cpu"
    )  # fedkey.device_sim.training.bf16_cpu's step
    if written:
        from fedkey.device_sim.training.bf16_cpu import (  # it imports the stack's
            add_embedding_grad,
            bf16_loss,
        )
    for inputs, targets in local_batches(sentences, config, seed):
        if written:
            loss_sum, n, embedded = bf16_loss(model, inputs, targets)
        else:
            keep = targets != IGNORE  # on the CPU, as the count: no device sync
            n = int(keep.sum())
            targets = targets[keep].to(dev)
            with autocast(precision, dev):
                logits = model.logits_at(inputs.to(dev), keep)  # the padding skipped
            loss_sum = loss_fn(logits.float(), targets)  # the loss in fp32 (a no-op under fp32)
        opt.zero_grad(set_to_none=True)
        (loss_sum / n).backward()
        if written:
            add_embedding_grad(model, embedded)
        if config.clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        opt.step()
        total_loss += loss_sum.detach()
        total_tokens += n
    # Copies: the model is the next phone's (a GPU's weights come to the CPU as copies anyway).
    state = {k: v.to("cpu", copy=True) for k, v in model_state(model).items()}
    return TrainResult(
        state=state,
        num_tokens=count_targets(sentences),
        train_loss=float(total_loss) / max(total_tokens, 1),
        seconds=time.perf_counter() - start,
        precision=precision,
    )


def phone_model(
    model_config: ModelConfig, global_state: dict[str, torch.Tensor], dev: torch.device
) -> LanguageModel:
    """The model a phone trains: the global weights in the model this thread trained its last
    phone on (same config and device), or a new one. Building one draws a random
    initialization only to overwrite it (a 10k x 64 GRU: about 10% of a PTB phone's training
    on one CPU thread). Reuse needs a model without dropout: building one also moves torch's
    global generator, which the dropout masks then draw from, so with dropout a phone still
    gets a new model and the masks it always had. The weights are bit for bit those of a new
    model (tests/device_sim/training/test_trainer.py)."""
    if not REUSE_MODELS or model_config.dropout > 0:
        return build_model(model_config, global_state).to(dev)
    key = (tuple(asdict(model_config).items()), str(dev))
    if getattr(_reused, "key", None) != key:
        _reused.model, _reused.key = build_model(model_config).to(dev), key
    model: LanguageModel = _reused.model
    with torch.no_grad():
        load_model_state(model, global_state)
    return model


def phone_round(
    model_config: ModelConfig,
    global_state: dict[str, torch.Tensor],
    sentences: list[list[int]],
    config: TrainConfig,
    seed: int,
    beta: float = 0.0,
    sigma: float = 1.0,
    device: str = "auto",
) -> TrainResult:
    """What a phone does with a round's task: train, then add the seed papers' randomization
    beta * N(0, sigma^2) to its weights before upload (when beta > 0). Every transport calls
    this, so the same task seed gives the same upload in-process and over HTTP."""
    result = train_local(model_config, global_state, sentences, config, seed, device)
    return before_upload(result, seed, beta, sigma)


def before_upload(result: TrainResult, seed: int, beta: float, sigma: float) -> TrainResult:
    """`result` with the seed papers' randomization beta * N(0, sigma^2) added to its weights
    (when beta > 0), drawn from the task's seed + 1: the same noise on every transport and
    backend."""
    if beta > 0:
        result.state = randomize(result.state, beta, sigma, torch.Generator().manual_seed(seed + 1))
    return result
