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
