"""DP-FTRL with BLT noise (fedkey.federation.privacy.blt): the shipped factorizations and their min-separation
sensitivity against brute force, the streaming noise against C^{-1} Z, the accounting, the round
engine and `fedkey simulate --dp-mechanism blt`."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.federation.privacy.blt import (
    BLT,
    BLTAccountant,
    BLTNoise,
    blt_rho,
    load_table,
    minsep_sensitivity,
    select_blt,
    unit_draw,
)
from fedkey.federation.privacy.ftrl import BLTMechanism
from fedkey.federation.privacy.gaussian import PrivacyAccountant
from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.privacy.tree import TreeAccountant, zcdp_epsilon
from tests.federation.privacy.test_tree import run_round, share_secret

#: Two buffers, coefficients 1, 0.5, 0.37, 0.293, ... (non-negative, decreasing).
TWO = BLT(rounds=8, min_separation=2, buf_decay=(0.9, 0.5), output_scale=(0.3, 0.2), sensitivity=0)

# --------------------------------------------------------------------------- the factorization


def brute_force_sensitivity(blt: BLT, t: int, b: int) -> float:
    """max over every b-separated P in rounds 1..t of ||C_t 1_P||."""
    c = blt.matrix(t)
    best = 0.0
    for size in range(1, t + 1):
        for chosen in itertools.combinations(range(t), size):
            if all(y - x >= b for x, y in itertools.pairwise(chosen)):
                best = max(best, float(np.linalg.norm(c[:, list(chosen)].sum(axis=1))))
    return best


def test_the_shipped_table_covers_the_acceptance_run_and_its_sensitivities_are_exact():
    """Every shipped entry: C's coefficients are non-negative and non-increasing (load_table),
    its recorded sensitivity is the min-sep sensitivity for its (n, b), by brute force where n
    is small; the 3-round entries cover `--rounds 3` at any b."""
    table = load_table()
    assert {(e.rounds, e.min_separation) for e in table} >= {(3, 1), (3, 2), (3, 3)}
    for entry in table:
        c = entry.coefs(entry.rounds)
        assert c[0] == 1 and np.all(c >= 0) and np.all(np.diff(c) <= 0)
        direct = minsep_sensitivity(c, entry.min_separation)
        assert direct == pytest.approx(entry.sensitivity, rel=1e-9)
        if entry.rounds <= 10:
            exact = brute_force_sensitivity(entry, entry.rounds, entry.min_separation)
            assert direct == pytest.approx(exact, rel=1e-12)
        assert np.allclose(entry.matrix(6) @ np.linalg.inv(entry.matrix(6)), np.eye(6))


@pytest.mark.parametrize("t", range(1, 10))
def test_the_closed_form_is_the_worst_b_separated_participation(t):
    for b in range(1, t + 2):
        assert minsep_sensitivity(TWO.coefs(t), b) == pytest.approx(
            brute_force_sensitivity(TWO, t, b), rel=1e-12
        )


def test_no_participation_with_vector_updates_moves_the_release_further():
    """Replace-one moves C Y by sum_{t in P} C[:, t] u_t^T with ||u_t|| <= 1: its Frobenius norm
    never exceeds sens_b (C >= 0), for random b-separated P and unit u_t."""
    rng = np.random.default_rng(0)
    c, b = TWO.matrix(9), 3
    sens = minsep_sensitivity(TWO.coefs(9), b)
    for _ in range(300):
        start = int(rng.integers(0, b))
        rounds = [t for t in range(start, 9, b) if rng.random() < 0.8]
        u = rng.standard_normal((len(rounds), 5))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        assert np.linalg.norm(c[:, rounds] @ u) <= sens + 1e-12


def test_the_inverse_coefficients_invert_c():
    inv = TWO.inverse_coefs(8)
    assert np.allclose(np.linalg.inv(TWO.matrix(8))[:, 0], inv, atol=1e-14)


def test_selection_takes_the_shortest_covering_run_and_a_separation_no_larger():
    assert (select_blt(3, 10).rounds, select_blt(3, 10).min_separation) == (3, 3)
    assert select_blt(2, 1).min_separation == 1 and select_blt(2, 1).rounds == 3
    chosen = select_blt(4, 3)
    assert chosen.rounds >= 4 and chosen.min_separation <= 3


def test_a_run_longer_than_the_table_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        BLTAccountant(1.0, None, rounds=10**7)
    message = str(err.value)
    assert "\n" not in message
    assert "tools/blt_params.py --rounds 10000000" in message and "fedkey[blt]" in message
    longest = max(e.rounds for e in load_table())
    assert f"--rounds {longest} or fewer" in message


# --------------------------------------------------------------------------- the noise


def test_the_streaming_noise_is_c_inverse_times_the_draws_scaled_by_z_delta():
    """Round t adds z Delta_t (C^{-1} W)_t; their sum is prefix_noise; release_std is the
    standard deviation of that sum, in the draws too."""
    template = {"w": torch.zeros(100_000), "step": torch.tensor(3)}
    z, sens = 1.5, [1.0, 0.5, 2.0, 1.0, 1.0, 0.25, 1.0, 3.0]
    noise = BLTNoise(RunSecret(passphrase="11"), noise_multiplier=z, blt=TWO)
    released = []
    for delta in sens:
        residual = noise.release(template, delta)
        assert residual is not None and set(residual) == {"w"}
        released.append(residual["w"].numpy())
    draws = np.stack(
        [unit_draw(template, RunSecret(passphrase="11"), t)["w"].numpy() for t in range(1, 9)]
    )
    expected = z * np.array(sens)[:, None] * np.linalg.solve(TWO.matrix(8), draws)
    assert np.allclose(np.stack(released), expected, atol=1e-12)
    total = noise.prefix_noise(template)["w"]
    assert torch.allclose(total, torch.from_numpy(np.stack(released).sum(0)), atol=1e-12)
    a_d_cinv = np.tril(np.ones((8, 8))) @ np.diag(sens) @ np.linalg.inv(TWO.matrix(8))
    assert noise.release_std() == pytest.approx(z * np.linalg.norm(a_d_cinv[-1]), rel=1e-12)
    assert total.std().item() == pytest.approx(noise.release_std(), rel=0.01)


def test_a_restored_noise_rebuilds_its_buffers_from_the_secret():
    template = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    straight = BLTNoise(RunSecret(passphrase="5"), noise_multiplier=0.7, blt=TWO)
    for _ in range(4):
        straight.release(template, 1.0)
    restored = BLTNoise(RunSecret(passphrase="5"), noise_multiplier=0.7, blt=TWO)
    restored.load_state_dict(json.loads(json.dumps(straight.state_dict())))
    for _ in range(3):
        one, two = straight.release(template, 2.0), restored.release(template, 2.0)
        assert one is not None and two is not None
        for k in one:
            assert torch.equal(one[k], two[k]), k
    other = BLTNoise(RunSecret(passphrase="6"), noise_multiplier=0.7, blt=TWO)
    other.load_state_dict(straight.state_dict())
    assert not torch.equal(
        other.prefix_noise(template)["a"], straight.prefix_noise(template)["a"]
    )  # another secret, other noise
    assert (
        BLTNoise(RunSecret(), 0.0, TWO).release(template, 1.0) is None
    )  # zero noise: nothing added


# --------------------------------------------------------------------------- accounting


def test_rho_is_the_prefix_sensitivity_squared_over_two_z_squared():
    entry = select_blt(3, 3)
    acc = BLTAccountant(noise_multiplier=2.0, min_separation=2, rounds=3, delta=1e-5)
    assert (acc.rho, acc.epsilon) == (0.0, 0.0)
    for t in range(1, 4):
        acc.step()
        exact = brute_force_sensitivity(acc.blt, t, 2)
        assert acc.rho == pytest.approx(exact**2 / 8.0, rel=1e-12)
        assert acc.epsilon == zcdp_epsilon(acc.rho, 1e-5)
    assert acc.blt == select_blt(3, 2)
    # one participation (b >= T): C's first column, sum of c_i^2
    assert blt_rho(3, 1.0, 5, entry) == pytest.approx(float(entry.coefs(3) @ entry.coefs(3)) / 2)
    assert blt_rho(0, 1.0, 2, entry) == 0.0 and blt_rho(2, 0.0, 2, entry) == math.inf


def test_blt_accountant_budget_state_and_mechanism_checks():
    target = zcdp_epsilon(blt_rho(3, 1.0, 1, select_blt(3, 1)), 1e-5)
    acc = BLTAccountant(1.0, 1, rounds=3, delta=1e-5, target_epsilon=target)
    for _ in range(2):
        acc.step()
    assert not acc.exhausted and acc.would_exceed() is False
    acc.step()
    assert acc.exhausted and acc.would_exceed()
    state = json.loads(json.dumps(acc.state_dict()))
    assert state["mechanism"] == "blt" and state["blt"] == {"rounds": 3, "min_separation": 1}
    restored = BLTAccountant(1.0, None, rounds=2)
    restored.load_state_dict(state)
    assert (restored.steps, restored.min_separation, restored.rho) == (3, 1, acc.rho)
    with pytest.raises(ValueError, match="--dp-mechanism blt"):
        TreeAccountant(1.0, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="--dp-mechanism blt"):
        PrivacyAccountant(1.0).load_state_dict(state)
    with pytest.raises(ValueError, match="--dp-mechanism tree"):
        BLTAccountant(1.0, 1, rounds=3).load_state_dict(TreeAccountant(1.0, 1).state_dict())


# --------------------------------------------------------------------------- the round engine


def make_fed(tmp_path, privacy: PrivacyConfig, phones: int = 12, fraction: float = 0.25):
    from fedkey.testing.federation import tiny_federation

    config = FederationConfig(fraction=fraction, rounds=5, seed=3, privacy=privacy)
    return tiny_federation(tmp_path, config, phones)


# One secret for both runs compared: their cohorts are drawn alike (fedkey.federation.privacy.secret).
DP = PrivacyConfig(clip_norm=1.0, noise_multiplier=0.0, secret="same cohorts")


def test_without_noise_blt_is_the_gaussian_mechanism_bit_for_bit(tmp_path):
    """z = 0, b = 1: the same cohorts and the same model each round as the gaussian mechanism's
    with z = 0 (FTRL on the exact prefix sums)."""
    blt = make_fed(tmp_path / "blt", replace(DP, mechanism="blt", min_separation=1))
    plain = make_fed(tmp_path / "plain", DP)
    for _ in range(5):
        _, cohort_blt = run_round(blt)
        _, cohort_plain = run_round(plain)
        assert cohort_blt == cohort_plain
        for k, v in plain.global_state.items():
            assert torch.equal(blt.global_state[k], v), k


def test_the_model_is_theta0_plus_the_prefix_sum_plus_the_blt_noise(tmp_path):
    fed = make_fed(tmp_path, PrivacyConfig(clip_norm=1.0, noise_multiplier=0.5, mechanism="blt"))
    theta0 = dict(fed.global_state)
    steps: dict = {}
    for _ in range(5):
        row, _ = run_round(fed, steps)
        mechanism = fed.privacy.mechanism
        assert isinstance(mechanism, BLTMechanism)
        noise = mechanism.noise
        total = noise.prefix_noise(theta0)
        for k in total:
            expected = theta0[k].double() + sum(steps[s][k] for s in steps).double() + total[k]
            assert torch.allclose(fed.global_state[k].double(), expected, atol=1e-5), k
        dp = row["info"]["dp"]
        assert dp["mechanism"] == "blt" and dp["release_noise_std"] == noise.release_std()
        assert row["rho"] == blt_rho(row["round"], 0.5, 4, select_blt(5, 4))


def test_selection_keeps_phones_b_rounds_apart_and_a_resumed_run_gives_the_same_weights(
    tmp_path,
):
    privacy = PrivacyConfig(clip_norm=1.0, noise_multiplier=0.7, mechanism="blt", min_separation=2)
    share_secret(tmp_path / "straight", tmp_path / "resumed")
    straight = make_fed(tmp_path / "straight", privacy)
    rows, last = [straight.start()], {}
    for r in range(1, 6):
        row, cohort = run_round(straight)
        rows.append(row)
        for d in cohort:
            assert r - last.get(d, -100) >= 2, (d, r)
            last[d] = r
    for row in rows:
        assert row["info"]["dp"]["min_separation"] == 2
        assert math.isfinite(row["epsilon"]) and math.isfinite(row["rho"])
    first = make_fed(tmp_path / "resumed", privacy)
    first.start()
    for _ in range(3):
        run_round(first)
    resumed = make_fed(tmp_path / "resumed", privacy)
    assert resumed.resume() and resumed.round == 3
    for _ in range(2):
        row, _ = run_round(resumed)
    for k, v in straight.global_state.items():
        assert torch.equal(resumed.global_state[k], v), k
    assert row["rho"] == rows[-1]["rho"]
    with pytest.raises(ValueError, match="--dp-mechanism blt"):
        make_fed(tmp_path / "resumed", replace(privacy, mechanism="tree")).resume()
