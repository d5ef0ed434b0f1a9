"""What plans a round (fedkey.federation.plan): the cohort, drawn reproducibly from the run's seed
(or under DP from its secret), and the task the cohort trains."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedkey.common.config import TrainConfig
from fedkey.federation.config import FederationConfig, PrivacyConfig, scheduled_lr
from fedkey.federation.plan import RoundPlan, choose_cohort, plan_round, round_task
from fedkey.testing.federation import tiny_federation

PHONES = [f"p{i:02d}" for i in range(12)]


def make_fed(tmp_path, **kw):
    return tiny_federation(tmp_path, FederationConfig(**{"fraction": 0.25, "seed": 3, **kw}), 12)


def test_a_plan_is_a_function_of_the_seed_the_round_and_the_attempt(tmp_path):
    a, b = make_fed(tmp_path / "a"), make_fed(tmp_path / "b")
    plan = plan_round(a.config, a.strategy, a.privacy, 1, list(reversed(PHONES)))
    assert isinstance(plan, RoundPlan) and plan.round == 1 and plan.attempt == 0
    assert plan.population == 12 and len(plan.cohort) == 3 and plan.cohort == sorted(plan.cohort)
    assert plan == replace(b.plan_round(PHONES), started=plan.started)
    args = (a.config, a.strategy, a.privacy)
    draws = {tuple(choose_cohort(*args, r, PHONES, attempt)) for r in (1, 2) for attempt in (0, 1)}
    assert len(draws) == 4  # another round, another attempt: a fresh draw
    other = make_fed(tmp_path / "c", seed=4)
    seeds = {
        tuple(choose_cohort(f.config, f.strategy, f.privacy, r, PHONES))
        for f in (a, other)
        for r in (1, 2, 3)
    }
    assert len(seeds) > 3


def test_under_dp_the_cohort_comes_from_the_secret_not_the_seed(tmp_path):
    privacy = PrivacyConfig(clip_norm=0.05, secret="plan")
    a = make_fed(tmp_path / "a", privacy=privacy)
    b = make_fed(tmp_path / "b", privacy=privacy, seed=9)
    assert a.plan_round(PHONES).cohort == b.plan_round(PHONES).cohort  # same secret
    c = make_fed(tmp_path / "c", privacy=replace(privacy, secret="another"))
    cohorts = {tuple(f.plan_round(PHONES, attempt).cohort) for f in (a, c) for attempt in (0, 1, 2)}
    assert len(cohorts) > 3


@pytest.mark.parametrize("strategy, epochs", [("fedavg", 2), ("fedsgd", 1)])
def test_the_task_follows_the_lr_schedule_and_the_strategys_epochs(tmp_path, strategy, epochs):
    train = TrainConfig(epochs=2, lr=1.0)
    fed = make_fed(tmp_path, strategy=strategy, train=train, lr_decay=0.5)
    for r in (1, 3):
        task = round_task(fed.config, fed.strategy, r)
        assert task.lr == scheduled_lr(1.0, 0.5, r) and task.epochs == epochs
