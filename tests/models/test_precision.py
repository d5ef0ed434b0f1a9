"""Mixed precision (fedkey.models.precision): the "auto" rule with the hardware probes mocked, and the
evaluator under bf16 against fp32 on a small trained model."""

from __future__ import annotations

import warnings

import pytest
import torch

from fedkey.common.config import PRECISIONS, TrainConfig
from fedkey.device_sim.training.trainer import train_local
from fedkey.models import precision as mp
from fedkey.models.checkpoint import build_model, model_state
from fedkey.models.config import ModelConfig
from fedkey.models.metrics import column_perplexity, evaluate, keystroke_savings
from fedkey.models.tokenizers import WordTokenizer


@pytest.fixture
def cpu_with(monkeypatch):
    """Make the CPU report the given /proc/cpuinfo flags."""

    def set_flags(*flags: str) -> None:
        monkeypatch.setattr(mp, "cpu_flags", lambda: frozenset(flags))

    return set_flags


@pytest.fixture
def gpu(monkeypatch):
    """A visible CUDA GPU, with or without native bf16."""

    def set_gpu(bf16: bool) -> list[bool]:
        asked: list[bool] = []

        def is_bf16_supported(including_emulation: bool = True) -> bool:
            asked.append(including_emulation)
            return bf16

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
        return asked

    return set_gpu


def test_the_choices_are_one_list():
    assert PRECISIONS == ("auto", "fp32", "bf16")
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        TrainConfig(precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        mp.resolve_precision("fp16")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("avx512f", "avx512_bf16"), "bf16"),
        (("amx_tile", "amx_bf16"), "bf16"),
        (("avx512f", "avx512bw", "avx2"), "fp32"),  # AVX512 without BF16: emulated
        ((), "fp32"),  # no /proc/cpuinfo (macOS), an Arm CPU
    ],
)
def test_auto_on_the_cpu_is_bf16_exactly_with_native_bf16(cpu_with, flags, expected):
    cpu_with(*flags)
    assert mp.resolve_precision("auto", "cpu") == expected
    assert mp.resolve_precision("auto", torch.device("cpu")) == expected


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_on_cuda_asks_torch_for_native_bf16(cpu_with, gpu, bf16):
    cpu_with()  # the CPU's answer does not matter for a CUDA device
    asked = gpu(bf16)
    assert mp.resolve_precision("auto", "cuda") == ("bf16" if bf16 else "fp32")
    assert asked == [False]  # native only: emulated bf16 on an older GPU does not count


def test_auto_elsewhere_is_fp32_and_bf16_is_refused_there(cpu_with):
    cpu_with("avx512_bf16")
    assert mp.resolve_precision("auto", "mps") == "fp32"
    with pytest.raises(ValueError, match="runs on cpu and cuda"):
        mp.resolve_precision("bf16", "mps")


def test_explicit_choices_are_kept_bf16_without_native_support_warns(cpu_with):
    cpu_with()
    assert mp.resolve_precision("fp32", "cpu") == "fp32"
    with pytest.warns(RuntimeWarning, match="without native bf16"):
        assert mp.resolve_precision("bf16", "cpu") == "bf16"
    cpu_with("avx512_bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mp.resolve_precision("bf16", "cpu") == "bf16"
        assert mp.resolve_precision("fp32", "cpu") == "fp32"


def test_cpuinfo_flags_are_read_from_the_flags_line():
    text = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\n"
    assert mp.flags_of(text) == {"fpu", "avx512f", "avx512_bf16"}
    assert mp.flags_of("Features\t: fp asimd bf16\n") == frozenset()  # Arm: not detected
    assert isinstance(mp.cpu_flags(), frozenset)


def test_autocast_is_bf16_only_under_bf16():
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with mp.autocast("bf16", "cpu"):
        assert linear(x).dtype == torch.bfloat16
    with mp.autocast("fp32", "cpu"):
        assert linear(x).dtype == torch.float32


TEXT = ["see you later", "see you soon", "on my way home", "see you at the station"] * 10
TOK = WordTokenizer.build(TEXT)
CFG = ModelConfig(vocab_size=TOK.vocab_size, emb_size=32, hidden_size=32)


def trained_model() -> torch.nn.Module:
    torch.manual_seed(0)
    state = model_state(build_model(CFG))
    seqs = [TOK.encode(s) for s in TEXT]
    cfg = TrainConfig(epochs=3, batch_size=4, lr=0.5, precision="fp32")
    return build_model(CFG, train_local(CFG, state, seqs, cfg, seed=1, device="cpu").state)


def test_the_evaluator_under_bf16_is_within_a_few_percent_of_fp32():
    model = trained_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a CPU without native bf16: emulated
        fp32 = evaluate(model, TOK, TEXT, precision="fp32")
        bf16 = evaluate(model, TOK, TEXT, precision="bf16")
        col32 = column_perplexity(model, TOK, TEXT, precision="fp32")
        col16 = column_perplexity(model, TOK, TEXT, precision="bf16")
        ksr16 = keystroke_savings(model, TOK, TEXT[:8], precision="bf16")
    assert fp32 == evaluate(model, TOK, TEXT)  # fp32 is the default, unchanged
    assert fp32["ppl"] < 10  # trained: the comparison means something
    assert bf16["ppl"] != fp32["ppl"]  # the autocast ran
    assert bf16["ppl"] == pytest.approx(fp32["ppl"], rel=0.03)
    assert bf16["words"] == fp32["words"]
    assert bf16["top1"] == pytest.approx(fp32["top1"], abs=0.05)
    assert col16 == pytest.approx(col32, rel=0.03)
    assert ksr16 == pytest.approx(keystroke_savings(model, TOK, TEXT[:8]), abs=0.05)
