"""The `fedkey-bench peers` workload in Apple's pfl-research, run in its own venv (.venv-peers/pfl):
.venv-peers/pfl/bin/torchrun --standalone --nproc_per_node W experiments/peers/pfl/run.py SHARDS
(W worker processes of one torch thread each, pfl's multi-worker simulation on torch.distributed's
gloo; or plain python for one worker).

pfl's FederatedAveraging on a SimulatedBackend: its PyTorchModel trains each phone with pfl's own
local loop (do_multiple_epochs_of: the model's `loss` per batch of B sentences, the gradient norm
clipped, the local optimizer SGD with fedkey's momentum), the deltas weighted by the words each
phone predicts (a WeightingStrategy, as fedkey weights) and averaged, the central optimizer SGD
at lr 1 (plain FedAvg).

Round r trains exactly the phones of the shards' cohort r (fedkey's selection, drawn by the
bench): the user sampler hands them out in order, each as the user "r:phone", whose dataset is
that phone's sentences in the order fedkey's trainer takes them in round r (its seed of the
round; E = 1: pfl does not reshuffle). The FederatedDataset has each user's weight
(`user_id_to_weight`: the words it predicts, pfl's proxy of its training time), so pfl splits a
cohort between its workers by words, largest first onto the least loaded worker, not by count.
With the shards' precision bf16 the model's forward runs under torch.autocast bf16
(workload.LanguageModel.nll; pfl's own `amp_dtype` would wrap the same autocast around its
steps). The global model is scored before the first round and after each on the validation and
test sentences, as pfl's central evaluation does it (each worker its part, the metrics
all-reduced). Worker 0 prints one JSON line (workload.Clock.line) at the end, with the cohorts
trained.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/peers: workload

import numpy as np
import torch
import workload
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightingStrategy
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.internal import ops
from pfl.internal.ops.selector import get_default_framework_module
from pfl.metrics import Metrics, StringMetricName, Weighted
from pfl.model.pytorch import PyTorchModel
from pfl.version import __version__ as pfl_version


class PflLanguageModel(workload.LanguageModel):
    """workload.LanguageModel with what pfl's PyTorchModel calls: `loss` (the mean loss over the
    batch's real words) and `metrics` (the summed NLL over them, weighted by their count). pfl
    hands the batches over as float tensors: the ids come back as integers here."""

    def _nll(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        inputs, targets = inputs.long(), targets.long()
        width = int((targets != workload.IGNORE).sum(1).max())  # the batch's padding only
        return self.nll(inputs[:, :width], targets[:, :width])

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, eval: bool = False):
        self.train()
        total, n = self._nll(inputs, targets)
        return total / n

    @torch.no_grad()
    def metrics(self, inputs: torch.Tensor, targets: torch.Tensor, eval: bool = True):
        self.eval()
        total, n = self._nll(inputs, targets)
        return {"nll": Weighted(float(total), n)}


def padded(sentences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    inputs, targets = workload.pad_batch(sentences)
    return inputs.numpy(), targets.numpy()


class WeightByWords(WeightingStrategy):
    """A phone's delta weighted by the words it predicts (fedkey's n_k), not its sentences."""

    def __init__(self, words: dict[str, int]):
        self.words = words

    def postprocess_one_user(self, *, stats, user_context):
        stats.reweight(self.words[user_context.user_id])
        return stats, Metrics()


def cohorts(rounds: list[list[int]]) -> Iterator[str]:
    """The users of round 1's cohort, then round 2's, ..., as "r:phone": every worker draws the
    same sequence. Past the last round it starts over (pfl's sampler caches samples ahead of
    the rounds; those are never trained)."""
    for _ in count():
        for r, cohort in enumerate(rounds, start=1):
            yield from (f"{r}:{phone}" for phone in cohort)


def parse(user_id: str) -> tuple[int, int]:
    """(round, phone) of a user id "r:phone"."""
    r, phone = user_id.split(":")
    return int(r), int(phone)


class EveryRound(TrainingProcessCallback):
    """Validation and test perplexity (and the unseen senders', where the shards have them) of
    the global model before the first round and after each, by pfl's distributed central
    evaluation; the times go to the clock."""

    def __init__(self, clock: workload.Clock, batch_size: int = 64):
        self.clock = clock
        self.params = NNEvalHyperParams(local_batch_size=batch_size)
        self.parts = []
        shards = clock.shards
        for sentences in [shards.valid, shards.test] + ([shards.unseen] if shards.unseen else []):
            ordered = sorted(sentences, key=len)  # less padding, as fedkey scores
            self.parts.append(Dataset(raw_data=list(padded(ordered))).get_worker_partition())

    def _score(self, model) -> None:
        self.clock.begin()
        ppl = []
        for part in self.parts:
            metrics = ops.all_reduce_metrics(model.evaluate(part, StringMetricName, self.params))
            ppl.append(math.exp(metrics[StringMetricName("nll")].overall_value))
        self.clock.record(*ppl)

    def on_train_begin(self, *, model) -> Metrics:
        self._score(model)
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        self._score(model)
        return False, Metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", help="the .npz fedkey_bench.peers.runner wrote")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    data = workload.Shards(args.shards)
    meta = data.meta
    trained: list[str] = []

    def user_dataset(user_id: str) -> Dataset:
        rnd, phone = parse(user_id)
        trained.append(user_id)
        seqs = workload.split_long(data.phones[phone], meta["max_len"])
        # fedkey's trainer's order of the round (workload.local_batches' first epoch).
        gen = torch.Generator().manual_seed(data.seed(rnd, phone))
        order = torch.randperm(len(seqs), generator=gen).tolist()
        return Dataset(raw_data=list(padded([seqs[j] for j in order])), user_id=user_id)

    cohort_size = len(data.cohorts[0])
    draws = cohorts(data.cohorts)
    words = {f"{r}:{k}": workload.count_targets(data.phones[k])
             for r, cohort in enumerate(data.cohorts, start=1) for k in cohort}  # fmt: skip
    training = FederatedDataset(user_dataset, lambda: next(draws), user_id_to_weight=words)
    backend = SimulatedBackend(training_data=training, val_data=None,
                               postprocessors=[WeightByWords(words)])  # fmt: skip
    module = PflLanguageModel(meta["vocab_size"], meta["hidden_size"], meta["precision"])
    workload.load_state(module, data.init)
    model = PyTorchModel(
        model=module,
        local_optimizer_create=functools.partial(torch.optim.SGD, momentum=meta["momentum"]),
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    clock = workload.Clock(data)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=meta["rounds"],
            # pfl scores each phone's own data before and after training in the rounds it
            # evaluates; only the first (0 % anything): fedkey does not do it.
            evaluation_frequency=meta["rounds"] + 1,
            train_cohort_size=cohort_size,
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=meta["local_epochs"],
            local_learning_rate=meta["lr"],
            local_batch_size=meta["batch_size"],
            local_max_grad_norm=meta["clip"] or None,
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=64),
        callbacks=[EveryRound(clock)],
    )
    distributed = get_default_framework_module().distributed
    # Every worker's trained users, gathered on worker 0 (a cohort split between the workers).
    everyone = [trained]
    if distributed.world_size > 1:
        import torch.distributed as dist

        everyone = [None] * distributed.world_size
        dist.all_gather_object(everyone, trained)
    if distributed.global_rank == 0:
        by_round: dict[int, list[int]] = {}
        for r, phone in (parse(u) for part in everyone for u in part):
            by_round.setdefault(r, []).append(phone)
        done = [sorted(set(by_round.get(r, []))) for r in range(1, meta["rounds"] + 1)]
        workers = distributed.world_size
        print(clock.line("pfl", pfl_version, started, workers=workers, cohorts=done), flush=True)


if __name__ == "__main__":
    main()
