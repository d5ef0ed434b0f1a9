"""fedkey.export.metadata.privacy_facts: what an export says about privacy, from checkpoint metadata
in the shapes the server writes (and has written), never more than the checkpoint records."""

from __future__ import annotations

import math

from fedkey.export.metadata import privacy_facts


def test_poisson_accountant_of_an_older_checkpoint():
    meta = {
        "metrics": {"epsilon": 1.25, "info": {}},
        "server": {
            "accountant": {
                "steps": 7,
                "noise_multiplier": 1.0,
                "sampling_rate": 0.05,
                "delta": 1e-6,
                "target_epsilon": None,
            }
        },
    }
    p = privacy_facts(meta)
    assert p["dp"] is True and p["epsilon"] == 1.25 and p["delta"] == 1e-6
    assert p["steps"] == 7 and p["sampling_rate"] == 0.05 and p["target_epsilon"] is None
    assert p["clip"] is None and p["dp_clip"] is None


def test_round_zero_with_dp_has_spent_nothing_yet():
    acc = {"events": [], "sampling": "fixed", "noise_multiplier": 1.1, "delta": 1e-5}
    p = privacy_facts({"metrics": {"epsilon": 0.0, "info": {}}, "server": {"accountant": acc}})
    assert p["dp"] is True and p["epsilon"] == 0.0 and p["steps"] == 0


def test_fixed_size_events_are_counted_as_rounds():
    acc = {
        "events": [[100.0, 10, 3], [120.0, 10, 2]],
        "sampling": "fixed",
        "sampling_rate": 0.0,
        "noise_multiplier": 1.1,
        "delta": 1e-5,
        "target_epsilon": 4.0,
    }
    p = privacy_facts({"metrics": {"epsilon": 2.0}, "server": {"accountant": acc}})
    assert p["steps"] == 5 and p["sampling"] == "fixed" and p["sampling_rate"] is None
    assert p["target_epsilon"] == 4.0


def test_a_public_checkpoint_keeps_epsilon_but_not_the_accountant():
    # fedkey.models.checkpoint.public_bytes drops "server": epsilon is still known, delta is not.
    p = privacy_facts({"metrics": {"epsilon": 3.0}})
    assert p["dp"] is True and p["epsilon"] == 3.0 and p["delta"] is None


def test_infinite_epsilon_and_non_scalar_clip_fields():
    info = {"clip": {"mode": "fixed", "norm": {"emb": 1.0}, "clipped": 1, "norms": [3.0, 0.1]}}
    p = privacy_facts({"metrics": {"epsilon": math.inf, "info": info}, "server": {}})
    assert p["epsilon"] == "inf"
    assert p["clip"] == {"mode": "fixed"}  # per-layer / per-device lists dropped; DP: no count
    plain = privacy_facts({"metrics": {"epsilon": None, "info": info}})
    assert plain["clip"] == {"mode": "fixed", "clipped": 1}  # without DP the count is shown


def test_under_dp_no_exact_count_or_norm_even_from_an_older_row():
    # A DP row as the engine wrote it before fedkey.federation.metrics_row.public_info: exact counts, norms.
    clip = {"mode": "dp", "scope": "model", "norm": 1.0, "clipped": 3, "median_norm": 1.67,
            "max_norm": 1.7, "weight_cap": 4, "capped_weights": 0, "trimmed": 0}  # fmt: skip
    info = {"num_updates": 3, "attention_cap": 0.58, "clip": clip, "dp": {"sampling": "fixed"}}
    p = privacy_facts({"metrics": {"epsilon": 2.0, "info": info}})
    assert p["clip"] == {"mode": "dp", "scope": "model", "norm": 1.0, "updates": 3,
                         "attention_cap": 0.58}  # fmt: skip
    # Poisson's cohort size is private too.
    info = {**info, "dp": {"sampling": "poisson"}}
    p = privacy_facts({"metrics": {"epsilon": 2.0, "info": info}})
    assert p["clip"] == {"mode": "dp", "scope": "model", "norm": 1.0}


def test_no_dp_and_not_recorded_are_different_answers():
    assert privacy_facts({"metrics": {"epsilon": None}})["dp"] is False
    assert privacy_facts({"metrics": {"val_ppl": 100.0}})["dp"] is None
    assert privacy_facts({})["dp"] is None


def test_dp_fedavg_rows_without_a_clip_summary_keep_their_dp_clip():
    info = {"num_updates": 4, "clip_norm": 1.0, "clipped_fraction": 0.25, "noise_std": 0.1}
    p = privacy_facts({"metrics": {"epsilon": 2.0, "info": info}})
    assert p["clip"] is None
    assert p["dp_clip"] == {"norm": 1.0, "noise_std": 0.1}  # not the exact clipped fraction


def test_fedatt_step_size_is_not_a_privacy_epsilon():
    # FedAtt reports its step size as info["epsilon"]; only the row's "epsilon" is privacy.
    p = privacy_facts({"metrics": {"epsilon": None, "info": {"epsilon": 1.2}}})
    assert p["dp"] is False and p["epsilon"] is None


def test_rho_the_mechanism_and_the_adaptive_clip_of_a_tree_row():
    dp = {
        "mechanism": "tree",
        "min_separation": 10,
        "clip": 0.8,
        "clip_quantile": 0.5,
        "unclipped_fraction_noisy": 0.45,
        "next_clip": 0.81,
    }
    acc = {"mechanism": "tree", "steps": 3, "min_separation": 10, "delta": 2e-3}
    meta = {
        "metrics": {"epsilon": 4.0, "rho": 0.6, "info": {"dp": dp}},
        "server": {"accountant": acc},
    }
    p = privacy_facts(meta)
    assert (p["rho"], p["mechanism"], p["min_separation"], p["delta"]) == (0.6, "tree", 10, 2e-3)
    assert p["adaptive_clip"] == {"quantile": 0.5, "clip": 0.8, "unclipped_fraction_noisy": 0.45}
    # A public checkpoint (no accountant): delta and the mechanism from the row itself.
    public = privacy_facts({"metrics": {**meta["metrics"], "delta": 1e-3}})
    assert (public["delta"], public["mechanism"], public["min_separation"]) == (1e-3, "tree", 10)


def test_an_older_gaussian_row_is_gaussian_by_its_accountant_and_rho_may_be_infinite():
    acc = {"events": [[100.0, 10, 2]], "sampling": "fixed", "noise_multiplier": 0.0}
    p = privacy_facts(
        {"metrics": {"epsilon": math.inf, "rho": math.inf}, "server": {"accountant": acc}}
    )
    assert p["mechanism"] == "gaussian" and p["rho"] == "inf" and p["min_separation"] is None
    assert privacy_facts({"metrics": {"epsilon": None, "rho": None}})["mechanism"] is None
