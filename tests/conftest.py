"""Shared fixtures. One torch thread: on the 2-core CI machine two threads are many times slower.
FEDKEY_DATA_DIR (where `--data nus-sms` and `--data ubuntu-irc` are read, fedkey.corpora.datadir) is the
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


@pytest.fixture
def make_states():
    """Factory (the strategy and storage tests): a float32 global state and m client states with small random deltas."""

    def make(m: int, seed: int = 0, scale: float = 0.1):
        g = torch.Generator().manual_seed(seed)
        shapes = {"emb.weight": (7, 5), "rnn.weight": (6, 5), "rnn.bias": (6,), "out.bias": (7,)}
        glob = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        glob["steps"] = torch.tensor(4)
        clients = []
        for _ in range(m):
            c = {
                k: v + scale * torch.randn(v.shape, generator=g)
                for k, v in glob.items()
                if k != "steps"
            }
            c["steps"] = torch.tensor(9)
            clients.append(c)
        return glob, clients

    return make
