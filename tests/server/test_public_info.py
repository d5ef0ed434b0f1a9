"""Under DP a round's published ``info`` holds only what the guarantee covers
(fedkey.federation.metrics_row.public_info): settings, functions of the clip and the cohort's size, and the
noised statistics; no per-phone weight, no exact norm or count. Without DP the row is as it was,
and the redaction changes no weight."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fedkey.federation.config import PrivacyConfig
from fedkey.federation.metrics_row import (
    COHORT_SIZE_KEYS,
    DP_INFO,
    DP_ROW,
    PHONE_KEYS,
    SCORE_KEYS,
    dp_events,
    public_info,
    public_row,
)
from fedkey.models.checkpoint import read_metadata
from fedkey.testing.federation import seeded_updates

PHONES = 12
DP = PrivacyConfig(clip_norm=0.05, noise_multiplier=1.0, delta=1e-5)
STRATEGIES = {
    "fedavg": {},
    "fedatt": {},
    "fedattopt": {},
    "fedmed": {"beta": 1.0, "epsilon_med": 0.0},  # what DP allows of FedMed
}
CASES = [
    *[(s, DP) for s in STRATEGIES],
    ("fedavg", replace(DP, sampling="poisson")),
    ("fedatt", replace(DP, mechanism="tree")),
    ("fedatt", replace(DP, clip_quantile=0.5, clip_count_stddev=2.0)),
    ("fedavg", replace(DP, mechanism="tree", clip_quantile=0.5, clip_count_stddev=2.0)),
]
# What a DP row used to publish: exact functions of the phones' updates.
LEAKS = {"weights", "total_weight", "attention_mean", "attention_max", "attention", "distance",
         "step_scale", "loss", "grad_norm", "train_loss", "prev_train_loss", "delta",
         "median_norm", "max_norm", "clipped", "outliers", "capped_weights"}  # fmt: skip


def make_fed(tmp_path, strategy: str, privacy: PrivacyConfig):
    from fedkey.federation.config import FederationConfig
    from fedkey.testing.federation import tiny_federation

    config = FederationConfig(
        strategy=strategy,  # type: ignore[arg-type]
        strategy_params=STRATEGIES[strategy],
        fraction=0.25,
        rounds=10,
        seed=5,
        privacy=privacy,
    )
    return tiny_federation(tmp_path, config, PHONES)


def run(fed, rounds: int = 3) -> list[dict]:
    """`rounds` rounds whose phones send seeded deltas of norms 0.01 to 0.12 (half clipped at
    0.05), each with its own train loss."""
    rows = [fed.start()]
    for _ in range(rounds):
        plan = fed.plan_round(sorted(fed.strategy.client_sizes))
        updates = seeded_updates(fed, plan, lambda i: 3.0 + 0.1 * i)
        rows.append(fed.complete_round(plan, updates))
    return rows


def leaf_keys(info: dict, prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in info.items():
        out += leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


def allowed(path: str, privacy: PrivacyConfig) -> bool:
    top, _, sub = path.partition(".")
    if top not in DP_INFO or (privacy.sampling == "poisson" and top in COHORT_SIZE_KEYS):
        return False
    keys = DP_INFO[top]
    return (not sub) if keys is None else sub in keys


@pytest.mark.parametrize(("strategy", "privacy"), CASES)
def test_a_dp_row_publishes_only_the_allow_list(tmp_path, strategy, privacy):
    fed = make_fed(tmp_path, strategy, privacy)
    rows = run(fed)
    phones = sorted(fed.strategy.client_sizes)
    for row in rows:
        info = row["info"]
        bad = [p for p in leaf_keys(info) if not allowed(p, privacy)]
        assert not bad, (bad, info)
        assert not any(isinstance(v, list) for v in info.values())
        text = json.dumps(info)
        assert not any(f'"{p}"' in text for p in phones)  # no per-phone value
        assert not LEAKS & set(leaf_keys(info)) and not any(
            k in LEAKS for k in info.get("clip", {})
        )
    last = rows[-1]["info"]
    assert last["strategy"] == strategy and last["clip"]["norm"] > 0
    assert last["dp"]["noise_std"] > 0 and last["dp"]["sensitivity"] > 0
    assert ("num_updates" in last) == (privacy.sampling != "poisson")
    if privacy.clip_quantile is not None:  # the noised count is what adaptive clipping publishes
        assert {"unclipped_fraction_noisy", "next_clip"} <= set(last["dp"])
    # What is on disk and downloaded is the same info; the server's own record names the
    # phones, what devices download names none (public_row), also once read back from disk.
    stored = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert stored["info"] == last and set(stored["aggregated"]) <= set(phones)
    assert stored["aggregated"] and stored["selected"]
    assert read_metadata(fed.storage.checkpoint_path(fed.round))["metrics"]["info"] == last
    public = tmp_path / "public.safetensors"
    for served in (fed.public_checkpoint(), reread(fed)):
        public.write_bytes(served)
        row = read_metadata(public)["metrics"]
        assert row["info"] == last and row["epsilon"] == rows[-1]["epsilon"]
        assert set(row) <= DP_ROW and not any(p in json.dumps(row) for p in phones)
    # Under Poisson sampling the bytes are the cohort's size times the model's: left out too.
    poisson = privacy.sampling == "poisson"
    shown = DP_ROW - ({"bytes_up", "bytes_down"} if poisson else set())
    assert public_row(rows[-1], privacy) == {k: v for k, v in rows[-1].items() if k in shown}
    assert "test_ppl" in rows[-1] and "best_round" in rows[-1]  # the server's own record
    assert rows[-1]["bytes_up"] > 0 and rows[-1]["bytes_down"] > 0  # the server's own record


def reread(fed) -> bytes:
    """The downloaded checkpoint as a restarted server serves it: from its file."""
    fed._public = None
    return fed.public_checkpoint()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_without_dp_the_row_is_as_before(tmp_path, strategy, monkeypatch):
    """No DP: the row's info is the strategy's and the bound's whole report (public_info hands
    back the same object), the very rows of a run with the redaction switched off."""
    fed = make_fed(tmp_path / "a", strategy, PrivacyConfig())
    rows = run(fed)
    info = rows[-1]["info"]
    assert {"median_norm", "max_norm", "clipped"} <= set(info["clip"])
    per_phone = {"fedavg": "weights", "fedatt": "attention_mean", "fedattopt": "attention",
                 "fedmed": "attention_mean"}[strategy]  # fmt: skip
    assert set(info[per_phone]) == set(rows[-1]["aggregated"])
    assert public_info(info, PrivacyConfig()) is info
    assert public_row(rows[-1], PrivacyConfig()) is rows[-1]  # the phones stay named

    monkeypatch.setattr("fedkey.federation.engine.public_info", lambda info, privacy: info)
    plain = run(make_fed(tmp_path / "b", strategy, PrivacyConfig()))
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in (*rows, *plain)]
    assert strip[: len(rows)] == strip[len(rows) :]


@pytest.mark.parametrize(("strategy", "privacy"), CASES[:2] + CASES[-2:])
def test_the_redaction_changes_no_weight(tmp_path, strategy, privacy, monkeypatch):
    """The same DP run with the redaction switched off: the same global model and server state
    every round; only the published row differs (it held the clipped count then). One
    passphrase for both runs: their noise is drawn alike (fedkey.federation.privacy.secret)."""
    privacy = replace(privacy, secret="compared runs")
    fed = make_fed(tmp_path / "a", strategy, privacy)
    rows = run(fed)
    monkeypatch.setattr("fedkey.federation.engine.public_info", lambda info, privacy: info)
    raw = make_fed(tmp_path / "b", strategy, privacy)
    raw_rows = run(raw)
    assert fed.global_state.keys() == raw.global_state.keys()
    assert all(torch.equal(fed.global_state[k], raw.global_state[k]) for k in fed.global_state)
    assert fed.server_state() == raw.server_state()
    assert "clipped" in raw_rows[-1]["info"]["clip"] and "clipped" not in rows[-1]["info"]["clip"]
    assert [r["epsilon"] for r in rows] == [r["epsilon"] for r in raw_rows]
    assert rows[-1]["info"]["dp"] == raw_rows[-1]["info"]["dp"]


def test_dp_publish_scores_publishes_the_held_out_scores_and_nothing_more(tmp_path):
    """--dp-publish-scores (the demo's): a DP row keeps its perplexities, top-k and best round,
    the stream its round's perplexities; still no phone named."""
    privacy = replace(DP, publish_scores=True)
    fed = make_fed(tmp_path, "fedavg", privacy)
    rows = run(fed)
    shown = public_row(rows[-1], privacy)
    assert set(shown) <= DP_ROW | SCORE_KEYS and not PHONE_KEYS & set(shown)
    assert shown["test_ppl"] == rows[-1]["test_ppl"] and "best_round" in shown
    assert "test_ppl" not in public_row(rows[-1], DP)
    assert dp_events(privacy)["round_aggregated"] >= {"val_ppl", "test_ppl"}
    assert (
        "test_ppl" not in dp_events(DP)["round_aggregated"] and dp_events(PrivacyConfig()) is None
    )
