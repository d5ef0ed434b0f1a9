"""The workload of `fedkey-bench peers` as another framework's script sees it: torch and numpy
only (no fedkey), imported by peers/flower/run.py and peers/pfl/run.py in their own venvs.

Each piece mirrors fedkey's own, so the frameworks train the same model on the same data the same
way; only who schedules, ships and averages the work differs:

* the shards: the .npz that fedkey_bench.peers.runner writes with fedkey's corpus code (each phone's encoded
  sentences, the validation and test sentences, the initial weights fedkey's round 0 has), and
  the rounds' cohorts as fedkey's selection draws them, with each phone's training seed of the
  round (fedkey.federation.seeds.client_seed): every framework trains the same phones of a round
  on batches in the same order;
* LanguageModel: models/model.py's, a 1-layer GRU with tied embeddings, no dropout, initialized
  as fedkey initializes (embedding U(-0.1, 0.1), decoder bias 0, torch's GRU default), then given
  the shared initial weights;
* local_batches / train_local: device_sim/training/trainer.py's loop (sentences longer than max_len + 1
  cut, a seeded permutation per epoch, padded batches of B sentences, the mean loss over the real
  words, gradient-norm clipping, SGD with momentum);
* perplexity: models/metrics.py's, exp of the summed NLL of every predicted word (end of sentence
  included) over their count;
* precision: the shards' meta "precision"; bf16 runs the model's forward (embedding, GRU, softmax
  layer) under torch.autocast(cpu, bfloat16) with float32 weights and the loss from the logits
  cast back to float32, as fedkey.models.precision describes its bf16 (fedkey's CPU trainer
  writes its recurrence out instead; the peers take torch's GRU as autocast runs it). Flower and
  pfl both run it here, in LanguageModel.nll.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn

IGNORE = -100  # fedkey.models.batching.IGNORE: a padded target


class LanguageModel(nn.Module):
    """Embedding -> GRU -> tied softmax, as fedkey.models.model.LanguageModel (cell gru, 1 layer, tied,
    dropout 0): the same parameter names, so a fedkey state dict loads as it is."""

    def __init__(self, vocab_size: int, size: int, precision: str = "fp32"):
        super().__init__()
        self.precision = precision
        self.embedding = nn.Embedding(vocab_size, size)
        self.rnn = nn.GRU(size, size, num_layers=1, batch_first=True)
        self.decoder = nn.Linear(size, vocab_size)
        self.decoder.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def logits_at(self, tokens: Tensor, keep: Tensor) -> Tensor:
        """Logits [n, vocab] at the n real (not padded) positions: the softmax on real words only."""
        out, _ = self.rnn(self.embedding(tokens))
        index = keep.flatten().nonzero().squeeze(1)
        logits: Tensor = self.decoder(out.flatten(0, 1).index_select(0, index))
        return logits

    def nll(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, int]:
        """(summed NLL of the batch's real targets, their count)."""
        keep = targets != IGNORE
        n = int(keep.sum())
        with autocast(self.precision):
            logits = self.logits_at(inputs, keep)
        loss = nn.functional.cross_entropy(logits.float(), targets[keep], reduction="sum")
        return loss, n


def autocast(precision: str) -> contextlib.AbstractContextManager:
    """bf16: torch.autocast on the CPU in bfloat16 (fedkey's --precision bf16); fp32: nothing."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision != "fp32":
        raise ValueError(f"precision {precision!r}: fp32 or bf16")
    return contextlib.nullcontext()


def federated_state(model: nn.Module) -> dict[str, Tensor]:
    """The tensors a round ships (fedkey.models.checkpoint.model_state): the tied decoder weight is the
    embedding, sent once."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state.pop("decoder.weight", None)
    return state


def load_state(model: nn.Module, state: dict[str, Tensor] | dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.as_tensor(state[name]))


class Shards:
    """The .npz fedkey_bench.peers.runner writes: per phone its encoded sentences (<s> ... </s> ids), the
    held-out sentences, the initial weights and the workload's settings (`meta`)."""

    def __init__(self, path: str):
        with np.load(path, allow_pickle=False) as z:
            self.meta = json.loads(str(z["meta"]))
            bounds = np.cumsum(np.concatenate([[0], z["train_lengths"]]))
            tokens = z["train_tokens"].tolist()
            sentences = [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            cuts = np.cumsum(np.concatenate([[0], z["phone_sentences"]])).tolist()
            self.phones = [sentences[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
            self.valid = _split(z["valid_tokens"], z["valid_lengths"])
            self.test = _split(z["test_tokens"], z["test_lengths"])
            # Held-out senders' messages (a corpus that has them): scored each round, as fedkey.
            has_unseen = "unseen_tokens" in z.files
            self.unseen = _split(z["unseen_tokens"], z["unseen_lengths"]) if has_unseen else []
            self.init = {k[5:]: z[k] for k in z.files if k.startswith("init.")}
            # Round r's cohort (r = 1..R: row r - 1), the phones' indices, and their seeds.
            self.cohorts: list[list[int]] = z["cohorts"].tolist()
            self.cohort_seeds: list[list[int]] = z["cohort_seeds"].tolist()

    def model(self) -> LanguageModel:
        model = LanguageModel(
            self.meta["vocab_size"], self.meta["hidden_size"], self.meta.get("precision", "fp32")
        )
        load_state(model, self.init)
        return model

    def seed(self, rnd: int, phone: int) -> int:
        """Phone `phone`'s training seed in round `rnd` (1..R): fedkey's client_seed."""
        row = self.cohorts[rnd - 1]
        return self.cohort_seeds[rnd - 1][row.index(phone)]


def _split(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    flat, bounds = tokens.tolist(), np.cumsum(np.concatenate([[0], lengths])).tolist()
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def count_targets(sentences: list[list[int]]) -> int:
    """A phone's n_k, its FedAvg weight: the words it predicts (fedkey.models.batching.count_targets)."""
    return sum(len(s) - 1 for s in sentences)


def split_long(seqs: list[list[int]], max_len: int) -> list[list[int]]:
    """fedkey.models.batching.split_long: longer sentences cut into chunks overlapping by one."""
    out: list[list[int]] = []
    for s in seqs:
        if len(s) <= max_len + 1:
            out.append(s)
            continue
        for start in range(0, len(s) - 1, max_len):
            out.append(s[start : start + max_len + 1])
    return out


def pad_batch(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    """fedkey.models.batching.pad_batch: inputs padded with 0, targets with IGNORE."""
    width = max(len(s) for s in seqs) - 1
    inputs = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        targets[i, : len(s) - 1] = torch.tensor(s[1:])
    return inputs, targets


def local_batches(
    sentences: list[list[int]], meta: dict, seed: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """fedkey.device_sim.training.trainer.local_batches: each epoch a seeded permutation, B sentences a batch."""
    seqs = split_long(sentences, meta["max_len"])
    gen = torch.Generator().manual_seed(seed)
    for _ in range(meta["local_epochs"]):
        order = torch.randperm(len(seqs), generator=gen).tolist()
        for i in range(0, len(order), meta["batch_size"]):
            yield pad_batch([seqs[j] for j in order[i : i + meta["batch_size"]]])


def train_local(model: LanguageModel, sentences: list[list[int]], meta: dict, seed: int) -> None:
    """fedkey.device_sim.training.trainer.train_local's loop: SGD with momentum on the mean loss of each batch's
    real words, the gradient norm clipped."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=meta["lr"], momentum=meta["momentum"])
    for inputs, targets in local_batches(sentences, meta, seed):
        loss, n = model.nll(inputs, targets)
        opt.zero_grad(set_to_none=True)
        (loss / n).backward()
        if meta["clip"] > 0:
            nn.utils.clip_grad_norm_(model.parameters(), meta["clip"])
        opt.step()


@torch.no_grad()
def perplexity(model: LanguageModel, sentences: list[list[int]], batch_size: int = 64) -> float:
    """exp(summed NLL / predicted words) over held-out sentences, shortest first (less padding)."""
    model.eval()
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    total, words = 0.0, 0
    for i in range(0, len(order), batch_size):
        loss, n = model.nll(*pad_batch([sentences[j] for j in order[i : i + batch_size]]))
        total, words = total + float(loss), words + n
    return math.exp(total / max(words, 1))


class Clock:
    """Per round: the wall time at its end (after its evaluation), the seconds it spent before
    its evaluation (training and aggregation) and its perplexities. Round 0 is the initial
    model's evaluation; the script prints `line()` once, at its end."""

    def __init__(self, shards: Shards):
        self.shards = shards
        self.ends: list[float] = []
        self.epoch_ends: list[float] = []  # the same by the wall clock: the bench's CPU samples
        self.train_s: list[float] = []
        self.val_ppl: list[float] = []
        self.test_ppl: list[float] = []
        self.unseen_ppl: list[float] = []

    def begin(self) -> None:
        """The round's evaluation starts: what came since the last round's end was training."""
        if self.ends:
            self.train_s.append(time.perf_counter() - self.ends[-1])

    def evaluate(self, model: LanguageModel) -> dict[str, float]:
        """Validation and test perplexity of the global model (and the unseen senders', where
        the shards have them), as fedkey's server scores every round; the time it ends is the
        round's end."""
        self.begin()
        shards = self.shards
        sets = [shards.valid, shards.test] + ([shards.unseen] if shards.unseen else [])
        return self.record(*(perplexity(model, s) for s in sets))

    def record(self, val: float, test: float, unseen: float | None = None) -> dict[str, float]:
        self.val_ppl.append(val)
        self.test_ppl.append(test)
        got = {"val_ppl": val, "test_ppl": test}
        if unseen is not None:
            self.unseen_ppl.append(unseen)
            got["unseen_ppl"] = unseen
        self.ends.append(time.perf_counter())
        self.epoch_ends.append(time.time())
        return got

    def line(self, framework: str, version: str, started: float, **extra: object) -> str:
        return json.dumps(
            {
                "framework": framework,
                "version": version,
                "torch": torch.__version__,
                "round_ends": [round(t - started, 3) for t in self.ends],
                "round_ends_epoch": [round(t, 3) for t in self.epoch_ends],
                "precision": self.shards.meta.get("precision", "fp32"),
                "train_s": [round(t, 3) for t in self.train_s],
                "val_ppl": self.val_ppl,
                "test_ppl": self.test_ppl,
                "unseen_ppl": self.unseen_ppl,
                **extra,
            }
        )
