"""`fedkey simulate` keeps a large round's uploads on disk (fedkey.runners.spool): the same weights bit
for bit as a round kept in memory, and no file left once the round is aggregated."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import fedkey.runners.spool as spool
from fedkey.cli import app

ARGS = ["--data", "demo", "--clients", "8", "--fraction", "0.5", "--max-train-tokens", "6000",
        "--rounds", "2", "--local-epochs", "1", "--lr", "0.5", "--max-eval-sentences", "100",
        "--workers", "0", "--seed", "5"]  # fmt: skip


def _simulate(out, *extra):
    result = CliRunner().invoke(app, ["simulate", *ARGS, *extra, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return load_file(out / "checkpoints" / "round_0002.safetensors")


@pytest.mark.parametrize("strategy", ["fedavg", "fedatt"])
def test_a_round_too_large_for_memory_aggregates_from_disk_alike(tmp_path, monkeypatch, strategy):
    kept = _simulate(tmp_path / "memory", "--strategy", strategy)
    stored: list[str] = []

    class Counted(spool.StoredState):
        def __init__(self, path):
            super().__init__(path)
            stored.append(self.path)

    monkeypatch.setattr(spool, "MEMORY_BYTES", 1)  # any round passes it
    monkeypatch.setattr(spool, "StoredState", Counted)
    spooled = _simulate(tmp_path / "disk", "--strategy", strategy)
    assert len(stored) == 8  # 4 phones a round, 2 rounds: every upload went through a file
    assert all(torch.equal(kept[k], spooled[k]) for k in kept)
    assert not (tmp_path / "disk" / "uploads").exists()  # removed once aggregated
    rows = (tmp_path / "disk" / "metrics.jsonl").read_text().splitlines()
    assert len(json.loads(rows[-1])["aggregated"]) == 4


def test_a_round_that_fits_stays_in_memory(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    keep = spool.UploadSpool(tmp_path / "up", memory_bytes=1000)
    keep.start(cohort=10, upload_bytes=spool.tensor_bytes(state))  # 240 bytes in all
    assert keep.keep(state) is state and not (tmp_path / "up").exists()
    keep.start(cohort=100, upload_bytes=spool.tensor_bytes(state))  # 2,400: to disk
    stored = keep.keep(state)
    assert torch.equal(stored["w"], state["w"]) and len(list((tmp_path / "up").iterdir())) == 1
    keep.clear()
    assert not (tmp_path / "up").exists()
