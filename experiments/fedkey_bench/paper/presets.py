"""The presets of `fedkey-bench paper` (presets.toml): how much of the seed papers' protocol a
bench runs.

`cpu` and `gpu` rank the methods: all of the training data, 50 rounds, the
papers' 100 IID phones, learning rates chosen on the validation set by the bench's own sweep
(Reddi et al. 2021, "Adaptive Federated Optimization", Section 5 and Appendix D: a grid over the
client and server learning rates, the best average validation metric chosen; the attentive
methods' server step epsilon likewise). `cpu` runs E = 1 at
C = 0.1 (days of background runs on two cores, resumable); `gpu` the papers' exact protocol,
E = 5 at C = 0.1 and 0.5; `smoke` is for tests and a first look.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib.resources import files
from typing import Any


@dataclass(frozen=True)
class Preset:
    """How much of the seed papers' protocol a preset runs."""

    name: str
    rounds: int
    local_epochs: int
    lr: float  # the local lr of a run whose suite does not choose it
    vocab_size: int  # the cap on the paper protocol's vocabulary (PTB has 10k words)
    ksr_sentences: int
    central_epochs: int  # a centralized run's epochs where its suite names none
    transport: str  # "inprocess" (fedkey simulate) or "http" (fedkey run)
    note: str
    suites: tuple[str, ...]  # the suites this preset runs
    max_train_tokens: int | None = None  # None: all of the training split
    max_eval_sentences: int | None = None  # validation and test sentences each (None: all)
    fractions: tuple[float, ...] = (0.1,)  # the C of the ranking suites
    sweep_rounds: int = 10  # rounds of one short run of the learning-rate sweep
    client_lrs: tuple[float, ...] = ()  # the sweep's grid of local lrs (FedAvg)
    momentum_server_lrs: tuple[float, ...] = ()  # FedAvgM's server lrs (momentum 0.9)
    adam_server_lrs: tuple[float, ...] = ()  # FedAdam's server lrs
    # FedAtt's server step epsilon: the papers' 1.2 and two smaller ones (a step past the
    # farthest phone overshoots once the softmax of distances is one-hot).
    fedatt_steps: tuple[float, ...] = (0.1, 0.3, 1.2)
    # FedAttOpt's epsilon: its step moves each delta by epsilon / d_k^2 (d_k: the phone's
    # distance, 100-150 at the cpu preset's lr), so its useful values are far above the 1.2
    # published for client lr 0.01.
    fedattopt_steps: tuple[float, ...] = (10.0, 100.0, 1000.0)
    workers: int | None = None  # --workers of every simulate (None: the CLI's default)
    backend: str | None = None  # --backend of every simulate (None: the CLI's default, local)
    # --keep-checkpoints of every federated run (0: every round's). The bench keeps a finished
    # run's best and last rounds' either way; this bounds a run still going.
    keep_checkpoints: int = 0

    @property
    def results_folder(self) -> str:
        """Results go to OUT/<this>/, runs to RUNS/<this>/<id>: the preset's name."""
        return self.name

    def central_epochs_for(self, fraction: float) -> int:
        """Epochs of the centralized model that sees as many examples as a federated run at C:
        rounds x C x E passes over the training data (each selected phone trains E epochs of its
        1/100 of it). 50 x 0.1 x 1 = 5 for `cpu`."""
        return max(1, round(self.rounds * fraction * self.local_epochs))

    def flags(
        self,
        full_train: bool = False,
        full_eval: bool = False,
        lr: float | None = None,
        rounds: int | None = None,
        clients: int = 100,
        seed: int = 0,
    ) -> list[str]:
        """The protocol's flags, shared by every federated run (``full_train`` / ``full_eval``:
        without the preset's cut of the training / evaluation data; ``lr`` / ``rounds``: other
        than the preset's; ``seed``: --seed)."""
        f = ["--paper-protocol", "--clients", str(clients), "--rounds", str(rounds or self.rounds)]
        f += ["--local-epochs", str(self.local_epochs), "--batch-size", "10"]
        f += ["--lr", f"{lr:g}" if lr is not None else str(self.lr), "--momentum", "0.5"]
        f += ["--vocab-size", str(self.vocab_size), "--ksr-sentences", str(self.ksr_sentences)]
        f += ["--seed", str(seed)]  # here: the order of the old presets' commands (runs stay done)
        if self.max_train_tokens and not full_train:
            f += ["--max-train-tokens", str(self.max_train_tokens)]
        if self.max_eval_sentences and not full_eval:
            f += ["--max-eval-sentences", str(self.max_eval_sentences)]
        if self.keep_checkpoints:
            f += ["--keep-checkpoints", str(self.keep_checkpoints)]
        if self.workers is not None:
            f += ["--workers", str(self.workers)]
        if self.backend is not None:
            f += ["--backend", self.backend]
        return f


def _load() -> dict[str, Preset]:
    """The presets of presets.toml beside this module, by name."""
    text = files(__package__).joinpath("presets.toml").read_text()
    presets = {}
    for name, table in tomllib.loads(text).items():
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in table.items()
        }
        presets[name] = Preset(name=name, **fields)
    return presets


#: The presets by name (presets.toml).
PRESETS = _load()
