"""The strategy interface the round engine talks to, and the update record it hands over.

A strategy answers four questions per round: who trains (:meth:`Strategy.select`), who of those
uploads (:meth:`Strategy.select_uploaders`), how the uploads become the next global model
(:meth:`Strategy.aggregate`) and what to remember for later rounds (:meth:`Strategy.after_round`).
The arithmetic lives in :mod:`server.strategies.aggregate`; classes here only hold hyperparameters
and cross-round memory, which :meth:`Strategy.state_dict` makes JSON-serializable so a restarted
server resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from server.strategies.aggregate import StateDict
from server.strategies.selection import make_selector


@dataclass
class ClientUpdate:
    """One client's upload: its trained state, its n_k, its reported local training loss."""

    state: dict[str, Tensor]
    num_samples: int
    train_loss: float
    device_id: str


class Strategy:
    """Base class: uniform or AdaFL selection, everyone uploads, subclasses aggregate.

    Selection options (every strategy except FedSGD accepts them):
      fraction: C, the share of available devices sampled per round by the uniform selector.
      selector: ``"uniform"`` (default) or ``"adafl"`` (002; then ``fraction`` is unused and the
        dynamic fraction gamma_t is used instead).
      alpha, gamma_start, gamma_end, gamma_steps: AdaFL's decay and fraction schedule.
    """

    name: ClassVar[str] = "base"
    #: Local epochs the engine must use instead of its own setting (FedSGD: 1); None = no override.
    local_epochs_override: int | None = None

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
        self._selection_config = {
            "fraction": self.fraction,
            "selector": selector,
            "alpha": alpha,
            "gamma_start": gamma_start,
            "gamma_end": gamma_end,
            "gamma_steps": gamma_steps,
        }
        self.client_sizes: dict[str, int] = {}
        self.total_rounds = 0
        self.last_info: dict[str, Any] = {}

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
        self, global_state: Mapping[str, Tensor], updates: Iterable[ClientUpdate]
    ) -> StateDict:
        """The next global model. ``updates`` is iterated exactly once; with no updates the global
        model is returned unchanged (copied)."""
        it = iter(updates)
        first = next(it, None)
        if first is None:
            self.last_info = {"strategy": self.name, "mode": "none", "num_updates": 0}
            return {k: v.detach().clone() for k, v in global_state.items()}
        return self._aggregate(global_state, _chain(first, it))

    def _aggregate(
        self, global_state: Mapping[str, Tensor], updates: Iterator[ClientUpdate]
    ) -> StateDict:
        raise NotImplementedError

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
