"""The strategy interface the round engine talks to, and the update record it hands over.

A strategy answers four questions per round: who trains (:meth:`Strategy.select`), who of those
uploads (:meth:`Strategy.select_uploaders`), how the uploads become the next global model
(:meth:`Strategy.aggregate`, which returns it with a JSON-serializable info dict for the round's
metrics row) and what to remember for later rounds (:meth:`Strategy.after_round`).
The arithmetic lives in :mod:`fedkey.federation.strategies.aggregate`; classes here only hold hyperparameters
and cross-round memory, which :meth:`Strategy.state_dict` makes JSON-serializable so a restarted
server resumes where it stopped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeAlias, runtime_checkable

import numpy as np
from torch import Tensor

from fedkey.federation.strategies.aggregate import StateDict
from fedkey.federation.strategies.selection import make_selector

#: What :meth:`Strategy.aggregate` reports about a round besides the new model (JSON-serializable:
#: it goes into the metrics row as ``info``).
Info: TypeAlias = dict[str, Any]


@dataclass(frozen=True)
class Bound:
    """What the server's clip guarantees of every update of a round (fedkey.federation.influence.bounding makes it):
    each delta's whole-model L2 norm is at most ``norm`` (S) and layer ``k``'s at most
    ``layers[k]`` (S_l; equal to S under the model scope). ``temperature`` is the attention cap:
    attentive strategies divide their scores by ``temperature`` times the bound.

    ``distance_caps`` (with the coordinate trim, never under DP): per layer, the round's
    (k+1)-th largest bounded layer distance ``||u_k^l||`` (k the trim's count). FedAtt counts
    no distance beyond it, so the k farthest phones score as the (k+1)-th farthest: the
    winsorizing the trim applies to every coordinate, applied to the attention's input.
    None: distances are used as they are."""

    norm: float
    layers: Mapping[str, float]
    scope: Literal["model", "layer"] = "model"
    temperature: float = 1.0
    distance_caps: Mapping[str, float] | None = None


@dataclass
class ClientUpdate:
    """One client's upload: its trained state, its n_k, its reported local training loss."""

    state: Mapping[str, Tensor]
    num_samples: int
    train_loss: float
    device_id: str


@runtime_checkable
class SummableRound(Protocol):
    """A round's bounded updates that can also be summed in one read instead of iterated
    (fedkey.federation.influence.bounding.BoundedRound): the strategies whose next model is a weighted sum of the
    deltas (FedAvg, FedAtt) sum them this way (:meth:`Strategy._aggregate_sum`)."""

    updates: Sequence[ClientUpdate]  # the updates, unbounded (their ids and declared n_k)
    samples: list[int]  # the weights n_k the strategy sees (capped; 1 under DP)

    def distances(self) -> list[dict[str, float]] | None:
        """Each update's bounded layer distances ``||u_k^l||``; None: iterate instead."""
        ...

    def weighted_sum(self, coefs: Sequence[Mapping[str, float]]) -> dict[str, Tensor]:
        """Per layer ``sum_k c_k^l u_k^l`` over the bounded deltas, float64."""
        ...


class Strategy(ABC):
    """Base class: uniform or AdaFL selection, everyone uploads, subclasses aggregate.

    A subclass sets :attr:`name` and implements :meth:`_aggregate` (the non-empty case of
    :meth:`aggregate`); it may override :meth:`select_uploaders`, :meth:`config` and the
    persistence methods when it has options or memory of its own.

    Selection options (every strategy except FedSGD accepts them):
      fraction: C, the share of available devices sampled per round by the uniform selector.
      selector: ``"uniform"`` (default) or ``"adafl"`` (AdaFL, Chen et al.; then ``fraction`` is
        unused and the dynamic fraction gamma_t is used instead).
      alpha, gamma_start, gamma_end, gamma_steps: AdaFL's decay and fraction schedule.
    """

    #: The strategy's name in :data:`fedkey.federation.strategies.STRATEGIES`, checkpoints and metrics.
    name: ClassVar[str]
    #: Local epochs the engine must use instead of its own setting (FedSGD: 1); None = no override.
    local_epochs_override: ClassVar[int | None] = None

    def __init__(
        self,
        *,
        fraction: float = 0.1,
        selector: str = "uniform",
        alpha: float = 0.9,
        gamma_start: float = 0.1,
        gamma_end: float = 0.5,
        gamma_steps: int = 5,
    ) -> None:
        self.fraction = float(fraction)
        self.selector_name = selector
        self.selector = make_selector(
            selector, fraction, alpha, gamma_start, gamma_end, gamma_steps
        )
        self._selection_config: dict[str, Any] = {
            "fraction": self.fraction,
            "selector": selector,
            "alpha": alpha,
            "gamma_start": gamma_start,
            "gamma_end": gamma_end,
            "gamma_steps": gamma_steps,
        }
        self.client_sizes: dict[str, int] = {}
        self.total_rounds = 0

    # ------------------------------------------------------------------ round hooks

    def setup(self, client_sizes: Mapping[str, int], total_rounds: int) -> None:
        """Learn the clients' sizes n_k and the run length; may be called again as devices enroll."""
        self.client_sizes.update({str(k): int(v) for k, v in client_sizes.items()})
        self.total_rounds = int(total_rounds)
        self.selector.setup(self.client_sizes, self.total_rounds)

    def select(
        self, round_idx: int, available_device_ids: Iterable[str], rng: np.random.Generator
    ) -> list[str]:
        """The round's cohort, sorted by device id, drawn with ``rng``."""
        return self.selector.select(round_idx, available_device_ids, rng)

    def select_uploaders(self, round_idx: int, losses: Mapping[str, float]) -> list[str]:
        """Of the devices that trained and reported a loss, those asked to upload (all here)."""
        return sorted(losses)

    def aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Iterable[ClientUpdate],
        bound: Bound | None = None,
    ) -> tuple[StateDict, Info]:
        """The next global model and the round's info (``strategy``, ``mode``, ``num_updates`` and
        what the method reports). ``updates`` is iterated exactly once (a :class:`SummableRound`
        that the strategy can sum is read once by its ``weighted_sum`` instead); with no updates
        the global model is returned unchanged (copied). ``bound``: the clip every update
        satisfies (attentive strategies then cap their weights); None: unbounded, the papers'
        methods as published."""
        if isinstance(updates, SummableRound) and updates.updates:
            done = self._aggregate_sum(global_state, updates, bound)
            if done is not None:
                return done
        it = iter(updates)
        first = next(it, None)
        if first is None:
            info: Info = {"strategy": self.name, "mode": "none", "num_updates": 0}
            return {k: v.detach().clone() for k, v in global_state.items()}, info
        return self._aggregate(global_state, _chain(first, it), bound)

    @abstractmethod
    def _aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Iterator[ClientUpdate],
        bound: Bound | None,
    ) -> tuple[StateDict, Info]:
        """:meth:`aggregate` for at least one update: iterate ``updates`` once, return the next
        global model and the info dict."""

    def _aggregate_sum(
        self, global_state: Mapping[str, Tensor], updates: SummableRound, bound: Bound | None
    ) -> tuple[StateDict, Info] | None:
        """:meth:`aggregate` from one weighted sum of the round's bounded deltas
        (:class:`SummableRound`), for a strategy whose next model is one; None (the default,
        and where the round cannot be summed): :meth:`_aggregate` iterates the round."""
        return None

    def sensitivity(self, global_state: Mapping[str, Tensor], bound: Bound, m: int) -> float:
        """Replace-one L2 sensitivity of :meth:`aggregate`'s output over cohorts of ``m`` updates
        that satisfy ``bound`` (with every weight n_k = 1), derived in
        :mod:`fedkey.federation.strategies.sensitivity`. Raises ValueError where there is no analysis."""
        raise ValueError(
            f"strategy {self.name!r} has no sensitivity analysis: it cannot run under DP"
        )

    def after_round(
        self, round_idx: int, new_state: Mapping[str, Tensor], updates: Iterable[ClientUpdate]
    ) -> None:
        """Post-aggregation memory (AdaFL scores). Iterates ``updates`` once, and only when the
        selector needs it (:attr:`needs_second_pass`)."""
        if self.selector.needs_after_round:
            self.selector.after_round(round_idx, new_state, updates)

    @property
    def needs_second_pass(self) -> bool:
        """Whether :meth:`after_round` reads the updates (the engine may skip reloading them)."""
        return self.selector.needs_after_round

    # ------------------------------------------------------------------ persistence

    def config(self) -> dict[str, Any]:
        """The hyperparameters, JSON-serializable."""
        return dict(self._selection_config)

    def state_dict(self) -> dict[str, Any]:
        """Cross-round memory (JSON-serializable)."""
        return {
            "strategy": self.name,
            "config": self.config(),
            "client_sizes": dict(self.client_sizes),
            "total_rounds": self.total_rounds,
            "selector": self.selector.state_dict(),
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the strategy name must match."""
        if d.get("strategy", self.name) != self.name:
            raise ValueError(f"state is for strategy {d.get('strategy')!r}, not {self.name!r}")
        self.client_sizes = {str(k): int(v) for k, v in d.get("client_sizes", {}).items()}
        self.total_rounds = int(d.get("total_rounds", 0))
        sel = d.get("selector", {})
        if sel.get("name", self.selector.name) != self.selector.name:
            raise ValueError(
                f"state has selector {sel.get('name')!r}, this strategy uses {self.selector.name!r}"
            )
        self.selector.load_state_dict(sel)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({opts})"


def _chain(first: ClientUpdate, rest: Iterator[ClientUpdate]) -> Iterator[ClientUpdate]:
    yield first
    yield from rest
