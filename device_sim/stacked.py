"""A round's phones trained together as one stacked model on one device: the `stacked` backend.

On a GPU one phone's training step at the seed papers' batch (10 sentences) is bound by kernel
launches, not arithmetic: one trainer process ran 23-33k tokens/s and eight processes sharing an
H200 topped out near 111k (bench/results/gpu/perf). Here the P phones of a round keep their own
weights, stacked along a leading phone dimension, and every step runs all of them at once: the
same launches as one phone, each product a batched one (torch.bmm) P times as large. A round of
50 phones (C = 0.5) then costs about what a round of 10 does.

Each phone trains exactly as device_sim.trainer.train_local does: its own shard, its batches in
the order its own seed draws, SGD with momentum, its gradient norm clipped on its own, the loss
in fp32, the forward under bf16 autocast where the precision says so. A phone whose batches are
done (a smaller shard) is carried along with an empty batch and a masked step, so its weights
stop where its own training ends. The recurrent layers are written out (torch's fused GRU/LSTM
has no per-phone weights); without dropout the updates equal train_local's up to float rounding
(tests/device_sim/test_stacked.py). With dropout the masks come from one generator for the stack,
so they differ from train_local's: the same training in distribution, not bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import torch
import torch.nn.functional as F
from torch import Tensor

from common.config import TrainConfig
from common.noise import randomize
from device_sim.pool import LocalTask
from device_sim.trainer import TrainResult
from models.batching import IGNORE, batches, count_targets, split_long
from models.checkpoint import build_model, model_state
from models.config import ModelConfig
from models.precision import autocast, resolve_device, resolve_precision

Batch = tuple[Tensor, Tensor]  # inputs [B, T], targets [B, T] (IGNORE past each sentence)


def phone_batches(sentences: list[list[int]], config: TrainConfig, seed: int) -> list[Batch]:
    """Every batch one phone trains on, all epochs in order: the batches train_local draws for
    the same seed (its generator's permutation per epoch)."""
    seqs = split_long(sentences, config.max_len)
    gen = torch.Generator().manual_seed(seed)
    out: list[Batch] = []
    for _ in range(config.epochs):
        order = torch.randperm(len(seqs), generator=gen).tolist()
        out.extend(batches(seqs, config.batch_size, order))
    return out


def stack_step(step: list[Batch | None]) -> tuple[Tensor, Tensor]:
    """One step's batches (None: that phone is done) padded to one [P, B, T] inputs and targets."""
    width = max((b[0].shape[1] for b in step if b is not None), default=1)
    rows = max((b[0].shape[0] for b in step if b is not None), default=1)
    inputs = torch.zeros(len(step), rows, width, dtype=torch.long)
    targets = torch.full((len(step), rows, width), IGNORE, dtype=torch.long)
    for p, b in enumerate(step):
        if b is not None:
            inputs[p, : b[0].shape[0], : b[0].shape[1]] = b[0]
            targets[p, : b[1].shape[0], : b[1].shape[1]] = b[1]
    return inputs, targets


def _to(t: Tensor, dev: torch.device) -> Tensor:
    """A CPU tensor on `dev`; to a GPU through pinned memory without waiting (a pageable copy
    waits for the GPU's queue to drain, and the next step's launches with it)."""
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


def _recurrent(x: Tensor, w: dict[str, Tensor], layer: int, cell: str) -> Tensor:
    """One stacked GRU/LSTM layer over x [P, B, T, in] from a zero state -> outputs [P, B, T, H].

    The gates are torch.nn.GRU's and LSTM's (r, z, n and i, f, g, o, in that order); the inputs'
    share of every time step is one batched product up front."""
    w_ih, w_hh = w[f"rnn.weight_ih_l{layer}"], w[f"rnn.weight_hh_l{layer}"]
    b_ih, b_hh = w[f"rnn.bias_ih_l{layer}"], w[f"rnn.bias_hh_l{layer}"]
    P, B, T, _ = x.shape
    H = w_hh.shape[-1]
    gi = torch.baddbmm(b_ih.unsqueeze(1), x.reshape(P, B * T, -1), w_ih.transpose(1, 2))
    gi = gi.view(P, B, T, -1)
    h = x.new_zeros(P, B, H)
    c = x.new_zeros(P, B, H)
    outs = []
    for t in range(T):
        gh = torch.baddbmm(b_hh.unsqueeze(1), h, w_hh.transpose(1, 2))
        if cell == "gru":
            i_r, i_z, i_n = gi[:, :, t].chunk(3, -1)
            h_r, h_z, h_n = gh.chunk(3, -1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            h = n + z * (h - n)  # (1 - z) * n + z * h
        else:
            i, f, g, o = (gi[:, :, t] + gh).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs, dim=2)


def stacked_loss(
    w: dict[str, Tensor], cfg: ModelConfig, inputs: Tensor, targets: Tensor, dev: torch.device
) -> Tensor:
    """Each phone's summed cross-entropy [P] over its real words (padding skipped), as
    LanguageModel.logits_at and train_local compute it, the logits cast to fp32."""
    P, _, _ = inputs.shape
    V = cfg.vocab_size
    emb = w["embedding.weight"]  # [P, V, E]
    offsets = (torch.arange(P) * V).view(P, 1, 1)
    x = F.embedding(_to(inputs + offsets, dev), emb.reshape(P * V, -1))
    x = F.dropout(x, cfg.dropout)
    for layer in range(cfg.num_layers):
        if layer > 0:  # nn.GRU's dropout between layers
            x = F.dropout(x, cfg.dropout)
        x = _recurrent(x, w, layer, cfg.cell)
    # The softmax layer on the real words only: each phone's kept positions first, in order.
    keep = (targets != IGNORE).flatten(1)  # [P, B*T], on the CPU
    n = keep.sum(1)
    width = max(int(n.max()), 1)
    index = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :width]
    wanted = targets.flatten(1).gather(1, index)
    wanted[torch.arange(width).unsqueeze(0) >= n.unsqueeze(1)] = IGNORE
    index, wanted = _to(index, dev), _to(wanted, dev)
    out = x.flatten(1, 2).gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    decoder = w["embedding.weight"] if cfg.tied else w["decoder.weight"]
    logits = torch.baddbmm(
        w["decoder.bias"].unsqueeze(1), F.dropout(out, cfg.dropout), decoder.transpose(1, 2)
    )
    losses = F.cross_entropy(
        logits.float().flatten(0, 1), wanted.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return losses.view(P, width).sum(1)


def train_stacked(
    model_config: ModelConfig,
    global_state: dict[str, Tensor],
    tasks: list[tuple[list[list[int]], int]],
    config: TrainConfig,
    device: str = "auto",
) -> list[TrainResult]:
    """Train one copy of the global model per (sentences, seed) in `tasks`, all at once on one
    device; the results in the tasks' order, each as train_local would return it (`seconds` is
    the whole stack's time)."""
    if config.batching != "sentences":
        raise ValueError(f"the stacked backend trains sentence batches, not {config.batching!r}")
    start = time.perf_counter()
    dev = resolve_device(device)
    precision = resolve_precision(config.precision, dev)
    P = len(tasks)
    torch.manual_seed(tasks[0][1])  # dropout masks: one generator for the stack
    names = model_state(build_model(model_config, global_state))  # the federated tensors
    w = {
        k: v.to(dev).unsqueeze(0).repeat(P, *[1] * v.dim()).requires_grad_()
        for k, v in names.items()
    }
    momentum = {k: torch.zeros_like(v) for k, v in w.items()}
    plans = [phone_batches(s, config, seed) for s, seed in tasks]
    steps = max((len(p) for p in plans), default=0)
    total_loss, total_tokens = torch.zeros(P, device=dev), torch.zeros(P)
    for s in range(steps):
        inputs, targets = stack_step([p[s] if s < len(p) else None for p in plans])
        n = (targets != IGNORE).flatten(1).sum(1)
        n_dev = _to(n, dev)
        with autocast(precision, dev):
            losses = stacked_loss(w, model_config, inputs, targets, dev)
        for v in w.values():
            v.grad = None
        (losses / n_dev.clamp(min=1)).sum().backward()
        with torch.no_grad():
            _clip_and_step(w, momentum, config, n_dev > 0)
        total_loss += losses.detach()
        total_tokens += n
    results = []
    for p, (sentences, _) in enumerate(tasks):
        results.append(
            TrainResult(
                state={k: v[p].detach().cpu().clone() for k, v in w.items()},
                num_tokens=count_targets(sentences),
                train_loss=float(total_loss[p]) / max(int(total_tokens[p]), 1),
                seconds=time.perf_counter() - start,
                precision=precision,
            )
        )
    return results


def _clip_and_step(
    w: dict[str, Tensor], momentum: dict[str, Tensor], config: TrainConfig, active: Tensor
) -> None:
    """Per phone: clip the gradient's norm to config.clip (clip_grad_norm_'s rule), then SGD with
    momentum (torch.optim.SGD's: buf = m * buf + g, w -= lr * buf); a done phone keeps its weights."""
    P = active.shape[0]
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in w.items()}
    if config.clip > 0:
        norm = torch.stack([g.pow(2).flatten(1).sum(1) for g in grads.values()]).sum(0).sqrt()
        scale = (config.clip / (norm + 1e-6)).clamp(max=1.0)
    else:
        scale = torch.ones(P, device=active.device)
    step = config.lr * active.to(scale.dtype)
    for k, v in w.items():
        shape = (P,) + (1,) * (v.dim() - 1)
        buf = momentum[k].mul_(config.momentum).add_(grads[k] * scale.view(shape))
        v.sub_(buf * step.view(shape))


class StackedTrainer:
    """The `stacked` training backend (device_sim.backends.TrainingBackend): a round's tasks
    trained together in this process on one device (their own device field: a GPU for the
    gain). Tasks that share a model, a training config and a device are stacked together."""

    workers = 1

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one stack at a time (torch's global seed)

    def run(
        self, tasks: list[LocalTask], global_state: dict[str, Tensor]
    ) -> dict[str, TrainResult]:
        if not tasks:
            return {}
        groups: dict[tuple[str, str, str], list[LocalTask]] = {}
        for t in tasks:
            groups.setdefault((repr(t.model_config), repr(t.train), t.device), []).append(t)
        done: dict[str, TrainResult] = {}
        with self._lock:
            for group in groups.values():
                first = group[0]
                shards = [(t.shard, t.seed) for t in group]
                trained = train_stacked(
                    first.model_config, global_state, shards, first.train, first.device
                )
                for t, result in zip(group, trained, strict=True):
                    if t.beta > 0:  # the phone's randomization, as device_sim.trainer.phone_round
                        gen = torch.Generator().manual_seed(t.seed + 1)
                        result.state = randomize(result.state, t.beta, t.sigma, gen)
                    done[t.device_id] = result
        return {t.device_id: done[t.device_id] for t in tasks}

    def stream(
        self, tasks: Iterable[LocalTask], global_state: dict[str, Tensor]
    ) -> Iterator[tuple[str, TrainResult | None]]:
        yield from self.run(list(tasks), global_state).items()

    def submit(self, task: LocalTask, global_state: dict[str, Tensor]) -> Future:
        future: Future = Future()
        try:
            future.set_result(self.train(task, global_state))
        except Exception as e:
            future.set_exception(e)
        return future

    def train(self, task: LocalTask, global_state: dict[str, Tensor]) -> TrainResult:
        return self.run([task], global_state)[task.device_id]

    def close(self) -> None:
        pass
