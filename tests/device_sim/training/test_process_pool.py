"""The local training backend (fedkey.device_sim.training.process_pool.TrainerPool): `stream` yields every task once as
it finishes, with the same results as `run`, whichever process trains it."""

from __future__ import annotations

import torch

from fedkey.common.config import DataConfig, TrainConfig
from fedkey.corpora.dataset import prepare
from fedkey.device_sim.training.backends import ordered
from fedkey.device_sim.training.process_pool import LocalTask, TrainerPool
from fedkey.models.checkpoint import build_model, model_state
from fedkey.models.config import ModelConfig


def tasks_and_state(n: int = 3) -> tuple[list[LocalTask], dict[str, torch.Tensor]]:
    prepared = prepare(DataConfig(data="demo", clients=n, max_train_tokens=600))
    config = ModelConfig(vocab_size=prepared.tokenizer.vocab_size, emb_size=8, hidden_size=8)
    torch.manual_seed(0)
    state = model_state(build_model(config))
    train = TrainConfig(epochs=1, lr=0.5)
    tasks = [
        LocalTask(d, prepared.shards[d], 1000 + i, config, train)
        for i, d in enumerate(sorted(prepared.shards))
    ]
    return tasks, state


def test_stream_yields_every_task_once_with_the_results_of_run():
    tasks, state = tasks_and_state()
    pool = TrainerPool(0)
    try:
        streamed = list(pool.stream(tasks, state))
        ran = pool.run(tasks, state)
    finally:
        pool.close()
    assert sorted(d for d, _ in streamed) == sorted(t.device_id for t in tasks)
    in_order = ordered(tasks, streamed)
    assert list(in_order) == [t.device_id for t in tasks] == list(ran)
    for d, result in in_order.items():
        for k, v in ran[d].state.items():
            assert torch.equal(result.state[k], v)


def test_ordered_leaves_lost_phones_out_and_keeps_the_tasks_order():
    tasks, state = tasks_and_state()
    pool = TrainerPool(0)
    try:
        results = dict(pool.stream(tasks, state))
    finally:
        pool.close()
    first, second, third = (t.device_id for t in tasks)
    got = ordered(tasks, [(third, results[third]), (first, None), (second, results[second])])
    assert list(got) == [second, third]
