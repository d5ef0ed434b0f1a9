"""Mixed precision for the trainer and the evaluator: which arithmetic a precision choice means on
a device, and the autocast context that runs a forward pass in it.

"bf16" runs the forward under ``torch.autocast(device, torch.bfloat16)``: the products autocast
covers in bfloat16 (the softmax layer, most of the work at a 10k vocabulary, and the recurrent
layer's: on the CPU autocast does not list the GRU, but the products the GRU makes inside it run
in bfloat16 all the same, so its gates are bfloat16 while its hidden state is updated in float32;
keeping the whole GRU float32 made training 10% slower), the weights kept in float32
(master weights, so the optimizer's steps and the uploads stay float32), the loss computed in
float32 from logits cast back (the callers do ``logits.float()``), the gradients float32. The
local trainer's bf16 step on the CPU writes its recurrence out instead (fedkey.device_sim.training.bf16_cpu:
bfloat16 throughout, hidden state included, 1.2-1.3x the step above). "fp32" is plain float32.

"auto" is bf16 where the hardware does bf16 natively, else fp32; the rule, deterministic per
machine:

- a CUDA device: ``torch.cuda.is_bf16_supported(including_emulation=False)`` (Ampere and later);
- the CPU: /proc/cpuinfo lists ``avx512_bf16`` or ``amx_bf16`` (x86, Linux); elsewhere (macOS,
  Arm, a CPU without them) fp32: bf16 there is emulated or unmeasured;
- any other device (mps): fp32.

bf16 asked where the hardware lacks it still runs (emulated, slowly) with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from pathlib import Path
from typing import Literal

import torch

from fedkey.common.config import PRECISIONS

#: What a precision choice resolves to.
Resolved = Literal["fp32", "bf16"]

#: The /proc/cpuinfo flags of native bf16 arithmetic on x86: AVX512-BF16 (Cooper Lake, Zen 4 and
#: later) or AMX (Sapphire Rapids and later).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is unreadable)."""
    try:
        return flags_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def flags_of(cpuinfo: str) -> frozenset[str]:
    """The flags of the first CPU in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16(device: torch.device | str) -> bool:
    """Whether `device` does bf16 arithmetic natively (the rule in this module's docstring)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if dev.type == "cpu":
        return bool(BF16_CPU_FLAGS & cpu_flags())
    return False


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> Resolved:
    """ "auto" | "fp32" | "bf16" on `device` -> "fp32" | "bf16". ValueError for an unknown choice
    or bf16 on a device autocast does not run on; bf16 without native support warns."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
    dev = torch.device(device)
    if precision == "auto":
        return "bf16" if native_bf16(dev) else "fp32"
    if precision == "bf16":
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"precision bf16 runs on cpu and cuda, not {dev.type}; use fp32")
        if not native_bf16(dev):
            warnings.warn(
                f"precision bf16 on a {dev.type} without native bf16: emulated, likely slower "
                "than fp32 (auto would choose fp32 here)",
                RuntimeWarning,
                stacklevel=2,
            )
        return "bf16"
    return "fp32"


def autocast(
    precision: Resolved, device: torch.device | str, cache: bool = True
) -> contextlib.AbstractContextManager[None]:
    """The context a forward pass runs in: bf16 autocast on `device`'s type, or nothing.
    `cache` False for a forward captured in a CUDA graph (autocast's cast cache must be off)."""
    if precision == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def resolve_device(device: str = "auto") -> torch.device:
    """What a --device / --eval-device choice means here: "auto" is the GPU where torch sees
    one, else the CPU; "cuda" where it sees none is an error, not a silent fallback."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was asked for but no CUDA GPU is visible")
    return torch.device(device)
