"""Shared fixtures of the research harness's tests (the product's are in ../tests/conftest.py).
One torch thread: on the 2-core CI machine two threads are many times slower."""

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

#: ../shared/data beside the fedkey checkout (this is experiments/tests/).
DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture
def data_dir() -> Path:
    """../shared/data beside the checkout; tests that need it skip with the reason when absent."""
    if not (DATA_DIR / "ptb" / "train.txt").exists():
        pytest.skip(f"datasets not found at {DATA_DIR} (CI and developer machines have them)")
    return DATA_DIR


def table_runs() -> list:
    """A fixed suite for the tests of the bench's machinery (jobs, time limits, resuming): the
    seed papers' table's methods on PTB and WikiText-2, FedSGD, C 0.1 and 0.5, AdaFL. The
    bench's own suites follow the sweep's choices; this one needs none."""
    from fedkey_bench.paper.spec import DATASETS, fed

    runs = []
    for ds in DATASETS:
        runs.append(fed("table", ds, "FedSGD", 1.0, "--strategy", "fedsgd"))
        for c in (0.1, 0.5):
            for method in ("FedAvg", "FedAtt", "FedAttOpt", "FedMed"):
                runs.append(fed("table", ds, method, c, "--strategy", method.lower()))
            runs.append(fed("table", ds, "FedMed topK 0.8", c, "--strategy", "fedmed",
                            "--topk-beta", "0.8"))  # fmt: skip
        runs.append(fed("table", ds, "AdaFL + FedAvg", None, "--strategy", "fedavg", "--adafl"))
        runs.append(fed("table", ds, "AdaFL + FedAtt", None, "--strategy", "fedatt", "--adafl"))
    return runs


@pytest.fixture
def table_suite(monkeypatch):
    """The smoke preset with the `table` suite (table_runs) beside its own."""
    from dataclasses import replace

    import fedkey_bench.paper.plan as plan
    from fedkey_bench.paper.presets import PRESETS

    smoke = PRESETS["smoke"]
    monkeypatch.setitem(PRESETS, "smoke", replace(smoke, suites=(*smoke.suites, "table")))
    own = plan.suite_runs

    def suite_runs(suite, preset, results=None):
        return table_runs() if suite == "table" else own(suite, preset, results)

    monkeypatch.setattr(plan, "suite_runs", suite_runs)
