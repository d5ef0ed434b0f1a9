"""The stacked backend (fedkey.device_sim.training.stacked): a round's phones trained at once as one stacked model
give each phone the update train_local gives it (without dropout, up to float rounding), phones
with smaller shards included; `fedkey simulate --backend stacked` ends where `--backend local`
does; the commands that train one phone at a time refuse it in one line."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.common.config import TrainConfig
from fedkey.device_sim.training.process_pool import LocalTask
from fedkey.device_sim.training.stacked import Stack, StackedTrainer, train_stacked
from fedkey.device_sim.training.trainer import local_batches, phone_round, train_local
from fedkey.models.checkpoint import build_model, model_state
from fedkey.models.config import ModelConfig
from fedkey.models.tokenizers import WordTokenizer
from fedkey.runners.simulate import SimulationConfig, simulate
from fedkey.testing.workload import DATA, FED, tiny

TEXT = [
    "see you later",
    "see you soon",
    "on my way home",
    "see you at the station tonight or else tomorrow morning",
] * 10
TOK = WordTokenizer.build(TEXT)
SEQS = [TOK.encode(s) for s in TEXT]
# Shards of unequal size: the third runs out of batches long before the others.
SHARDS = [(SEQS[:25], 3), (SEQS[10:], 4), (SEQS[:7], 5)]


def initial(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return model_state(build_model(cfg))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(
    "cell, layers, tied", [("gru", 1, True), ("lstm", 2, False), ("gru", 2, True)]
)
def test_each_phone_gets_the_update_train_local_gives_it(cell, layers, tied, static):
    """Static: every step padded to the batch size and a multiple of 16 time steps, the softmax
    on every position (the shapes a GPU captures once in a CUDA graph): the same updates."""
    cfg = ModelConfig(
        vocab_size=TOK.vocab_size,
        emb_size=16,
        hidden_size=16,
        cell=cell,
        num_layers=layers,
        tied=tied,
    )
    start = initial(cfg)
    # clip 0.1 is hit (the first step's gradient norms here: 0.2-0.5): each phone clipped on its own.
    train = TrainConfig(epochs=2, batch_size=4, lr=0.5, clip=0.1, precision="fp32")
    stack = Stack(cfg, train, len(SHARDS), torch.device("cpu"), static)
    stacked = train_stacked(cfg, start, SHARDS, train, device="cpu", stack=stack)
    for (sentences, seed), got in zip(SHARDS, stacked, strict=True):
        want = train_local(cfg, start, sentences, train, seed, device="cpu")
        assert got.state.keys() == want.state.keys()
        for k in want.state:
            assert got.state[k].dtype == torch.float32 and got.state[k].device.type == "cpu"
            torch.testing.assert_close(got.state[k], want.state[k], rtol=0, atol=1e-6)
            assert not torch.equal(got.state[k], start[k]), k  # every tensor trained
        assert got.num_tokens == want.num_tokens
        assert got.train_loss == pytest.approx(want.train_loss, rel=1e-6)


def test_a_gpu_round_of_a_thousand_phones_is_cut_into_stacks_that_fit(monkeypatch):
    """On a GPU a round is stacked whole only up to GPU_PHONES: at C 1 on the IRC population
    (1,000 phones) one stack would outgrow the GPU's memory. A smaller round stays one stack,
    and an explicit `phones` still wins."""
    import fedkey.device_sim.training.stacked as stacked

    monkeypatch.setattr(stacked, "resolve_device", lambda d: torch.device("cuda"))
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)
    task = LocalTask("p0", SEQS[:5], 0, cfg, TrainConfig(), device="cuda")
    gpu = StackedTrainer.GPU_PHONES
    assert StackedTrainer().stack_size(task, 1000) == gpu < 1000
    assert StackedTrainer().stack_size(task, 50) == min(50, gpu)
    assert StackedTrainer(phones=300).stack_size(task, 1000) == 300


def test_a_cohort_in_several_stacks_gets_train_locals_updates_within_the_tolerance():
    """A CPU cohort cut into stacks of 2 (StackedTrainer's `phones`), shards from 1 sentence to
    30: each phone's weights within 1e-6 of train_local's (fp32, no dropout: the docstring's
    tolerance), its loss too, results in the tasks' order."""
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)
    start = initial(cfg)
    train = TrainConfig(epochs=2, batch_size=4, lr=0.5, clip=0.1, precision="fp32")
    shards = [(SEQS[:1], 7), (SEQS[3:33], 8), (SEQS[:5], 9), (SEQS[20:29], 10), (SEQS[5:6], 11)]
    tasks = [LocalTask(f"p{i}", s, seed, cfg, train, device="cpu") for i, (s, seed) in
             enumerate(shards)]  # fmt: skip
    backend = StackedTrainer(phones=2)
    assert backend.stack_size(tasks[0], len(tasks)) == 2
    got = backend.run(tasks, start)
    assert list(got) == [t.device_id for t in tasks]
    for t in tasks:
        want = train_local(cfg, start, t.shard, train, t.seed, device="cpu")
        for k, v in want.state.items():
            torch.testing.assert_close(got[t.device_id].state[k], v, rtol=0, atol=1e-6)
        assert got[t.device_id].train_loss == pytest.approx(want.train_loss, rel=1e-6)


def test_a_streamed_cohort_holds_at_most_one_stacks_results_the_caller_dropped():
    """Memory that does not grow with the cohort: while the stream yields a stack's results,
    every result of the stacks before it that the caller let go is freed (not kept by the
    backend, its stack or the stream); the stack's weights are one set, reused."""
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=8, hidden_size=8)
    train = TrainConfig(epochs=1, batch_size=4, lr=0.5, precision="fp32")
    tasks = [LocalTask(f"p{i}", SEQS[i : i + 5 + i % 3], i, cfg, train, device="cpu")
             for i in range(9)]  # fmt: skip
    backend = StackedTrainer(phones=2)
    held: list[weakref.ref] = []
    stacks = set()
    for n, (_, result) in enumerate(backend.stream(tasks, initial(cfg))):
        assert result is not None
        held.append(weakref.ref(result.state["embedding.weight"]))
        del result
        gc.collect()
        alive = [i for i, ref in enumerate(held[:-1]) if ref() is not None]
        assert all(i // 2 == n // 2 for i in alive), (n, alive)  # only this stack's
        stacks.update(id(s) for s in backend._stacks.values())
    assert len(held) == 9 and len(stacks) == 1  # 5 stacks trained by one Stack
    gc.collect()
    assert sum(ref() is not None for ref in held) <= 2


def test_with_dropout_and_bf16_it_still_learns_what_train_local_learns():
    """Other dropout masks than train_local's (one generator for the stack), bf16 autocast on
    the forward: the same direction of update, not the same bits."""
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16, dropout=0.3)
    start = initial(cfg)
    train = TrainConfig(epochs=3, batch_size=4, lr=0.5, precision="bf16")
    [got] = train_stacked(cfg, start, SHARDS[:1], train, device="cpu")
    want = train_local(cfg, start, SHARDS[0][0], train, SHARDS[0][1], device="cpu")
    assert got.precision == "bf16"

    def delta(state):
        return torch.cat([(state[k] - start[k]).flatten() for k in start])

    cos = torch.nn.functional.cosine_similarity(delta(got.state), delta(want.state), dim=0)
    assert cos > 0.8
    assert got.train_loss == pytest.approx(want.train_loss, rel=0.1)


def test_the_backend_randomizes_each_upload_as_the_phone_does():
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)
    start = initial(cfg)
    train = TrainConfig(epochs=1, batch_size=4, lr=0.5, precision="fp32")
    tasks = [
        LocalTask(f"phone-{i}", s, seed, cfg, train, beta=0.01, device="cpu")
        for i, (s, seed) in enumerate(SHARDS)
    ]
    got = StackedTrainer().run(tasks, start)
    assert list(got) == ["phone-0", "phone-1", "phone-2"]
    for t in tasks:
        want = phone_round(cfg, start, t.shard, train, t.seed, beta=0.01, device="cpu")
        for k in want.state:
            torch.testing.assert_close(got[t.device_id].state[k], want.state[k], rtol=0, atol=1e-6)


def test_stacks_kept_for_the_next_round_start_it_afresh():
    """The backend keeps its stacks (on a GPU, their captured steps) from round to round, one
    per training config of a round (the backdoor attack's phones train longer than the honest
    ones): the next round, from other weights at another lr, trains as new stacks would
    (momentum reset), and builds none."""
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)
    train = TrainConfig(epochs=1, batch_size=4, lr=0.5, precision="fp32")
    backend = StackedTrainer(static=True)

    def tasks(train):
        honest = [LocalTask(f"p{i}", s, seed, cfg, train, device="cpu") for i, (s, seed) in
                  enumerate(SHARDS[:2])]  # fmt: skip
        shard, seed = SHARDS[2]
        return [
            *honest,
            LocalTask("attacker", shard, seed, cfg, replace(train, epochs=2), device="cpu"),
        ]

    first = backend.run(tasks(train), initial(cfg))
    kept = list(backend._stacks.values())
    assert len(kept) == 2
    later = replace(train, lr=0.2)  # --lr-decay: each round its own lr
    again = backend.run(tasks(later), first["p0"].state)
    assert all(a is b for a, b in zip(backend._stacks.values(), kept, strict=True))
    fresh = StackedTrainer(static=False).run(tasks(later), first["p0"].state)
    for d, result in again.items():
        for k, v in result.state.items():
            torch.testing.assert_close(v, fresh[d].state[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("static", [False, True])
def test_a_step_with_every_phone_done_moves_nothing(static):
    """Neither weights nor momentum: what a CUDA graph's warm-up steps rely on (they run for
    real, with no word to predict, before the capture)."""
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)
    train = TrainConfig(batch_size=4, lr=0.5, precision="fp32")
    stack = Stack(cfg, train, 2, torch.device("cpu"), static)
    stack.reset(initial(cfg), train.lr)
    first = next(local_batches(SEQS, train, seed=0))
    stack.step([first, first])  # momentum is no longer zero
    before = [{k: v.detach().clone() for k, v in d.items()} for d in (stack.w, stack.momentum)]
    losses, n = stack.step([None, None])
    assert n.tolist() == [0, 0] and losses.tolist() == [0.0, 0.0]
    for saved, now in zip(before, (stack.w, stack.momentum), strict=True):
        for k in saved:
            assert torch.equal(saved[k], now[k]), k
            assert saved[k].abs().sum() > 0, k


def test_column_batches_are_refused():
    cfg = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)
    with pytest.raises(ValueError, match="sentence batches"):
        train_stacked(cfg, initial(cfg), SHARDS, TrainConfig(batching="columns"), device="cpu")


def test_simulate_stacked_ends_with_the_local_backends_weights(tmp_path):
    fed = replace(FED, train=replace(FED.train, precision="fp32"))
    local = simulate(
        SimulationConfig(DATA, fed, tiny, str(tmp_path / "local"), workers=0, progress=False)
    )
    stacked = simulate(
        SimulationConfig(
            DATA, fed, tiny, str(tmp_path / "stacked"), progress=False, backend="stacked"
        )
    )
    assert len(stacked) == len(local) == fed.rounds + 1
    for a, b in zip(stacked[1:], local[1:], strict=True):
        assert a["val_ppl"] == pytest.approx(b["val_ppl"], rel=1e-4)
    last = sorted((Path(tmp_path) / "local" / "checkpoints").glob("round_*.safetensors"))[-1]
    ours = load_file(Path(tmp_path) / "stacked" / "checkpoints" / last.name)
    for k, v in load_file(last).items():
        torch.testing.assert_close(ours[k], v, rtol=0, atol=1e-5)


@pytest.mark.parametrize("command", ["train-central", "devices"])
def test_commands_that_train_one_phone_at_a_time_refuse_it(command, tmp_path):
    args = [command, "--backend", "stacked"]
    args += ["--out", str(tmp_path)] if command == "train-central" else ["--enrollment-secret", "s"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --backend stacked"), result.stderr
