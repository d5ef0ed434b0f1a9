"""The resident trainers (fedkey.device_sim.training.resident.ResidentPool): a phone's weights are
bit for bit those of the per-phone pool whichever worker trains it, a summed round is the sum of
the same phones, the data crosses once, the work is shared by words, and the held-out sets scored
in parts give the one-process figures."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedkey.device_sim.training.process_pool import run_task
from fedkey.device_sim.training.resident import ResidentPool, assign, words
from fedkey.federation.updates.summed import PartialSum, SumRule
from fedkey.models.checkpoint import build_model
from fedkey.models.held_out import fields, merged
from fedkey.models.metrics import held_out_scores, words_of
from tests.device_sim.training.test_process_pool import tasks_and_state


@pytest.fixture(scope="module")
def pool():
    pool = ResidentPool(2)
    yield pool
    pool.close()


def test_every_phone_streams_once_with_the_per_phone_pools_weights(pool):
    tasks, state = tasks_and_state(4)
    got = dict(pool.stream(tasks, state))
    assert sorted(got) == sorted(t.device_id for t in tasks)
    for t in tasks:
        want = run_task(t, state)
        assert got[t.device_id].num_tokens == want.num_tokens
        for k, v in want.state.items():
            assert torch.equal(got[t.device_id].state[k], v), (t.device_id, k)


def test_a_summed_round_is_the_sum_of_its_phones(pool):
    tasks, state = tasks_and_state(4)
    seen: list[str] = []
    total = pool.sum_round(tasks, state, SumRule(True), on_phone=lambda d, r: seen.append(d))
    want = PartialSum.empty(state, SumRule(True))
    for t in tasks:
        r = run_task(t, state)
        want.add(t.device_id, r.state, r.num_tokens, r.train_loss, state)
    assert sorted(seen) == sorted(p.device_id for p in total.phones)
    for k, s in want.sums.items():
        torch.testing.assert_close(total.sums[k], s, rtol=1e-12, atol=1e-15)


def test_a_shard_crosses_to_a_worker_once_unless_replaced(pool):
    tasks, state = tasks_and_state(2)
    first = pool._share(0, tasks, state, None)
    again = pool._share(0, tasks, state, None)
    assert set(first.shards) == {t.device_id for t in tasks} and again.shards == {}
    assert all(t.shard == [] for t in again.tasks)
    swapped = [replace(tasks[0], shard=[list(s) for s in tasks[0].shard])]  # a new object
    assert set(pool._share(0, swapped, state, None).shards) == {tasks[0].device_id}


def test_the_work_is_shared_by_words_longest_first():
    tasks, _ = tasks_and_state(6)
    shares = assign(tasks, 2)
    assert sorted(t.device_id for s in shares for t in s) == sorted(t.device_id for t in tasks)
    loads = [sum(words(t) for t in s) for s in shares]
    assert max(loads) - min(loads) <= max(words(t) for t in tasks)
    order = [t.device_id for t in tasks]
    assert all(
        [order.index(t.device_id) for t in s] == sorted(order.index(t.device_id) for t in s)
        for s in shares
    )
    assert assign(tasks, 2) == shares  # no randomness, no timing


def test_a_training_error_is_raised_here_with_the_workers_traceback(pool):
    tasks, state = tasks_and_state(2)
    broken = [replace(t, shard=[[10**9, 1]]) for t in tasks]  # an id past the vocabulary
    with pytest.raises(RuntimeError, match="(?s)training failed in worker process .*IndexError"):
        list(pool.stream(broken, state))
    assert len(dict(pool.stream(tasks, state))) == 2  # the pool still trains


def test_the_held_out_sets_scored_in_parts_give_the_one_process_figures(pool):
    from fedkey.common.config import DataConfig
    from fedkey.corpora.dataset import prepare

    prepared = prepare(DataConfig(data="demo", clients=2, max_train_tokens=600))
    tok = prepared.tokenizer
    tasks, state = tasks_and_state(2)
    config = tasks[0].model_config
    valid, test = prepared.corpus.valid[:40], prepared.corpus.test[:50]
    pool.hold_sets(tok, config, {"valid": (valid, False), "test": (test, True)}, 16, "fp32")
    tallies = pool.score(state)
    got = fields(merged(tallies["valid"]), words_of(tok, valid), merged(tallies["test"]),
                 words_of(tok, test), None)  # fmt: skip
    want = held_out_scores(build_model(config, state), tok, valid, test, 16)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == (pytest.approx(v, rel=1e-6) if v is not None else None), k


def test_without_worker_processes_the_same_code_trains_here(pool):
    tasks, state = tasks_and_state(3)
    here = ResidentPool(0)
    try:
        mine = here.sum_round(tasks, state, SumRule(False))
    finally:
        here.close()
    theirs = pool.sum_round(tasks, state, SumRule(False))
    assert sorted(p.device_id for p in mine.phones) == sorted(p.device_id for p in theirs.phones)
    for k, s in theirs.sums.items():
        torch.testing.assert_close(mine.sums[k], s, rtol=1e-12, atol=1e-15)


def test_stacked_workers_train_each_phone_as_the_stacked_backend_does():
    from fedkey.device_sim.training.stacked import StackedTrainer

    tasks, state = tasks_and_state(4)
    stacked = ResidentPool(2, stacked=True)
    try:
        got = dict(stacked.stream(tasks, state))
        total = stacked.sum_round(tasks, state, SumRule(True))
    finally:
        stacked.close()
    want = dict(StackedTrainer().stream(tasks, state))
    assert sorted(got) == sorted(want) == sorted(p.device_id for p in total.phones)
    for d, result in want.items():
        for k, v in result.state.items():
            torch.testing.assert_close(got[d].state[k], v, rtol=1e-6, atol=1e-7)
