"""A round's phones trained together as one stacked model on one device: the `stacked` backend.

On a GPU one phone's training step at the seed papers' batch (10 sentences) is bound by kernel
launches, not arithmetic: one trainer process ran 23-33k tokens/s and eight processes sharing an
H200 topped out near 111k (experiments/results/perf/h200). Here the P phones of a round keep their own
weights, stacked along a leading phone dimension, and every step runs all of them at once: the
same launches as one phone, each product a batched one (torch.bmm) P times as large: a round of
50 phones (C = 0.5) took about twice a round of 10 on an H200, not five times. What is left is
Python launching the written-out recurrence's kernels one by one, so on a GPU each step shape
is captured once in a CUDA graph and replayed (Stack, `static`); the stack and its graphs stay
on the device from round to round.

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
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from common.config import TrainConfig
from device_sim.pool import LocalTask
from device_sim.trainer import TrainResult, before_upload, local_batches
from models.batching import IGNORE, count_targets
from models.checkpoint import check_state, expected_shapes
from models.config import ModelConfig
from models.precision import autocast, resolve_device, resolve_precision

Batch = tuple[Tensor, Tensor]  # inputs [B, T], targets [B, T] (IGNORE past each sentence)


def stack_step(step: list[Batch | None], rows: int = 1, width: int = 1) -> tuple[Tensor, Tensor]:
    """One step's batches (None: that phone is done) padded to one [P, B, T] inputs and targets,
    at least `rows` x `width` (a captured step's fixed shape)."""
    width = max([width] + [b[0].shape[1] for b in step if b is not None])
    rows = max([rows] + [b[0].shape[0] for b in step if b is not None])
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


def _cast_once(t: Tensor) -> Tensor:
    """`t` in the dtype autocast would cast it to, where autocast is on (a differentiable copy).
    Autocast caches its casts of weights themselves, not of their views: a transposed weight
    used at every time step was cast at every time step (T copies of P x 3H x H a step)."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return t.to(torch.get_autocast_dtype(kind))
    return t


def _recurrent(x: Tensor, w: dict[str, Tensor], layer: int, cell: str) -> Tensor:
    """One stacked GRU/LSTM layer over x [P, B, T, in] from a zero state -> outputs [P, B, T, H].

    The gates are torch.nn.GRU's and LSTM's (r, z, n and i, f, g, o, in that order); the inputs'
    share of every time step is one batched product up front."""
    w_ih, w_hh = w[f"rnn.weight_ih_l{layer}"], w[f"rnn.weight_hh_l{layer}"]
    b_ih, b_hh = w[f"rnn.bias_ih_l{layer}"], w[f"rnn.bias_hh_l{layer}"]
    P, B, T, _ = x.shape
    H = w_hh.shape[-1]
    w_hh_t = _cast_once(w_hh.transpose(1, 2))  # not once per time step, as autocast would
    gi = torch.baddbmm(b_ih.unsqueeze(1), x.reshape(P, B * T, -1), w_ih.transpose(1, 2))
    # One view per time step (unbind: its backward is one stack, where indexing gi[:, :, t] in
    # the loop gave every step's gradient a zero-filled copy of the whole of gi).
    steps = gi.view(P, B, T, -1).unbind(2)
    h = x.new_zeros(P, B, H)
    c = x.new_zeros(P, B, H)
    outs = []
    for t in range(T):
        gh = torch.baddbmm(b_hh.unsqueeze(1), h, w_hh_t)
        if cell == "gru":
            i_r, i_z, i_n = steps[t].chunk(3, -1)
            h_r, h_z, h_n = gh.chunk(3, -1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            h = n + z * (h - n)  # (1 - z) * n + z * h
        else:
            i, f, g, o = (steps[t] + gh).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs, dim=2)


def softmax_rows(targets: Tensor, dense: bool) -> tuple[Tensor | None, Tensor]:
    """Which positions of a step's [P, B, T] the softmax layer scores, and their targets [P, N].
    Compact (as LanguageModel.logits_at): each phone's real words first, in order, N the most
    any phone has. Dense (a captured step's fixed shape): every position, index None."""
    flat = targets.flatten(1)
    if dense:
        return None, flat
    keep = flat != IGNORE
    n = keep.sum(1)
    width = max(int(n.max()), 1)
    index = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :width]
    wanted = flat.gather(1, index)
    wanted[torch.arange(width).unsqueeze(0) >= n.unsqueeze(1)] = IGNORE
    return index, wanted


def stacked_loss(
    w: dict[str, Tensor], cfg: ModelConfig, ids: Tensor, index: Tensor | None, wanted: Tensor
) -> Tensor:
    """Each phone's summed cross-entropy [P] over its real words (padding scores nothing), as
    LanguageModel.logits_at and train_local compute it, the logits cast to fp32. `ids` [P, B, T]
    index the stacked embedding (phone p's word i is p * V + i); `index` and `wanted` are
    softmax_rows'."""
    P, V = ids.shape[0], cfg.vocab_size
    x = F.embedding(ids, w["embedding.weight"].reshape(P * V, -1))
    x = F.dropout(x, cfg.dropout)
    for layer in range(cfg.num_layers):
        if layer > 0:  # nn.GRU's dropout between layers
            x = F.dropout(x, cfg.dropout)
        x = _recurrent(x, w, layer, cfg.cell)
    out = x.flatten(1, 2)
    if index is not None:
        out = out.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    decoder = w["embedding.weight"] if cfg.tied else w["decoder.weight"]
    logits = torch.baddbmm(
        w["decoder.bias"].unsqueeze(1), F.dropout(out, cfg.dropout), decoder.transpose(1, 2)
    )
    losses = F.cross_entropy(
        logits.float().flatten(0, 1), wanted.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return losses.view(P, -1).sum(1)


class Stack:
    """P phones' weights as stacked tensors [P, ...] and their momentum, kept on one device from
    round to round, and one training step over all of them.

    `static`: every step has one of a few fixed shapes (rows padded to the batch size, time to a
    multiple of BUCKET, the softmax on every position: the same losses). On a GPU a static
    stack captures each shape's step, forward, backward and SGD, once in a CUDA graph and
    replays it, so a step costs the GPU's time for its kernels, not Python's for launching them."""

    BUCKET = 16  # time steps: a static step's width is rounded up to a multiple of this
    WARMUP = 3  # eager steps on a side stream before a capture (torch.cuda.graphs' advice)

    def __init__(
        self, cfg: ModelConfig, train: TrainConfig, phones: int, dev: torch.device, static: bool
    ) -> None:
        self.cfg, self.train, self.P, self.dev = cfg, train, phones, dev
        self.precision = resolve_precision(train.precision, dev)
        self.static = static
        self.graphs = static and dev.type == "cuda"
        shapes = expected_shapes(cfg)
        self.w = {
            k: torch.zeros((phones, *shape), device=dev, requires_grad=True)
            for k, (shape, _) in shapes.items()
        }
        self.momentum = {k: torch.zeros_like(v) for k, v in self.w.items()}
        self.lr = torch.zeros((), device=dev)  # a tensor, so a new round's lr keeps the graphs
        self.offsets = (torch.arange(phones) * cfg.vocab_size).view(phones, 1, 1)
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = {}

    def reset(self, global_state: dict[str, Tensor], lr: float) -> None:
        """Every phone starts from the global weights, its momentum at zero."""
        with torch.no_grad():
            for k, v in self.w.items():
                v.copy_(global_state[k].to(self.dev).expand_as(v))
            for buf in self.momentum.values():
                buf.zero_()
            self.lr.fill_(lr)

    def step(self, batches: list[Batch | None]) -> tuple[Tensor, Tensor]:
        """Train every phone on its batch (None: the phone is done and keeps its weights); its
        summed loss [P] (on the device) and its word count [P] (on the CPU)."""
        width = 1
        if self.static:
            longest = max((b[0].shape[1] for b in batches if b is not None), default=1)
            width = -(-longest // self.BUCKET) * self.BUCKET
        inputs, targets = stack_step(batches, self.train.batch_size if self.static else 1, width)
        n = (targets != IGNORE).flatten(1).sum(1)
        index, wanted = softmax_rows(targets, self.static)
        ids = inputs + self.offsets
        if self.graphs:
            try:
                return self._replay(ids, wanted, n), n
            except RuntimeError as e:  # a capture this torch or driver refuses: run eagerly
                why = f"stacked training: no CUDA graph ({e}); its steps run eagerly"
                warnings.warn(why, stacklevel=2)
                self.graphs = False
                self._captured.clear()
        dev = self.dev
        rows = None if index is None else _to(index, dev)
        return self._train_step(_to(ids, dev), rows, _to(wanted, dev), _to(n, dev)), n

    def _replay(self, ids: Tensor, wanted: Tensor, n: Tensor) -> Tensor:
        graph, static = self._graph(ids.shape)
        for name, t in (("ids", ids), ("wanted", wanted), ("n", n)):
            static[name].copy_(t.pin_memory(), non_blocking=True)
        graph.replay()
        return static["losses"]

    def _train_step(self, ids: Tensor, index: Tensor | None, wanted: Tensor, n: Tensor) -> Tensor:
        with autocast(self.precision, self.dev, cache=not self.graphs):
            losses = stacked_loss(self.w, self.cfg, ids, index, wanted)
        for v in self.w.values():
            v.grad = None
        (losses / n.clamp(min=1)).sum().backward()
        with torch.no_grad():
            _clip_and_step(self.w, self.momentum, self.train.clip, self.train.momentum,
                           self.lr, n > 0)  # fmt: skip
        return losses.detach()

    def _graph(self, shape: torch.Size) -> tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]:
        """The captured step of this shape (captured now if new): its static inputs and output."""
        width = shape[-1]
        if width not in self._captured:
            P, rows = self.P, shape[1]
            static = {
                "ids": torch.zeros(shape, dtype=torch.long, device=self.dev),
                "wanted": torch.full((P, rows * width), IGNORE, dtype=torch.long, device=self.dev),
                "n": torch.zeros(P, dtype=torch.long, device=self.dev),
            }
            # Warm-up with no word to predict: no phone is active, so nothing moves.
            side = torch.cuda.Stream(self.dev)
            side.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(side):
                for _ in range(self.WARMUP):
                    self._train_step(static["ids"], None, static["wanted"], static["n"])
            torch.cuda.current_stream(self.dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static["losses"] = self._train_step(
                    static["ids"], None, static["wanted"], static["n"]
                )
            self._captured[width] = (graph, static)
        return self._captured[width]

    def states(self) -> list[dict[str, Tensor]]:
        """Each phone's weights, float32 on the CPU."""
        return [{k: v[p].detach().cpu().clone() for k, v in self.w.items()} for p in range(self.P)]


def train_stacked(
    model_config: ModelConfig,
    global_state: dict[str, Tensor],
    tasks: list[tuple[list[list[int]], int]],
    config: TrainConfig,
    device: str = "auto",
    stack: Stack | None = None,
) -> list[TrainResult]:
    """Train one copy of the global model per (sentences, seed) in `tasks`, all at once on one
    device; the results in the tasks' order, each as train_local would return it (`seconds` is
    the whole stack's time). `stack`: the weights' home on the device, kept from round to round
    (StackedTrainer's); default a new eager one."""
    if config.batching != "sentences":
        raise ValueError(f"the stacked backend trains sentence batches, not {config.batching!r}")
    start = time.perf_counter()
    dev = resolve_device(device)
    P = len(tasks)
    stack = stack or Stack(model_config, config, P, dev, static=False)
    check_state(global_state, model_config)
    stack.reset(global_state, config.lr)
    torch.manual_seed(tasks[0][1])  # dropout masks: one generator for the stack
    plans = [list(local_batches(s, config, seed)) for s, seed in tasks]
    steps = max((len(p) for p in plans), default=0)
    total_loss, total_tokens = torch.zeros(P, device=dev), torch.zeros(P, dtype=torch.long)
    for s in range(steps):
        losses, n = stack.step([p[s] if s < len(p) else None for p in plans])
        total_loss += losses
        total_tokens += n
    return [
        TrainResult(
            state=state,
            num_tokens=count_targets(sentences),
            train_loss=float(total_loss[p]) / max(int(total_tokens[p]), 1),
            seconds=time.perf_counter() - start,
            precision=stack.precision,
        )
        for p, ((sentences, _), state) in enumerate(zip(tasks, stack.states(), strict=True))
    ]


def _clip_and_step(
    w: dict[str, Tensor],
    momentum: dict[str, Tensor],
    clip: float,
    m: float,
    lr: Tensor,
    active: Tensor,
) -> None:
    """Per phone: clip the gradient's norm to `clip` (clip_grad_norm_'s rule), then SGD with
    momentum `m` (torch.optim.SGD's: buf = m * buf + g, w -= lr * buf). A phone not `active`
    (done: its gradient is zero) keeps its weights and its momentum."""
    P = active.shape[0]
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in w.items()}
    # Each pass over the weights costs a memory sweep of P models (a tied 10k-word embedding is
    # 12 MB a phone): one for the norms, two for the momentum, one for the weights, no temporaries.
    if clip > 0:
        norms = [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()]
        norm = torch.linalg.vector_norm(torch.stack(norms), dim=0)
        scale = (clip / (norm + 1e-6)).clamp(max=1.0)
    else:
        scale = torch.ones(P, device=active.device)
    on = active.to(scale.dtype)
    decay = 1 - on * (1 - m)  # m for an active phone, 1 for a done one
    step = -lr * on
    for k, v in w.items():
        shape = (P,) + (1,) * (v.dim() - 1)
        buf = momentum[k].mul_(decay.view(shape)).addcmul_(grads[k], scale.view(shape))
        v.addcmul_(buf, step.view(shape))


class StackedTrainer:
    """The `stacked` training backend (device_sim.backends.TrainingBackend): a round's tasks
    trained together in this process on one device (their own device field: a GPU for the
    gain). Tasks that share a model, a training config and a device are stacked together; the
    stack stays on the device for the next round of the same shape (on a GPU with its captured
    steps: `static`, default there)."""

    workers = 1

    #: Stacks kept from round to round, the least recently used dropped first: a round may train
    #: two groups (the backdoor attack's phones train longer than the honest ones), each its own.
    KEPT = 2

    def __init__(self, static: bool | None = None) -> None:
        self._lock = threading.Lock()  # one stack at a time (torch's global seed)
        self.static = static
        self._stacks: OrderedDict[tuple, Stack] = OrderedDict()  # kept for the next rounds

    def _stack_for(self, t: LocalTask, phones: int) -> Stack:
        dev = resolve_device(t.device)
        key = (repr(t.model_config), repr(replace(t.train, lr=0.0)), phones, str(dev))
        if key in self._stacks:
            self._stacks.move_to_end(key)
            return self._stacks[key]
        while len(self._stacks) >= self.KEPT:
            self._stacks.popitem(last=False)  # its device memory before the new stack's
        static = dev.type == "cuda" if self.static is None else self.static
        self._stacks[key] = Stack(t.model_config, t.train, phones, dev, static)
        return self._stacks[key]

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
                stack = self._stack_for(first, len(group))
                trained = train_stacked(
                    first.model_config, global_state, shards, first.train, first.device, stack
                )
                for t, result in zip(group, trained, strict=True):
                    done[t.device_id] = before_upload(result, t.seed, t.beta, t.sigma)
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
        self._stacks.clear()
