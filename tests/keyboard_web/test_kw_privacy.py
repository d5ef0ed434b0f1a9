"""The keyboard tells the truth about privacy: an export made from a checkpoint written the way
fedkey.federation.engine writes it (the metrics row with "epsilon", the server state with the accountant)
carries epsilon so far, delta, the budget and the bounding to /api/info, /model.json and the
events; without DP it says so; an export that never recorded it says "not recorded"."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from fedkey.keyboard_web.app import create_app
from fedkey.testing.keyboard import save_round

# info["clip"] as fedkey.federation.influence.bounding.bound_round reports it (a `fedkey simulate --strategy fedatt` row).
CLIP = {
    "mode": "adaptive",
    "median_norm": 0.42,
    "max_norm": 1.9,
    "scope": "model",
    "norm": 0.84,
    "clipped": 2,
    "weight_cap": 1172,
    "capped_weights": 1,
}


def engine_round(
    steps: int = 3,
    noise_multiplier: float | None = 1.1,
    target_epsilon: float | None = 8.0,
    clip: dict | None = CLIP,
    tree: bool = False,
) -> tuple[dict, dict]:
    """(metrics row, server state) of a FedAtt round `steps` as fedkey.federation.engine._record writes
    them; noise_multiplier None: no DP (no accountant, "epsilon": null); `tree`: DP-FTRL over
    200 phones with b = 10 and adaptive clipping (quantile 0.5), at the default delta."""
    from fedkey.federation.privacy.gaussian import PrivacyAccountant
    from fedkey.federation.privacy.tree import TreeAccountant

    info: dict = {
        "strategy": "fedatt",
        "num_updates": 4,
        "epsilon": 1.2,  # FedAtt's step size, not a privacy epsilon: never shown as one
        "attention_mean": {"phone-7": 0.61, "phone-9": 0.39},  # per-device: never exported
        "attention_cap": 0.23,
    }
    if clip is not None:
        info["clip"] = clip
    accountant: PrivacyAccountant | TreeAccountant | None = None
    if noise_multiplier is not None and tree:
        accountant = TreeAccountant(
            1.2, 10, delta=None, target_epsilon=target_epsilon, count_stddev=2.0
        )
        for _ in range(steps):
            accountant.step(population=200)
        info["dp"] = {
            "mechanism": "tree",
            "min_separation": 10,
            "noise_multiplier": noise_multiplier,
            "clip": 0.84,
            "clip_quantile": 0.5,
            "unclipped_fraction_noisy": 0.55,
            "next_clip": 0.83,
        }
    elif noise_multiplier is not None:
        accountant = PrivacyAccountant(
            noise_multiplier, "fixed", delta=1e-5, target_epsilon=target_epsilon
        )
        for _ in range(steps):
            accountant.step(population=10, cohort=4)
        info["dp"] = {
            "mechanism": "gaussian",
            "sensitivity": 0.5,
            "noise_std": 0.275,
            "sampling": "fixed",
            "clip": 0.84,
        }
    row = {
        "round": steps,
        "strategy": "fedatt",
        "selected": ["phone-7", "phone-9"],
        "aggregated": ["phone-7", "phone-9"],
        "val_ppl": 150.0,
        "test_ppl": 155.0,
        "epsilon": accountant.epsilon if accountant is not None else None,
        "rho": accountant.rho if accountant is not None else None,
        "delta": accountant.delta if accountant is not None else None,
        "info": info,
    }
    server = {
        "strategy": {"scores": {"phone-7": 0.61}},
        "accountant": accountant.state_dict() if accountant is not None else None,
        "best": {"round": steps, "val_ppl": 150.0},
    }
    return row, server


def served(models, tmp_path, name: str, **kw):
    row, server = engine_round(**kw)
    path = save_round(models, row["round"], tmp_path / name, metrics=row, server=server)
    return TestClient(create_app(path)), row


def strict_json(text: str):
    """json.loads that refuses NaN/Infinity, as a browser's JSON.parse does."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_dp_export_reports_epsilon_so_far_the_budget_and_the_bounding(models, tmp_path):
    client, row = served(models, tmp_path, "dp")
    with client:
        info = client.get("/api/info").json()
        p = info["privacy"]
        assert p["dp"] is True and 0 < p["epsilon"] < 8
        assert p["epsilon"] == pytest.approx(row["epsilon"])
        assert p["target_epsilon"] == 8.0 and p["delta"] == 1e-5
        assert p["rho"] == pytest.approx(row["rho"]) and p["mechanism"] == "gaussian"
        assert p["min_separation"] is None and p["adaptive_clip"] is None
        assert (p["noise_multiplier"], p["sampling"], p["steps"]) == (1.1, "fixed", 3)
        assert p["sampling_rate"] is None  # q means nothing for a fixed-size cohort
        # Under DP the bound alone: no exact count or norm (fedkey.federation.metrics_row.public_info)
        assert p["clip"] == {"mode": "adaptive", "scope": "model", "norm": 0.84, "updates": 4,
                             "attention_cap": 0.23}  # fmt: skip
        assert p["dp_clip"] is None  # the clip summary says it all
        assert info["strategy"] == "fedatt" and info["round"] == 3

        raw = client.get("/model.json").text  # what browser mode reads
        assert strict_json(raw)["privacy"] == p
        assert "phone-7" not in raw and "scores" not in raw  # no per-device server memory
        with client.websocket_connect("/ws/events") as events:
            assert events.receive_json()["privacy"] == p


def test_a_tree_export_reports_rho_the_mechanism_b_and_the_adaptive_clip(models, tmp_path):
    client, row = served(models, tmp_path, "tree", tree=True)
    with client:
        p = client.get("/api/info").json()["privacy"]
    assert p["mechanism"] == "tree" and p["min_separation"] == 10
    assert p["rho"] == pytest.approx(row["rho"]) and p["delta"] == pytest.approx(200**-1.1)
    assert p["epsilon"] == pytest.approx(row["epsilon"]) and p["steps"] == 3
    assert p["adaptive_clip"] == {"quantile": 0.5, "clip": 0.84, "unclipped_fraction_noisy": 0.55}


def test_without_dp_the_keyboard_says_none(models, tmp_path):
    client, _ = served(models, tmp_path, "plain", noise_multiplier=None, clip={"mode": "off"})
    with client:
        p = client.get("/api/info").json()["privacy"]
    assert p["dp"] is False
    assert p["epsilon"] is None and p["target_epsilon"] is None and p["delta"] is None
    assert p["rho"] is None and p["mechanism"] is None and p["adaptive_clip"] is None
    assert p["clip"]["mode"] == "off" and p["dp_clip"] is None


def test_without_dp_the_bounding_keeps_its_counts(models, tmp_path):
    client, _ = served(models, tmp_path, "plainclip", noise_multiplier=None)
    with client:
        p = client.get("/api/info").json()["privacy"]
    assert p["dp"] is False and p["clip"] == {**CLIP, "updates": 4, "attention_cap": 0.23}


def test_no_budget_and_no_clip_summary_are_reported_as_absent(models, tmp_path):
    client, _ = served(models, tmp_path, "nobudget", target_epsilon=None, clip=None)
    with client:
        p = client.get("/api/info").json()["privacy"]
    assert p["dp"] is True and p["epsilon"] > 0
    assert p["target_epsilon"] is None and p["clip"] is None


def test_infinite_epsilon_is_said_as_inf_in_valid_json(models, tmp_path):
    client, row = served(models, tmp_path, "inf", noise_multiplier=0.0)
    assert math.isinf(row["epsilon"])  # noise multiplier 0: no guarantee at all
    with client:
        r = client.get("/api/info")
        assert r.status_code == 200
        assert strict_json(r.text)["privacy"]["epsilon"] == "inf"
        assert strict_json(client.get("/model.json").text)["privacy"]["epsilon"] == "inf"


def test_an_export_that_did_not_record_privacy_says_so(models, client, tmp_path):
    # The session's model: a checkpoint whose metrics have no "epsilon" at all.
    p = client.get("/api/info").json()["privacy"]
    assert p["dp"] is None and p["epsilon"] is None
    # An export from before "privacy" existed in model.json: the same answer, not a guess.
    old = tmp_path / "old"
    save_round(models, 2, old)
    meta = json.loads((old / "model.json").read_text())
    del meta["privacy"]
    (old / "model.json").write_text(json.dumps(meta))
    with TestClient(create_app(old / "model.onnx")) as c:
        p = c.get("/api/info").json()["privacy"]
    assert p["dp"] is None and all(p[k] is None for k in ("epsilon", "delta", "target_epsilon"))


@pytest.fixture
def client(models):
    with TestClient(create_app(models.word)) as c:
        yield c
