"""`fedkey simulate --malicious N --attack X`: refused uploads are dropped and named, as the HTTP
server refuses them; the backdoor's success is a metrics-row field every round."""

from __future__ import annotations

import math
import re

import pytest

from fedkey.device_sim.attacks import BackdoorError
from fedkey.device_sim.config import BackdoorConfig
from fedkey.runners.simulate import SimulationConfig, simulate
from fedkey.testing.workload import DATA, FED, tiny


def run(tmp_path, **attack) -> list[dict]:
    return simulate(
        SimulationConfig(DATA, FED, tiny, str(tmp_path), workers=0, progress=False, **attack)
    )


@pytest.mark.parametrize(
    ("attack", "reason"),
    [("nan", "422 tensor '.*' contains NaN values"), ("shape", "422 the update does not fit")],
)
def test_refused_uploads_are_dropped_and_named_in_the_row(tmp_path, attack, reason):
    rows = run(tmp_path, malicious=1, attack=attack)
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[0]["rejected"] == {}
    for row in rows[1:]:
        assert row["aggregated"] == ["device-0", "device-1", "device-2"]
        assert list(row["rejected"]) == ["device-3"]  # the last phone by name
        assert re.match(reason, row["rejected"]["device-3"])
        assert math.isfinite(row["test_ppl"]) and row["test_ppl"] < rows[0]["test_ppl"]


def test_every_upload_refused_is_an_error_that_says_why(tmp_path):
    with pytest.raises(ValueError, match="every upload was refused.*device-0: 422"):
        run(tmp_path, malicious=4, attack="nan")


def test_backdoor_success_is_reported_every_round_also_without_attackers(tmp_path):
    clean = run(tmp_path / "clean", malicious=0, attack="backdoor")
    bad = run(tmp_path / "bad", malicious=1, attack="backdoor")
    for rows in (clean, bad):
        assert all(0.0 <= r["backdoor_top1"] <= r["backdoor_top3"] <= 1.0 for r in rows)
    assert "rejected" not in clean[-1] and bad[-1]["rejected"] == {}
    # the attacker's boosted update (model replacement, x4 in a cohort of 4) moves the model
    assert bad[-1]["test_ppl"] != clean[-1]["test_ppl"]


def test_a_backdoor_word_outside_the_vocabulary_is_refused_before_training(tmp_path):
    with pytest.raises(BackdoorError, match="'zzyzx' is not in the server tokenizer's vocabulary"):
        run(tmp_path, malicious=1, attack="backdoor", backdoor=BackdoorConfig(target="zzyzx"))


def test_a_diverged_run_still_gets_its_perplexity_plot(tmp_path):
    from fedkey.federation.storage import plot_perplexity

    rows = [
        {"round": 0, "val_ppl": 1874.6, "test_ppl": 1874.5},
        {"round": 1, "val_ppl": 1.1e48, "test_ppl": 1.8e49},
        {"round": 2, "val_ppl": 9.7e290, "test_ppl": 3.6e289},  # ticks past 1e308 overflowed
        {"round": 3, "val_ppl": math.inf, "test_ppl": math.inf},
    ]
    assert plot_perplexity({"fedatt, --bound off, x100": rows}, tmp_path / "p.png").stat().st_size
