"""DP-FTRL (fedkey.federation.privacy.tree): the tree's noise, the separation rule, the zCDP accounting against
brute force and dp_accounting, and the round engine under --dp-mechanism tree."""

from __future__ import annotations

import itertools
import json
import math
import secrets
from dataclasses import replace
from pathlib import Path

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import RdpAccountant
from pydantic import ValidationError

from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.federation.privacy.ftrl import TreeMechanism
from fedkey.federation.privacy.gaussian import PrivacyAccountant
from fedkey.federation.privacy.secret import RunSecret, write_secret
from fedkey.federation.privacy.tree import (
    TreeAccountant,
    TreeNoise,
    eligible,
    node_rounds,
    prefix_nodes,
    residual_nodes,
    separation_problem,
    tree_rho,
    worst_case_square_sum,
    zcdp_epsilon,
)
from fedkey.federation.storage import SECRET_FILE, RunStorage
from fedkey.server.settings import Settings

# --------------------------------------------------------------------------- the tree


def test_prefix_nodes_tile_the_prefix_with_one_node_per_set_bit():
    assert prefix_nodes(6) == [(2, 0), (1, 2)]
    assert prefix_nodes(0) == []
    for t in range(1, 130):
        covered = [r for node in prefix_nodes(t) for r in node_rounds(node)]
        assert covered == list(range(1, t + 1))
        assert len(prefix_nodes(t)) == bin(t).count("1") <= math.floor(math.log2(t)) + 1
        added, removed = residual_nodes(t)
        assert set(prefix_nodes(t)) == (set(prefix_nodes(t - 1)) - set(removed)) | set(added)


def test_each_release_has_the_variance_of_its_nodes():
    """n_t sums popcount(t) independent nodes: Var = popcount(t) sigma^2, exactly by construction
    (release_std) and in the draws (400,000 coordinates: the std within 1 %); the residuals the
    engine adds sum to the prefix noise."""
    template = {"w": torch.zeros(400_000), "step": torch.tensor(3)}
    sigma = 0.5
    tree = TreeNoise(RunSecret(passphrase="7"), noise_multiplier=2.0)
    total = torch.zeros(400_000, dtype=torch.float64)
    for t in range(1, 9):
        residual = tree.release(template, sensitivity=sigma / 2.0)
        assert residual is not None and set(residual) == {"w"}
        total += residual["w"]
        nodes = bin(t).count("1")
        assert tree.release_std() == pytest.approx(math.sqrt(nodes) * sigma, rel=1e-12)
        noise = tree.prefix_noise(template)["w"]
        assert noise.std().item() == pytest.approx(math.sqrt(nodes) * sigma, rel=0.01)
        assert torch.allclose(total, noise, atol=1e-9)
    # Nodes are drawn afresh from the secret: the same noise after a restart.
    again = TreeNoise(RunSecret(passphrase="7"), noise_multiplier=2.0)
    again.load_state_dict(json.loads(json.dumps(tree.state_dict())))
    assert torch.equal(again.prefix_noise(template)["w"], tree.prefix_noise(template)["w"])
    other = TreeNoise(RunSecret(passphrase="8"), noise_multiplier=2.0)
    other.load_state_dict(tree.state_dict())
    assert not torch.equal(other.prefix_noise(template)["w"], noise)  # another secret, other noise


def test_a_node_carries_z_times_the_largest_sensitivity_of_its_rounds():
    tree = TreeNoise(RunSecret(), noise_multiplier=1.5)
    template = {"w": torch.zeros(3)}
    for sens in (1.0, 3.0, 2.0):
        tree.release(template, sens)
    assert tree.node_std((1, 0)) == 1.5 * 3.0 and tree.node_std((0, 2)) == 1.5 * 2.0
    assert tree.release_std() == pytest.approx(1.5 * math.sqrt(3.0**2 + 2.0**2))
    with pytest.raises(ValueError, match="ends after"):
        tree.node_std((2, 0))
    assert TreeNoise(RunSecret(), 0.0).release(template, 1.0) is None  # zero noise: nothing added


# --------------------------------------------------------------------------- accounting


def exact_square_sum(rounds: int, b: int) -> int:
    """max_P sum_v n_v^2 by brute force over every b-separated set of rounds."""
    nodes = [
        (level, j)
        for level in range(rounds.bit_length())
        for j in range(rounds >> level)  # the complete nodes
    ]
    best = 0
    for size in range(1, rounds + 1):
        for chosen in itertools.combinations(range(1, rounds + 1), size):
            if any(y - x < b for x, y in itertools.pairwise(chosen)):
                continue
            total = sum(sum(1 for t in chosen if t in node_rounds(v)) ** 2 for v in nodes)
            best = max(best, total)
    return best


@pytest.mark.parametrize("rounds", range(1, 11))
def test_the_closed_form_bounds_the_exact_worst_case(rounds):
    for b in range(1, rounds + 2):
        exact = exact_square_sum(rounds, b)
        bound = worst_case_square_sum(rounds, b)
        assert bound >= exact, (rounds, b)
        if b >= rounds:  # one participation: every level of the tree, exactly
            assert bound == exact == math.floor(math.log2(rounds)) + 1
        if b == 1:  # every phone every round: all counts packed, exactly
            assert bound == exact


def test_rho_of_a_known_small_case():
    """T = 4, b = 2: a phone trains in rounds 1 and 3 at worst: the leaves 1 + 1, the pairs
    1 + 1, the root 2^2: sum 8, rho = 8 / (2 z^2)."""
    assert exact_square_sum(4, 2) == worst_case_square_sum(4, 2) == 8
    assert tree_rho(4, 2.0, 2) == 8 / (2 * 4.0)
    assert tree_rho(0, 1.0, 2) == 0.0 and tree_rho(3, 0.0, 2) == math.inf


@pytest.mark.parametrize("rounds", [1, 3, 8, 100])
def test_one_participation_is_dp_accountings_single_epoch_tree(rounds):
    z, delta = 1.3, 1e-6
    lib = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    lib.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(z, rounds))
    rho = tree_rho(rounds, z, b=rounds)
    assert rho == math.ceil(math.log2(rounds + 1)) / (2 * z * z)
    assert zcdp_epsilon(rho, delta) == pytest.approx(lib.get_epsilon(delta), rel=1e-12)


def test_epsilon_and_rho_grow_with_the_rounds_and_respect_the_zcdp_conversion():
    acc = TreeAccountant(noise_multiplier=1.0, min_separation=3, delta=1e-5)
    assert (acc.rho, acc.epsilon) == (0.0, 0.0)
    rhos, epsilons = [], []
    for _ in range(64):
        acc.step()
        rhos.append(acc.rho)
        epsilons.append(acc.epsilon)
        assert math.isfinite(acc.epsilon) and acc.epsilon > 0
        assert acc.epsilon <= acc.rho + 2 * math.sqrt(acc.rho * math.log(1e5)) + 1e-9
    assert all(b >= a for a, b in itertools.pairwise(rhos))
    assert all(b >= a for a, b in itertools.pairwise(epsilons))
    assert rhos[-1] > rhos[0] and epsilons[-1] > epsilons[0]
    for level in range(1, 7):  # a new level of the tree always costs more
        assert rhos[2**level - 1] > rhos[2**level - 2]


def test_tree_accountant_budget_state_and_mechanism_checks():
    acc = TreeAccountant(1.0, 2, delta=1e-5, target_epsilon=zcdp_epsilon(tree_rho(4, 1.0, 2), 1e-5))
    for _ in range(3):
        acc.step()
    assert not acc.exhausted and not acc.would_exceed()
    acc.step()
    assert acc.exhausted and acc.would_exceed()
    restored = TreeAccountant(1.0, None)
    restored.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert (restored.steps, restored.min_separation, restored.rho) == (4, 2, acc.rho)
    with pytest.raises(ValueError, match="--dp-min-separation 2"):
        TreeAccountant(1.0, 3).load_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match="--dp-mechanism tree"):
        PrivacyAccountant(1.0).load_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match="--dp-mechanism gaussian"):
        TreeAccountant(1.0, 2).load_state_dict(PrivacyAccountant(1.0).state_dict())


def test_the_gaussian_mechanism_reports_its_unamplified_rho():
    acc = PrivacyAccountant(noise_multiplier=2.0)
    assert acc.rho == 0.0
    for _ in range(10):
        acc.step(100, 10)
    assert acc.rho == 10 / 8.0
    # The RDP epsilon counts the sampling, which zCDP cannot: it is below rho's conversion.
    assert acc.epsilon < zcdp_epsilon(acc.rho, acc.delta)


# --------------------------------------------------------------------------- participation


def test_eligible_phones_trained_at_least_b_rounds_ago():
    last = {"a": 5, "b": 3, "c": 1}
    assert eligible(["a", "b", "c", "d"], last, r=6, b=3) == ["b", "c", "d"]
    assert eligible(["a", "b", "c", "d"], last, r=6, b=1) == ["a", "b", "c", "d"]
    assert separation_problem(200, 20, 10) is None
    assert "b <= 10" in (separation_problem(200, 20, 11) or "")


def test_settings_refuse_what_the_tree_cannot_cover_in_one_line():
    with pytest.raises(ValidationError, match="add --dp-clip"):
        Settings(dp_mechanism="tree")
    with pytest.raises(ValidationError, match="drop --dp-sampling poisson"):
        Settings(dp_mechanism="tree", dp_clip=1.0, dp_sampling="poisson")
    with pytest.raises(ValidationError, match="add --dp-mechanism tree"):
        Settings(dp_clip=1.0, dp_min_separation=3)
    with pytest.raises(ValidationError, match="AdaFL"):
        Settings(dp_mechanism="tree", dp_clip=1.0, adafl=True)
    s = Settings(dp_mechanism="tree", dp_clip=1.0, dp_min_separation=4)
    assert s.privacy_config() == PrivacyConfig(clip_norm=1.0, mechanism="tree", min_separation=4)


# --------------------------------------------------------------------------- the round engine


def make_fed(tmp_path, privacy: PrivacyConfig, phones: int = 12, fraction: float = 0.25):
    from fedkey.testing.federation import tiny_federation

    config = FederationConfig(fraction=fraction, rounds=50, seed=3, privacy=privacy)
    return tiny_federation(tmp_path, config, phones)


def fixed_delta(key: str, shape: torch.Size, round_idx: int, device: str) -> torch.Tensor:
    """A phone's delta for a round, independent of the model (norm well under the clip)."""
    gen = torch.Generator().manual_seed(hash((key, round_idx, device)) % 2**31)
    return 1e-3 * torch.randn(shape, generator=gen)


def run_round(fed, rounds_deltas: dict | None = None) -> tuple[dict, list[str]]:
    from fedkey.federation.strategies import ClientUpdate

    plan = fed.plan_round(sorted(fed.strategy.client_sizes))
    updates = []
    for d in plan.cohort:
        state = {
            k: v + fixed_delta(k, v.shape, plan.round, d) if v.is_floating_point() else v
            for k, v in fed.global_state.items()
        }
        updates.append(ClientUpdate(state, 10, 1.0, d))
    if rounds_deltas is not None:  # FedAvg's step g_t: the mean of the (unclipped) deltas
        rounds_deltas[plan.round] = {
            k: torch.stack([fixed_delta(k, v.shape, plan.round, d) for d in plan.cohort]).mean(0)
            for k, v in fed.global_state.items()
            if v.is_floating_point()
        }
    return fed.complete_round(plan, updates), plan.cohort


# One secret for both runs compared: their cohorts are drawn alike (fedkey.federation.privacy.secret).
DP = PrivacyConfig(clip_norm=1.0, noise_multiplier=0.0, secret="same cohorts")


def test_without_noise_the_tree_is_fedavg_bit_for_bit(tmp_path):
    """z = 0, b = 1: the same cohorts (the uniform draw) and the same model each round as the
    gaussian mechanism's with z = 0, and that model is theta_0 + the prefix sum of the steps."""
    tree = make_fed(tmp_path / "tree", replace(DP, mechanism="tree", min_separation=1))
    plain = make_fed(tmp_path / "plain", DP)
    theta0 = dict(tree.global_state)
    steps: dict = {}
    for _ in range(5):
        _, cohort_tree = run_round(tree, steps)
        _, cohort_plain = run_round(plain)
        assert cohort_tree == cohort_plain
        for k, v in plain.global_state.items():
            assert torch.equal(tree.global_state[k], v), k
    for k, v in tree.global_state.items():
        if v.is_floating_point():
            prefix = sum(steps[t][k] for t in steps)
            assert torch.allclose(v, theta0[k] + prefix, atol=1e-6), k


def test_the_model_is_theta0_plus_the_noisy_prefix_sum(tmp_path):
    """FTRL: theta_t = theta_0 + s_t + n_t, n_t the tree's noise of release t (Kairouz et al.
    2021, Algorithm 1, lambda = 1)."""
    fed = make_fed(tmp_path, PrivacyConfig(clip_norm=1.0, noise_multiplier=0.5, mechanism="tree"))
    theta0 = dict(fed.global_state)
    steps: dict = {}
    for t in range(1, 7):
        row, _ = run_round(fed, steps)
        mechanism = fed.privacy.mechanism
        assert isinstance(mechanism, TreeMechanism)
        noise = mechanism.noise.prefix_noise(theta0)
        for k in noise:
            expected = theta0[k].double() + sum(steps[s][k] for s in steps).double() + noise[k]
            assert torch.allclose(fed.global_state[k].double(), expected, atol=1e-5), (t, k)
        dp = row["info"]["dp"]
        assert dp["tree_nodes"] == bin(t).count("1") and dp["mechanism"] == "tree"
        assert dp["release_noise_std"] == pytest.approx(mechanism.noise.release_std())


def test_selection_keeps_every_phone_b_rounds_apart_and_rows_say_so(tmp_path):
    fed = make_fed(
        tmp_path, PrivacyConfig(clip_norm=1.0, mechanism="tree", min_separation=4), phones=13
    )
    rows = [fed.start()]
    last: dict[str, int] = {}
    for r in range(1, 21):
        row, cohort = run_round(fed)
        rows.append(row)
        assert len(cohort) == 3  # m = round(0.25 * 13); 13 - 3 * 3 = 4 phones still eligible
        for d in cohort:
            assert r - last.get(d, -100) >= 4, (d, r)
            last[d] = r
    for row in rows:
        assert row["info"]["dp"]["min_separation"] == 4
        assert math.isfinite(row["epsilon"]) and math.isfinite(row["rho"])
    assert rows[0]["rho"] == 0.0 and rows[-1]["rho"] == tree_rho(20, 1.0, 4)
    assert rows[-1]["info"]["dp"]["max_participations"] == 5


def test_the_default_separation_is_the_largest_the_population_allows(tmp_path):
    fed = make_fed(tmp_path, PrivacyConfig(clip_norm=1.0, mechanism="tree"), phones=12)
    assert fed.privacy.accountant.min_separation == 4  # 12 phones, cohorts of 3
    with pytest.raises(ValueError, match="--dp-min-separation 5: 12 phones"):
        make_fed(tmp_path, PrivacyConfig(clip_norm=1.0, mechanism="tree", min_separation=5))


def share_secret(*run_dirs: Path) -> None:
    """One fresh secret in each run directory, as a resumed run finds its own (fedkey.federation.privacy.secret):
    a run straight through and a resumed one then draw the same noise."""
    key = secrets.token_bytes(32)
    for run_dir in run_dirs:
        write_secret(run_dir / SECRET_FILE, key)


def test_a_resumed_run_gives_the_same_weights(tmp_path):
    privacy = PrivacyConfig(clip_norm=1.0, noise_multiplier=0.7, mechanism="tree")
    share_secret(tmp_path / "straight", tmp_path / "resumed")
    straight = make_fed(tmp_path / "straight", privacy)
    straight.start()
    for _ in range(5):
        run_round(straight)
    first = make_fed(tmp_path / "resumed", privacy)
    first.start()
    for _ in range(3):
        run_round(first)
    resumed = make_fed(tmp_path / "resumed", privacy)
    assert resumed.resume() and resumed.round == 3
    rows = []
    for _ in range(2):
        rows.append(run_round(resumed))
    for k, v in straight.global_state.items():
        assert torch.equal(resumed.global_state[k], v), k
    assert rows[-1][0]["rho"] == straight.privacy.accountant.rho
    # A gaussian run cannot continue as a tree run (nor the other way).
    with pytest.raises(ValueError, match="--dp-mechanism tree"):
        make_fed(tmp_path / "resumed", replace(privacy, mechanism="gaussian")).resume()


def test_a_dp_run_resumes_only_with_its_own_secret(tmp_path):
    """The secret is made 0600 when the run first draws; a resume without it, or with another
    (a passphrase, a replaced file), is refused in one line, and a fresh start makes a new one."""
    privacy = PrivacyConfig(clip_norm=1.0, noise_multiplier=0.7, mechanism="tree")
    fed = make_fed(tmp_path, privacy)
    fed.start()
    run_round(fed)
    path = tmp_path / SECRET_FILE
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_bytes()) == 32
    with pytest.raises(ValueError, match="drawn with another secret"):
        make_fed(tmp_path, replace(privacy, secret="a guess")).resume()
    key = path.read_bytes()
    path.unlink()
    with pytest.raises(ValueError, match="secret.key is missing"):
        make_fed(tmp_path, privacy).resume()
    write_secret(path, key)
    assert make_fed(tmp_path, privacy).resume()
    RunStorage(tmp_path).reset()
    assert not path.exists()  # a fresh run in the directory draws with a new secret
