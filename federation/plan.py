"""What plans a round: its cohort and the task the cohort trains (the round engine's first step).

    RoundPlan                     a planned round: its number, cohort, task, the population
    plan_round(...)               the plan of round r from the available phones
    choose_cohort(...)            round r's cohort: DP's where its analysis draws it, else the
                                  strategy's
    round_task(config, ...)       the training task of round r (local epochs, the lr schedule)

fedkey.federation.engine.Federation.plan_round plans its next round with these. Selection is
seeded by (seed, round, attempt), so a run without DP is deterministic; under DP the cohort is
drawn from the run's secret (fedkey.federation.privacy.round.RoundPrivacy.selection_rng), keyed
by round, so a resumed run draws the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from fedkey.common.config import TrainConfig
from fedkey.federation.config import FederationConfig, scheduled_lr
from fedkey.federation.privacy.round import RoundPrivacy
from fedkey.federation.strategies import Strategy


@dataclass
class RoundPlan:
    round: int
    cohort: list[str]
    train: TrainConfig
    started: float
    attempt: int = 0
    population: int = 0  # how many phones the cohort was drawn from (the DP accountant's N)


def choose_cohort(
    config: FederationConfig,
    strategy: Strategy,
    privacy: RoundPrivacy,
    r: int,
    available: list[str],
    attempt: int = 0,
) -> list[str]:
    """Round r's cohort, drawn from `available` with an rng seeded by (seed, round), or under DP
    keyed by the run's secret; `attempt` > 0 draws afresh (a round that missed its quorum).
    DP's cohort where its analysis fixes how it is drawn (the tree's rule, Poisson), else the
    strategy's. Strategies count rounds from 0; the engine's round 0 is the initial model."""
    rng = privacy.selection_rng(r, attempt) or np.random.default_rng(
        [config.seed, r] + ([attempt] if attempt else [])
    )
    privacy.observe(len(available))
    cohort = privacy.cohort(r, sorted(available), rng)
    if cohort is None:
        cohort = sorted(strategy.select(r - 1, sorted(available), rng))
    return cohort


def round_task(config: FederationConfig, strategy: Strategy, r: int) -> TrainConfig:
    """The task round r's cohort trains: the configured one, with the strategy's local epochs
    where it sets them and the learning rate of the schedule (--lr-decay) at round r."""
    train = config.train
    epochs = strategy.local_epochs_override
    if epochs is not None:
        train = replace(train, epochs=epochs)
    if config.lr_decay != 1.0:
        train = replace(train, lr=scheduled_lr(train.lr, config.lr_decay, r))
    return train


def plan_round(
    config: FederationConfig,
    strategy: Strategy,
    privacy: RoundPrivacy,
    r: int,
    available: list[str],
    attempt: int = 0,
) -> RoundPlan:
    """The plan of round r: its cohort from `available` (:func:`choose_cohort`) and its task
    (:func:`round_task`)."""
    cohort = choose_cohort(config, strategy, privacy, r, available, attempt)
    return RoundPlan(
        round=r,
        cohort=cohort,
        train=round_task(config, strategy, r),
        started=time.perf_counter(),
        attempt=attempt,
        population=len(available),
    )
