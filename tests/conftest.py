"""Shared fixtures. One torch thread: on the 2-core CI machine two threads are many times slower.
FEDKEY_DATA_DIR (where `--data nus-sms` and `--data ubuntu-irc` are read, corpora.datadir) is the
checkout's ../shared/data unless it is set already."""

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
os.environ.setdefault("FEDKEY_DATA_DIR", str(DATA_DIR))


@pytest.fixture
def data_dir() -> Path:
    """../shared/data beside the checkout; tests that need it skip with the reason when absent."""
    if not (DATA_DIR / "ptb" / "train.txt").exists():
        pytest.skip(f"datasets not found at {DATA_DIR} (CI and developer machines have them)")
    return DATA_DIR
