"""Shared pieces of the peers tests: a small workload and rows built from fake round times."""

import importlib.util
from types import ModuleType

from fedkey_bench.peers.runner import PEERS, Workload, make_row

W = Workload(rounds=3)

#: A demo workload small enough to write its shards in a second.
DEMO = Workload(data="demo", clients=20, max_train_tokens=3000, max_eval_sentences=20,
                hidden_size=16, vocab_size=500, rounds=3, fraction=0.3)  # fmt: skip


def peers_workload() -> ModuleType:
    """experiments/peers/workload.py (no package: its scripts run in other venvs), by its path."""
    spec = importlib.util.spec_from_file_location("peers_workload", PEERS / "workload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(framework: str, ends: list[float], ppl: float, rss: int = 2**30,
        cpu: float | None = None) -> dict:  # fmt: skip
    return make_row(framework, "1.0", W, "cpu", f"{framework} run", ends,
                    [9000.0, 3000.0, 2000.0, ppl], 60.0, rss, [5.0, 3.0, 3.5], cpu)  # fmt: skip
