"""The GPU path, wherever a GPU is visible: nothing in it may be untested code.

On a machine without CUDA every test here skips and says why. With one, they check what a user of
`--device cuda` relies on: a phone trains on the GPU under fp32 and bf16 and uploads finite
float32 weights on the CPU (what the server's checks expect) that agree with the CPU's; the
evaluator scores a model on the GPU as on the CPU; several phones train on one GPU at once (the
pool's processes share it, or one stacked model holds a round's phones: --backend stacked); and
`fedkey simulate` and `fedkey run` with `--device cuda` run end to end, the server evaluating on
the GPU, and `fedkey evaluate --device cuda` scores the kept model as the run did.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from fedkey.common.config import TrainConfig
from fedkey.device_sim.training.process_pool import LocalTask, TrainerPool
from fedkey.device_sim.training.trainer import train_local
from fedkey.models.checkpoint import build_model, model_state
from fedkey.models.config import ModelConfig
from fedkey.models.metrics import evaluate
from fedkey.models.tokenizers import WordTokenizer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU visible: the GPU path (--device cuda) is tested on a machine with one",
)

TEXT = ["see you later", "see you soon", "on my way home", "see you at the station"] * 10
TOK = WordTokenizer.build(TEXT)
CFG = ModelConfig(vocab_size=TOK.vocab_size, emb_size=16, hidden_size=16)
SEQS = [TOK.encode(s) for s in TEXT]


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return model_state(build_model(CFG))


def _flat_delta(state: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(state[k] - start[k]).flatten() for k in start])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_phone_trains_on_the_gpu_and_uploads_cpu_float32(precision):
    start = _initial()
    cfg = TrainConfig(epochs=3, batch_size=4, lr=0.5, precision=precision)
    gpu = train_local(CFG, start, SEQS, cfg, seed=1, device="cuda")
    cpu = train_local(CFG, start, SEQS, replace(cfg, precision="fp32"), seed=1, device="cpu")
    assert gpu.precision == precision
    for k, v in gpu.state.items():
        assert v.device.type == "cpu" and v.dtype == torch.float32, k
        assert torch.isfinite(v).all(), k
    before = evaluate(build_model(CFG, start), TOK, TEXT)["ppl"]
    after = evaluate(build_model(CFG, gpu.state), TOK, TEXT)["ppl"]
    assert after < before / 2  # it learned
    # The same update as the CPU's, up to the GPU's kernels (and bf16 rounding).
    cos = torch.nn.functional.cosine_similarity(
        _flat_delta(gpu.state, start), _flat_delta(cpu.state, start), dim=0
    )
    assert cos > (0.99 if precision == "fp32" else 0.95)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_evaluator_scores_on_the_gpu_as_on_the_cpu(precision):
    trained = train_local(
        CFG, _initial(), SEQS, TrainConfig(epochs=2, lr=0.5), seed=2, device="cpu"
    )
    model = build_model(CFG, trained.state)
    on_cpu = evaluate(model, TOK, TEXT, device="cpu")
    on_gpu = evaluate(model.to("cuda"), TOK, TEXT, device="cuda", precision=precision)
    assert on_gpu["words"] == on_cpu["words"]
    assert on_gpu["ppl"] == pytest.approx(on_cpu["ppl"], rel=0.01 if precision == "fp32" else 0.05)


def test_several_phones_train_on_one_gpu_at_once():
    start = _initial()
    cfg = TrainConfig(epochs=2, batch_size=4, lr=0.5, precision="fp32")
    tasks = [
        LocalTask(f"phone-{i}", SEQS[i::4], seed=i, model_config=CFG, train=cfg, device="cuda")
        for i in range(4)
    ]
    pool = TrainerPool(2)  # two processes, each with its CUDA context on the same GPU
    try:
        results = pool.run(tasks, start)
    finally:
        pool.close()
    alone = train_local(CFG, start, tasks[0].shard, cfg, seed=0, device="cuda")
    assert set(results) == {t.device_id for t in tasks}
    for r in results.values():
        assert all(torch.isfinite(v).all() for v in r.state.values())
    cos = torch.nn.functional.cosine_similarity(
        _flat_delta(results["phone-0"].state, start), _flat_delta(alone.state, start), dim=0
    )
    assert cos > 0.99  # sharing the GPU changes nothing but the kernels' scheduling


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_round_of_phones_trains_stacked_on_the_gpu(precision):
    """--backend stacked (fedkey.device_sim.training.stacked) on the GPU: every phone's update that of
    train_local on the GPU (fp32: up to the kernels' rounding; bf16: the same direction)."""
    from fedkey.device_sim.training.stacked import train_stacked

    start = _initial()
    cfg = TrainConfig(epochs=2, batch_size=4, lr=0.5, precision=precision)
    shards = [(SEQS[i::4], i) for i in range(4)]
    stacked = train_stacked(CFG, start, shards, cfg, device="cuda")
    for (shard, seed), got in zip(shards, stacked, strict=True):
        assert got.precision == precision
        for k, v in got.state.items():
            assert v.device.type == "cpu" and v.dtype == torch.float32, k
        alone = train_local(CFG, start, shard, cfg, seed=seed, device="cuda")
        cos = torch.nn.functional.cosine_similarity(
            _flat_delta(got.state, start), _flat_delta(alone.state, start), dim=0
        )
        assert cos > (0.999 if precision == "fp32" else 0.95)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_stacked_steps_captured_in_cuda_graphs_train_as_the_eager_ones(precision):
    """A static stack on the GPU replays each step shape's CUDA graph (fedkey.device_sim.training.stacked.Stack),
    two rounds in a row (the second with the first's graphs, from other weights at another lr):
    the same updates as the eager stack, dropout off."""
    from fedkey.device_sim.training.stacked import Stack, train_stacked

    cfg = TrainConfig(epochs=2, batch_size=4, lr=0.5, precision=precision)
    # sentences of 7, 19 and 35 words with the end of sentence: steps of 16, 32 and 48 time steps
    # (Stack.BUCKET), so several graphs replay in turn, as in a run on real text
    long = [TOK.encode(" ".join(["see you"] * k)) for k in (3, 9, 17)] * 4
    shards = [(SEQS[i::4] + long[i::4], i) for i in range(4)]
    graphed = Stack(CFG, cfg, len(shards), torch.device("cuda"), static=True)
    state, again = _initial(), replace(cfg, lr=0.2)
    for train in (cfg, again):
        got = train_stacked(CFG, state, shards, train, device="cuda", stack=graphed)
        want = train_stacked(CFG, state, shards, train, device="cuda")
        assert graphed.graphs and len(graphed._captured) >= 2  # the steps ran as replays
        for g, w in zip(got, want, strict=True):
            cos = torch.nn.functional.cosine_similarity(
                _flat_delta(g.state, state), _flat_delta(w.state, state), dim=0
            )
            assert cos > (0.999 if precision == "fp32" else 0.95)
            assert g.train_loss == pytest.approx(w.train_loss, rel=0.01)
        state = got[0].state


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["simulate", "run"])
def test_a_federation_trains_and_evaluates_on_the_gpu_end_to_end(tmp_path, verb):
    """`fedkey simulate`, and `fedkey run` over HTTP (phones in the fleet's processes, the
    server's evaluation in the server for round 0 and in its aggregation child process each
    round), all on the GPU."""
    from fedkey.cli import app

    out = tmp_path / "run"
    args = [verb, "--data", "demo", "--clients", "4", "--fraction", "1.0", "--rounds", "2"]
    args += ["--local-epochs", "1", "--device", "cuda", "--workers", "2", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    last = rows[-1]
    assert last["test_ppl"] < rows[0]["test_ppl"]
    assert {r["eval_device"] for r in rows} == {"cuda"}  # --eval-device auto: the GPU
    want = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    assert last["eval_precision"] == want  # --precision auto on this GPU
    if verb == "simulate":  # `run` leaves "auto" to each phone: the row has no one precision
        assert last["train_precision"] == want
        # `fedkey evaluate --device cuda` scores the kept model on the GPU as the run did
        ckpt = out / "checkpoints" / "round_0002.safetensors"
        again = CliRunner().invoke(app, ["evaluate", str(ckpt), "--data", "demo", "--device",
                                         "cuda", "--json"])  # fmt: skip
        assert again.exit_code == 0, again.output
        scores = json.loads(again.output.strip().splitlines()[-1])
        assert scores["device"].startswith("cuda") and scores["agrees"] is True, scores
