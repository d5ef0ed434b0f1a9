"""Where a figure came from: the commit of the code that ran, and the machine it ran on."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

from fedkey.runners.source import git

__all__ = ["cpu_model", "git", "machine", "machine_line", "proc_kb"]


def proc_kb(path: str, key: str) -> int:
    """A ``key: N kB`` line of /proc/<path> in bytes (0 when it cannot be read, e.g. the process
    is gone): `VmRSS` and `VmHWM` of ``<pid>/status``, `Pss` of ``<pid>/smaps_rollup`` (each
    shared page counted once across the processes that map it), `MemTotal` of ``meminfo``."""
    try:
        for line in Path(f"/proc/{path}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo), or None where it cannot be read."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def machine_line() -> str:
    """The machine in one line (no torch): CPU, cores, memory, Python."""
    mem = proc_kb("meminfo", "MemTotal")
    gib = f", {mem / 2**30:.0f} GiB" if mem else ""
    cpu = cpu_model() or platform.processor() or "cpu"
    return f"{cpu}, {os.cpu_count()} cores{gib}, Python {platform.python_version()}"


def machine() -> dict:
    """The machine as perf.json and a run's record keep it: CPUs, torch, onnxruntime, device."""
    from importlib.metadata import version

    import torch  # only once a figure is recorded: `--help` loads no torch

    cuda = torch.cuda.is_available()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "onnxruntime": version("onnxruntime"),
        "device": f"cuda ({torch.cuda.get_device_name(0)})" if cuda else "cpu",
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
