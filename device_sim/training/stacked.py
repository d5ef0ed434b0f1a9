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

On the CPU the products are as large as one phone's, so what stacking saves is the per-phone and
per-step cost around them: a large cohort is cut into stacks of a few phones (StackedTrainer),
each phone's sentences run longest first so the recurrence stops at each sentence's end
(sort_rows), the softmax layer runs on each phone's own real words only (no padding to the
stack's longest), the embedding's gradient is added by hand (no dense zero tensor a step) and
SGD is torch's fused kernel. On the Ubuntu IRC population (one phone per sender, E 1, B 10, bf16,
one thread, a CPU with native bf16) a 96-unit model trained 1.7x the phones a CPU-second of
--backend local's one process (1,000 phones: 41.5 against 23.8), the 300-unit default 1.2x (100
phones: 11.8 against 10.1); in fp32 on an AVX2 CPU the 96-unit model 1.3x (1,000 phones: 16.4
against 12.5), in a stack's memory rather than a round's, flat from 100 phones to 5,000
(experiments/results/cohorts).

Each phone trains exactly as fedkey.device_sim.training.trainer.train_local does: its own shard, its batches in
the order its own seed draws, SGD with momentum, its gradient norm clipped on its own, the loss
in fp32, the forward under bf16 autocast where the precision says so. The phones of a stack go
in longest plan first; at each step only those with a batch left train (an eager stack: a prefix
of it), so a phone's weights stop where its own training ends (a static stack carries a done
phone along with an empty batch and a masked step). The recurrent layers are written out
(torch's fused GRU/LSTM has no per-phone weights; fedkey.device_sim.training.stacked_rnn). Without dropout, in
fp32, every weight equals train_local's within 1e-6 absolute (tests/device_sim/training/test_stacked.py:
the same arithmetic, summed in another order, so not bit for bit). Under bf16 autocast the
products round to bf16 in other places than torch's fused GRU does: the same training, not the
same bits. With dropout the masks come from one generator for the stack, so they differ from
train_local's: the same training in distribution, not bit for bit.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from fedkey.common.config import TrainConfig
from fedkey.device_sim.training.backends import settled
from fedkey.device_sim.training.process_pool import LocalTask
from fedkey.device_sim.training.stacked_rnn import recurrent
from fedkey.device_sim.training.trainer import TrainResult, before_upload, local_batches
from fedkey.models.batching import IGNORE, count_targets, split_long
from fedkey.models.checkpoint import check_state, expected_shapes
from fedkey.models.config import ModelConfig
from fedkey.models.precision import autocast, resolve_device, resolve_precision

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


def sort_rows(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    """A step's [P, B, T] with each phone's sentences longest first, and how many rows of every
    phone are still words at each time step (recurrent's `rows`): the recurrence skips the
    padding of short sentences. A batch's loss and gradient are sums over its sentences, so
    their order changes only the float rounding of those sums."""
    lengths = (targets != IGNORE).sum(-1)
    order = torch.sort(lengths, dim=1, descending=True, stable=True)
    pick = order.indices.unsqueeze(-1).expand_as(inputs)
    longest = order.values.amax(0)  # [B], non-increasing
    steps = torch.arange(inputs.shape[-1]).unsqueeze(1)
    rows = (longest.unsqueeze(0) > steps).sum(1).clamp(min=1).tolist()
    return inputs.gather(1, pick), targets.gather(1, pick), rows


def stacked_loss(
    w: dict[str, Tensor],
    cfg: ModelConfig,
    ids: Tensor,
    index: Tensor | None,
    wanted: Tensor,
    rows: list[int] | None = None,
    x: Tensor | None = None,
) -> Tensor:
    """Each phone's summed cross-entropy [P] over its real words (padding scores nothing), as
    LanguageModel.logits_at and train_local compute it, the logits cast to fp32. `ids` [P, B, T]
    index the stacked embedding (phone p's word i is p * V + i); `index` and `wanted` are
    softmax_rows', `rows` sort_rows' (None: every row at every time step). `x`: the embedded
    ids, when the caller looks them up itself (Stack._train_step, to add their gradient to the
    embedding's by hand)."""
    P, V = ids.shape[0], cfg.vocab_size
    if x is None:
        x = F.embedding(ids, w["embedding.weight"].reshape(P * V, -1))
    x = F.dropout(x, cfg.dropout)
    for layer in range(cfg.num_layers):
        if layer > 0:  # nn.GRU's dropout between layers
            x = F.dropout(x, cfg.dropout)
        x = recurrent(x, w, layer, cfg.cell, rows)
    out = x.flatten(1, 2)
    decoder = w["embedding.weight"] if cfg.tied else w["decoder.weight"]
    if index is not None and ids.device.type == "cpu":
        return _softmax_each(F.dropout(out, cfg.dropout), index, wanted, decoder, w["decoder.bias"])
    if index is not None:
        out = out.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    logits = torch.baddbmm(
        w["decoder.bias"].unsqueeze(1), F.dropout(out, cfg.dropout), decoder.transpose(1, 2)
    )
    losses = F.cross_entropy(
        logits.float().flatten(0, 1), wanted.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return losses.view(P, -1).sum(1)


def _softmax_each(
    out: Tensor, index: Tensor, wanted: Tensor, decoder: Tensor, bias: Tensor
) -> Tensor:
    """stacked_loss's softmax layer one phone at a time, on its own real words only (on the
    CPU: a batched product pads every phone to the most words any phone has, and a phone with
    one short message stacked with one of ten long ones paid ten times its own softmax)."""
    counts = (wanted != IGNORE).sum(1).tolist()
    kind = out.device.type
    if torch.is_autocast_enabled(kind):  # one cast of the stack, not one a phone
        decoder = decoder.to(torch.get_autocast_dtype(kind))
    losses = []
    for p, (o, d, b) in enumerate(
        zip(out.unbind(0), decoder.unbind(0), bias.unbind(0), strict=True)
    ):
        rows = o.index_select(0, index[p, : counts[p]])
        logits = F.linear(rows, d, b)
        losses.append(F.cross_entropy(logits.float(), wanted[p, : counts[p]], reduction="sum"))
    return torch.stack(losses)


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
        # Plain storage: each step trains views of it (the phones it trains) as its leaves.
        self.w = {k: torch.zeros((phones, *shape), device=dev) for k, (shape, _) in shapes.items()}
        self.momentum = {k: torch.zeros_like(v) for k, v in self.w.items()}
        self.lr = torch.zeros((), device=dev)  # a tensor, so a new round's lr keeps the graphs
        self.lr_value = 0.0
        self.offsets = (torch.arange(phones) * cfg.vocab_size).view(phones, 1, 1)
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = {}

    def reset(self, global_state: dict[str, Tensor], lr: float, phones: int | None = None) -> None:
        """The first `phones` (default all) start from the global weights, momentum at zero."""
        count = self.P if phones is None else phones
        for k, v in self.w.items():
            v[:count].copy_(global_state[k].to(self.dev).expand_as(v[:count]))
        for buf in self.momentum.values():
            buf[:count].zero_()
        self.lr.fill_(lr)
        self.lr_value = lr  # the eager step's (no read of a device tensor a step)

    def step(self, batches: list[Batch | None]) -> tuple[Tensor, Tensor]:
        """Train the first len(batches) phones, each on its batch (None: the phone is done and
        keeps its weights); their summed losses (on the device) and word counts (on the CPU).
        An eager stack trains only up to the last phone with a batch (train_stacked sorts the
        phones so that those still training come first); a static one all P (its fixed shape)."""
        if self.static:
            asked = len(batches)
            got, n = self._step_all(batches + [None] * (self.P - asked))
            return got[:asked], n[:asked]
        live = max((p + 1 for p, b in enumerate(batches) if b is not None), default=0)
        if live < len(batches):
            got = torch.zeros(len(batches), device=self.dev)
            n = torch.zeros(len(batches), dtype=torch.long)
            if live:
                got[:live], n[:live] = self.step(batches[:live])
            return got, n
        return self._step_all(batches)

    def _step_all(self, batches: list[Batch | None]) -> tuple[Tensor, Tensor]:
        """Stack.step on every phone of `batches` (a static stack's: all P, its fixed shape)."""
        width = 1
        if self.static:
            longest = max((b[0].shape[1] for b in batches if b is not None), default=1)
            width = -(-longest // self.BUCKET) * self.BUCKET
        inputs, targets = stack_step(batches, self.train.batch_size if self.static else 1, width)
        rows = None
        if not self.static:
            inputs, targets, rows = sort_rows(inputs, targets)
        n = (targets != IGNORE).flatten(1).sum(1)
        index, wanted = softmax_rows(targets, self.static)
        ids = inputs + self.offsets[: len(batches)]
        if self.graphs:
            try:
                return self._replay(ids, wanted, n), n
            except RuntimeError as e:  # a capture this torch or driver refuses: run eagerly
                why = f"stacked training: no CUDA graph ({e}); its steps run eagerly"
                warnings.warn(why, stacklevel=2)
                self.graphs = False
                self._captured.clear()
        dev = self.dev
        at = None if index is None else _to(index, dev)
        return self._train_step(_to(ids, dev), at, _to(wanted, dev), _to(n, dev), rows), n

    def _replay(self, ids: Tensor, wanted: Tensor, n: Tensor) -> Tensor:
        graph, static = self._graph(ids.shape)
        for name, t in (("ids", ids), ("wanted", wanted), ("n", n)):
            static[name].copy_(t.pin_memory(), non_blocking=True)
        graph.replay()
        return static["losses"]

    def _train_step(
        self,
        ids: Tensor,
        index: Tensor | None,
        wanted: Tensor,
        n: Tensor,
        rows: list[int] | None = None,
    ) -> Tensor:
        """Forward, backward and SGD of the first ids.shape[0] phones, on views of the stack."""
        live = ids.shape[0]
        w = {k: v[:live].requires_grad_() for k, v in self.w.items()}
        momentum = {k: v[:live] for k, v in self.momentum.items()}
        if self.static:  # every phone, a done one masked (a GPU captures this step)
            with autocast(self.precision, self.dev, cache=not self.graphs):
                losses = stacked_loss(w, self.cfg, ids, index, wanted, rows)
            (losses / n.clamp(min=1)).sum().backward()
            with torch.no_grad():
                _clip_and_step(w, momentum, self.train.clip, self.train.momentum, self.lr, n > 0)
            return losses.detach()
        # Eager: every phone here has a batch. The embedding's gradient by hand: its rows'
        # gradients added where the decoder's (tied) already is (autograd made a dense
        # [P * V, H] zero tensor a step, and added it).
        emb = w["embedding.weight"]
        x = F.embedding(ids, emb.detach().view(-1, emb.shape[-1])).requires_grad_()
        with autocast(self.precision, self.dev):
            losses = stacked_loss(w, self.cfg, ids, index, wanted, rows, x)
        (losses / n.clamp(min=1)).sum().backward()
        with torch.no_grad():
            grad = emb.grad if emb.grad is not None else torch.zeros_like(emb)
            assert x.grad is not None
            grad.view(-1, grad.shape[-1]).index_add_(0, ids.flatten(), x.grad.flatten(0, -2))
            emb.grad = grad
            _clip_and_fused_step(w, momentum, self.train.clip, self.train.momentum, self.lr_value)
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

    def states(self, phones: int | None = None) -> list[dict[str, Tensor]]:
        """The first `phones` (default all) phones' weights, float32 on the CPU."""
        count = self.P if phones is None else phones
        return [{k: v[p].cpu().clone() for k, v in self.w.items()} for p in range(count)]


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
    the whole stack's time). `stack`: the weights' home on the device, at least len(tasks)
    phones, kept from round to round (StackedTrainer's); default a new eager one.

    The phones go into the stack longest plan first, so at every step those still training are
    its first ones and an eager stack trains only them (Stack.step): a phone with one batch costs
    one step, whatever its stack-mates hold. Each phone keeps its own batches in its own order."""
    if config.batching != "sentences":
        raise ValueError(f"the stacked backend trains sentence batches, not {config.batching!r}")
    start = time.perf_counter()
    dev = resolve_device(device)
    P = len(tasks)
    stack = stack or Stack(model_config, config, P, dev, static=False)
    if stack.P < P:
        raise ValueError(f"a stack of {stack.P} phones cannot train {P}")
    check_state(global_state, model_config)
    stack.reset(global_state, config.lr, P)
    torch.manual_seed(tasks[0][1])  # dropout masks: one generator for the stack
    plans = [list(local_batches(s, config, seed)) for s, seed in tasks]
    order = sorted(range(P), key=lambda p: -len(plans[p]))  # stable: ties keep the tasks' order
    plans = [plans[p] for p in order]
    steps = len(plans[0]) if plans else 0
    total_loss, total_tokens = torch.zeros(P, device=dev), torch.zeros(P, dtype=torch.long)
    for s in range(steps):
        live = sum(1 for p in plans if len(p) > s)
        losses, n = stack.step([p[s] for p in plans[:live]])
        total_loss[:live] += losses
        total_tokens[:live] += n
    states = stack.states(P)
    results: list[TrainResult | None] = [None] * P
    for slot, p in enumerate(order):
        results[p] = TrainResult(
            state=states[slot],
            num_tokens=count_targets(tasks[p][0]),
            train_loss=float(total_loss[slot]) / max(int(total_tokens[slot]), 1),
            seconds=time.perf_counter() - start,
            precision=stack.precision,
        )
    return [r for r in results if r is not None]


def plan_length(sentences: list[list[int]], config: TrainConfig) -> int:
    """How many batches local_batches gives a phone of `sentences` (sentence batching)."""
    return config.epochs * -(-len(split_long(sentences, config.max_len)) // config.batch_size)


def _clip_and_fused_step(
    w: dict[str, Tensor], momentum: dict[str, Tensor], clip: float, m: float, lr: float
) -> None:
    """_clip_and_step for phones that all trained this step (an eager stack's): each phone's
    gradient clipped on its own (only those over `clip` scaled), then the update of every
    phone in one pass over memory, torch.optim.SGD's fused kernel (train_local's)."""
    grads = [v.grad if v.grad is not None else torch.zeros_like(v) for v in w.values()]
    if clip > 0:
        norms = [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads]
        scale = (clip / (torch.linalg.vector_norm(torch.stack(norms), dim=0) + 1e-6)).tolist()
        for p, s in enumerate(scale):
            if s < 1.0:
                for g in grads:
                    g[p].mul_(s)
    torch._fused_sgd_(list(w.values()), grads, list(momentum.values()), weight_decay=0.0,
                      momentum=m, lr=lr, dampening=0.0, nesterov=False, maximize=False,
                      is_first_step=False)  # fmt: skip


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
    """The `stacked` training backend (fedkey.device_sim.training.backends.TrainingBackend): a round's tasks
    trained together in this process on one device (their own device field). Tasks that share a
    model, a training config and a device are stacked together, in stacks of at most `phones`
    (default: on a GPU at most GPU_PHONES, on the CPU as many as STACK_BYTES of weights, momentum
    and gradients hold, at most CPU_PHONES), longest plan first: a stack's phones have about as
    many batches as each other, so few of its steps train only some of them. Each stack's
    results are yielded as it ends, so a large cohort never holds more than one stack's weights
    at once beyond what the caller keeps. The stack stays on the device for the next round of
    the same shape (on a GPU with its captured steps: `static`, default there)."""

    workers = 1

    #: Stacks kept from round to round, the least recently used dropped first: a round may train
    #: two groups (the backdoor attack's phones train longer than the honest ones), each its own.
    KEPT = 2
    #: The CPU's default stack: its weights, momentum, gradient and the step's temporaries
    #: (about six copies of the model a phone) within this many bytes, at most CPU_PHONES phones:
    #: 7 phones of the 300-unit default model, 21 of a 96-unit one. Larger stacks were no faster
    #: (IRC, 100 phones, bf16, one thread: 8 phones a stack 10.7 phones a CPU-second, 32: 8.6).
    STACK_BYTES = 512 << 20
    CPU_PHONES = 64
    #: The GPU's default stack: a stack of 100 phones of the 300-unit model on the Ubuntu IRC
    #: population (C 0.1) held about 35 GB of an H100 with its captured steps, so a whole round
    #: of 1,000 (C 1) in one stack would not fit even an H200. Stacks beyond 100 were not
    #: measured; a stack's launches are shared (a round of 50 took twice a round of 10 on an
    #: H200, not five times), so 100 phones already share them widely.
    GPU_PHONES = 100

    def __init__(self, static: bool | None = None, phones: int | None = None) -> None:
        self._lock = threading.Lock()  # one stack at a time (torch's global seed)
        self.static = static
        self.phones = phones
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

    def stack_size(self, t: LocalTask, tasks: int) -> int:
        """How many of a group of `tasks` like `t` one stack trains."""
        if self.phones is not None:
            return max(1, min(self.phones, tasks))
        if resolve_device(t.device).type == "cuda":
            return min(self.GPU_PHONES, tasks)
        params = sum(math.prod(shape) for shape, _ in expected_shapes(t.model_config).values())
        fits = self.STACK_BYTES // (6 * 4 * params)
        return max(1, min(fits, self.CPU_PHONES, tasks))

    def run(
        self, tasks: list[LocalTask], global_state: dict[str, Tensor]
    ) -> dict[str, TrainResult]:
        from fedkey.device_sim.training.backends import ordered

        return ordered(tasks, self.stream(tasks, global_state))

    def stream(
        self, tasks: Iterable[LocalTask], global_state: dict[str, Tensor]
    ) -> Iterator[tuple[str, TrainResult | None]]:
        groups: dict[tuple[str, str, str], list[LocalTask]] = {}
        for t in tasks:
            groups.setdefault((repr(t.model_config), repr(t.train), t.device), []).append(t)
        with self._lock:
            for group in groups.values():
                first = group[0]
                size = self.stack_size(first, len(group))
                group = sorted(group, key=lambda t: -plan_length(t.shard, t.train))
                for c in range(0, len(group), size):
                    chunk = group[c : c + size]
                    stack = self._stack_for(first, size)
                    shards = [(t.shard, t.seed) for t in chunk]
                    trained = train_stacked(
                        first.model_config, global_state, shards, first.train, first.device, stack
                    )
                    for t, result in zip(chunk, trained, strict=True):
                        yield t.device_id, before_upload(result, t.seed, t.beta, t.sigma)

    def submit(self, task: LocalTask, global_state: dict[str, Tensor]) -> Future:
        return settled(partial(self.train, task, global_state))

    def train(self, task: LocalTask, global_state: dict[str, Tensor]) -> TrainResult:
        return self.run([task], global_state)[task.device_id]

    def close(self) -> None:
        self._stacks.clear()
