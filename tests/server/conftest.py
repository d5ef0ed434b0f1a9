"""Shared setup for the server tests: one torch thread."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def make_states():
    """Factory: a float32 global state and m client states with small random deltas."""

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
