"""The cells of `fedkey-bench dpfinetune`: what each run of a population is, as a `fedkey simulate`
command line built from a :class:`Protocol`.

Per population (:data:`POPULATIONS`, one phone per sender, `--partition user`), every run starts
from the public base (`--init`, the shipped Chit-Chat-pretrained model) with its public 3-gram
(`--ngram`: every round's row scores the mixture too), and shares R rounds of C of the phones,
one local epoch, lr 0.5 decayed 0.95 a round, fp32:

* ``<strategy>-nodp``: the non-private fine-tune. Its server clips every update to the round's
  median update norm (`--bound adaptive --bound-multiple 1`): the clip the DP cells' adaptive
  clipping tracks (quantile 0.5), without its noise; the coordinate trim and the outlier filter
  off (`--trim 0 --outlier-z 0`), as DP has them. FedAvg's is the reference of every multiple.
* ``<strategy>-z0``: the DP cells' algorithm without its noise (`--dp-noise-multiplier 0`):
  the uniform mean of updates clipped by adaptive clipping from S0, so that what the noise costs
  (the DP cells against it) is told apart from what DP-FedAvg's uniform weights and slow clip
  cost (it against the non-private fine-tune). Its epsilon is infinite.
* ``<strategy>-eps<E>``: DP-FTRL with BLT noise (`--dp-mechanism blt`) and adaptive clipping
  from the first clip S0 (`--dp-clip S0 --dp-clip-quantile 0.5`), z calibrated by fedkey so that
  the planned rounds end at epsilon E (`--dp-target-epsilon E`), delta fedkey's 1/N^1.1.

FedAtt runs with the fixed normalizer (`--fedatt-normalizer fixed`), whose sensitivity is
DP-FedAvg's 2 S / m times the server step: the paper's softmax attention is allowed under DP,
but its sensitivity bound is several times larger (fedkey.federation.strategies.sensitivity; the
privacy bench's IRC table: it diverges at epsilon 8). Its server step is fedkey's default, 1.2
(`--epsilon 1.2`, as the privacy bench's fixed FedAtt): the fixed normalizer's aggregate is
(1/m) sum_k w_k u_k with w_k in [1/e, 1], below the mean, so 1.2 keeps its step near FedAvg's,
where the typing bench's 0.4 (for softmax weights, which sum to 1) takes about a third of it.

The base alone is no run: it is round 0 of every run (the same model on the same text).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

#: Every run's local training (the typing bench's): one epoch, lr 0.5 decayed 0.95 a round, fp32.
LOCAL = ("--local-epochs", "1", "--lr", "0.5", "--lr-decay", "0.95", "--precision", "fp32")
#: The non-private fine-tune's bound: the round's median update norm, no trim, no outlier filter.
NODP_BOUND = ("--bound", "adaptive", "--bound-multiple", "1", "--trim", "0", "--outlier-z", "0")
#: The DP cells' mechanism and clipping rule (the first clip S0 aside).
DP_RULE = ("--dp-mechanism", "blt", "--dp-clip-quantile", "0.5")
#: FedAtt's normalizer and server step (fedkey's default step; the module's docstring says why).
FEDATT = ("--fedatt-normalizer", "fixed", "--epsilon", "1.2")
#: The strategies a cell can run, as `fedkey simulate` options.
STRATEGIES = {"fedavg": ("--strategy", "fedavg"), "fedatt": ("--strategy", "fedatt", *FEDATT)}
LABELS = {"fedavg": "FedAvg", "fedatt": "FedAtt"}
EPSILONS = (1.0, 2.0, 4.0, 8.0)
#: The non-private fine-tune: the reference of every multiple, and the source of S0.
REFERENCE = "fedavg-nodp"


@dataclass(frozen=True)
class Population:
    """A population of phones, one per sender: its `--data`, and the size and share of a round it
    runs at unless the protocol says otherwise."""

    name: str
    label: str
    data: str  # `fedkey simulate --data`
    clients: int  # --clients: its K most active senders
    fraction: float


#: One entry per population; a second (e.g. `--data chitchat-heldout`, the Chit-Chat senders the
#: base never saw) is one more line, with its own size and share.
POPULATIONS = {
    # All 15,853 training senders; C 0.0631: cohorts of 1,000 (as production's, the noise of a
    # round's mean falls as 1/m at the same epsilon), about 10,000 messages a round.
    "ubuntu-irc": Population("ubuntu-irc", "Ubuntu IRC", "ubuntu-irc", 15_853, 0.0631),
}


@dataclass(frozen=True)
class Protocol:
    """What every cell of a population shares (`fedkey-bench dpfinetune`'s options)."""

    init: str = "base"
    ngram: str = "base"
    clients: int | None = None  # None: the population's
    fraction: float | None = None  # None: the population's
    rounds: int = 3  # with b = floor(N / m) >= R no phone trains twice
    workers: int = 2
    max_eval_sentences: int = 500
    epsilons: tuple[float, ...] = EPSILONS
    strategies: tuple[str, ...] = ("fedavg", "fedatt")
    clip: float | None = None  # S0; None: the non-private fine-tune's first median update norm

    def clients_of(self, pop: Population) -> int:
        return pop.clients if self.clients is None else self.clients

    def fraction_of(self, pop: Population) -> float:
        return pop.fraction if self.fraction is None else self.fraction


@dataclass(frozen=True)
class Cell:
    """One run: its strategy and target epsilon (None: no DP; with `noise` False, the DP rule
    without its noise)."""

    strategy: str
    epsilon: float | None
    noise: bool = True

    @property
    def id(self) -> str:
        if not self.noise:
            return f"{self.strategy}-z0"
        return f"{self.strategy}-" + ("nodp" if self.epsilon is None else f"eps{self.epsilon:g}")

    @property
    def label(self) -> str:
        name = LABELS[self.strategy]
        if not self.noise:
            return f"DP-{name} without its noise (z 0)"
        return f"{name}, no DP" if self.epsilon is None else f"DP-{name}, epsilon {self.epsilon:g}"

    @property
    def private(self) -> bool:
        """Whether it runs the DP rule (the clip, the uniform mean; noise or not)."""
        return self.epsilon is not None or not self.noise


def cells(p: Protocol) -> list[Cell]:
    """The non-private fine-tunes (FedAvg's always: the reference), then each strategy at each
    epsilon, strongest guarantee last, then its DP rule without noise."""
    strategies = ["fedavg", *(s for s in p.strategies if s != "fedavg")]
    nodp = [Cell(s, None) for s in strategies]
    eps = sorted(set(p.epsilons), reverse=True)
    private = [Cell(s, e) for s in p.strategies for e in eps]
    return nodp + private + [Cell(s, None, noise=False) for s in p.strategies]


def selected(all_cells: list[Cell], only: list[str] | None) -> list[Cell]:
    """The cells whose id matches one of the `only` globs (all of them without any)."""
    if not only:
        return all_cells
    return [c for c in all_cells if any(fnmatch.fnmatchcase(c.id, g) for g in only)]


def clip_text(clip: float) -> str:
    """S0 as the command line gives it: three significant digits, so that the command (and with
    it whether a cell is done) does not move with the last digits of a measured norm."""
    return f"{clip:.3g}"


def argv(pop: Population, p: Protocol, cell: Cell, clip: str | None) -> tuple[str, ...]:
    """The cell's `fedkey simulate` command, without --out; `clip`: S0 as the command gives it
    (:func:`clip_text`; a DP cell needs it)."""
    if cell.strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {cell.strategy!r}; choose from {', '.join(STRATEGIES)}")
    shared = (
        "fedkey", "simulate", "--init", p.init, "--ngram", p.ngram, "--data", pop.data,
        "--partition", "user", "--clients", str(p.clients_of(pop)),
        "--fraction", f"{p.fraction_of(pop):g}", "--rounds", str(p.rounds), *LOCAL,
        "--max-eval-sentences", str(p.max_eval_sentences), "--workers", str(p.workers),
        "--keep-checkpoints", "1", *STRATEGIES[cell.strategy],
    )  # fmt: skip
    if not cell.private:
        return (*shared, *NODP_BOUND)
    if clip is None:
        raise ValueError(f"{cell.id}: a DP cell needs its first clip S0")
    noise = (("--dp-target-epsilon", f"{cell.epsilon:g}") if cell.noise
             else ("--dp-noise-multiplier", "0"))  # fmt: skip
    return (*shared, *DP_RULE, "--dp-clip", clip, *noise)
