"""The federation's configs as plain data: what a round engine is built from. Standard library
only (no torch), so the command line and `Settings` can build them cheaply. Every list of choices
the server offers is defined here once, as a Literal the command line and Settings reuse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from common.config import TrainConfig

#: The aggregation methods (server.strategies.STRATEGIES has a class for each, and `adafl`).
StrategyName = Literal["fedsgd", "fedavg", "fedatt", "fedattopt", "fedmed"]
STRATEGY_NAMES: tuple[StrategyName, ...] = get_args(StrategyName)
#: FedAtt's layer distance: the flattened L2 norm, or the matrix 2-norm of the original code.
Norm = Literal["l2", "spectral"]
NORMS: tuple[Norm, ...] = get_args(Norm)

ServerOptName = Literal["none", "momentum", "adam"]
OPTIMIZERS: tuple[ServerOptName, ...] = get_args(ServerOptName)


@dataclass
class ServerOptConfig:
    name: ServerOptName = "none"
    lr: float = 1.0
    momentum: float = 0.9  # FedAvgM's beta; Adam's beta1
    beta2: float = 0.99  # Adam
    tau: float = 1e-3  # Adam's adaptivity (Reddi et al.'s epsilon)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(
                f"unknown server optimizer {self.name!r}; valid: {', '.join(OPTIMIZERS)}"
            )


@dataclass
class PrivacyConfig:
    """Client-side randomization of the seed papers (beta) and/or DP-FedAvg (clip + noise + accountant)."""

    beta: float = (
        0.0  # the seed papers: each device adds beta * N(0, sigma^2) before upload; no guarantee
    )
    sigma: float = 1.0
    clip_norm: float | None = None  # DP-FedAvg: clip each update's L2 norm to S ...
    noise_multiplier: float = 1.0  # ... and add N(0, (z S)^2) to the sum of updates
    delta: float = 1e-5
    target_epsilon: float | None = None  # stop the run once this budget is spent

    @property
    def dp_fedavg(self) -> bool:
        return self.clip_norm is not None


@dataclass
class FederationConfig:
    strategy: StrategyName = "fedavg"
    label: str | None = None  # what metrics and checkpoints call the run (default: the strategy)
    strategy_params: dict = field(default_factory=dict)  # epsilon, norm, beta, selector, ...
    fraction: float = 0.1
    rounds: int = 10
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    lr_decay: float = 1.0  # round r trains with lr * lr_decay ** (r - 1)
    eval_batch_size: int = 64
    ksr_sentences: int = 100  # keystroke savings are costly: measured on the first N test sentences
