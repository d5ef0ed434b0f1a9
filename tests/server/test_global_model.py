"""The keyboard's export (fedkey.server.global_model.GlobalModel): the round best on validation so far,
so a round that does worse never replaces the served model; every round with export_latest, or
under DP."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedkey.federation.config import PrivacyConfig
from fedkey.server import global_model
from fedkey.server.events import EventBus
from fedkey.server.global_model import GlobalModel


class FakeFederation:
    """What GlobalModel reads of a Federation: the round, the best round, the checkpoints, the
    privacy config."""

    def __init__(self, root: Path, privacy: PrivacyConfig | None = None, ngram: str | None = None):
        self.round = 0
        self.best: dict | None = None
        self.storage = SimpleNamespace(checkpoint_path=lambda r: root / f"round_{r:04d}")
        self.config = SimpleNamespace(privacy=privacy or PrivacyConfig(), ngram=ngram)

    def public_checkpoint(self) -> bytes:
        return f"round {self.round}".encode()

    def finish_round(self, val_ppl: float) -> None:
        """Round r recorded as fedkey.federation.engine._record does: `best` follows validation."""
        self.round += 1
        if self.best is None or val_ppl < self.best["val_ppl"]:
            self.best = {"round": self.round, "val_ppl": val_ppl}


def exported_rounds(
    tmp_path,
    monkeypatch,
    val_ppls: list[float],
    latest: bool,
    privacy: PrivacyConfig | None = None,
    ngram: str | None = None,
) -> list[int]:
    """The rounds whose checkpoints GlobalModel exported, one refresh per round (each export
    finished before the next round, as in a federation whose rounds outlast an export); each
    export is asked to ship the run's n-gram `ngram`."""
    exported: list[int] = []

    def fake_export(checkpoint: Path, export_dir: Path, metrics, shipped: str | None = None):
        assert shipped == ngram
        exported.append(int(checkpoint.name.removeprefix("round_")))
        return SimpleNamespace(path=export_dir / "model.onnx", bytes=1)

    monkeypatch.setattr(global_model, "_export", fake_export)
    fed = FakeFederation(tmp_path, privacy, ngram)

    async def run() -> None:
        model = GlobalModel(fed, EventBus(), tmp_path / "export", export_latest=latest)  # type: ignore[arg-type]
        for val_ppl in [None, *val_ppls]:
            if val_ppl is not None:
                fed.finish_round(val_ppl)
            model.refresh()
            assert model.current()[0] == fed.round  # GET /v1/model: always the newest round
            while model._exporting is not None:
                await asyncio.sleep(0.01)

    asyncio.run(run())
    return exported


def test_a_round_that_does_worse_on_validation_leaves_the_export_alone(tmp_path, monkeypatch):
    # Round 0 is exported before any round is scored (the keyboard needs a model to start).
    rounds = exported_rounds(tmp_path, monkeypatch, [100.0, 90.0, 95.0, 91.0, 80.0], latest=False)
    assert rounds == [0, 1, 2, 5]


def test_export_latest_exports_every_round(tmp_path, monkeypatch):
    rounds = exported_rounds(tmp_path, monkeypatch, [100.0, 90.0, 95.0], latest=True)
    assert rounds == [0, 1, 2, 3]


def test_a_run_with_an_ngram_ships_it_with_every_export(tmp_path, monkeypatch):
    ngram = str(tmp_path / "ngram.safetensors")
    rounds = exported_rounds(tmp_path, monkeypatch, [100.0, 90.0], latest=True, ngram=ngram)
    assert rounds == [0, 1, 2]  # fake_export checked each was asked to ship `ngram`


def test_under_dp_the_export_follows_the_newest_round(tmp_path, monkeypatch):
    """Choosing the round by the phones' held-out text is a release the accountant does not
    cover: under DP every round is exported, as it was noised."""
    dp = PrivacyConfig(clip_norm=1.0)
    rounds = exported_rounds(tmp_path, monkeypatch, [100.0, 90.0, 95.0], latest=False, privacy=dp)
    assert rounds == [0, 1, 2, 3]
    scored = replace(dp, publish_scores=True)  # the scores are published: so may the best be
    rounds = exported_rounds(
        tmp_path, monkeypatch, [100.0, 90.0, 95.0], latest=False, privacy=scored
    )
    assert rounds == [0, 1, 2]


@pytest.mark.parametrize("latest", [False, True])
def test_export_round_names_the_best_or_the_newest(tmp_path, latest):
    fed = FakeFederation(tmp_path)
    model = GlobalModel(fed, EventBus(), None, export_latest=latest)  # type: ignore[arg-type]
    assert model.export_round() == 0
    fed.finish_round(50.0)
    fed.finish_round(60.0)
    assert model.export_round() == (2 if latest else 1)
