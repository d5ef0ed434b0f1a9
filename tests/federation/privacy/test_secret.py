"""The server's secret (fedkey.federation.privacy.secret): DP's noise and sampled cohorts cannot be rebuilt from
what the server publishes, plus the code; with the secret they can, bit for bit."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedkey.federation.config import FederationConfig, PrivacyConfig
from fedkey.federation.engine import Federation
from fedkey.federation.privacy.secret import RunSecret, SecretKey, passphrase_key
from fedkey.federation.seeds import client_seed
from fedkey.federation.storage import SECRET_FILE
from fedkey.testing.federation import seeded_updates, tiny_federation

PHONES = 8
SEED = 3  # the run's seed: phones are told it, so an attacker knows it
DP = PrivacyConfig(clip_norm=0.05, noise_multiplier=2.0, delta=1e-5)


def federation(tmp_path, privacy: PrivacyConfig, fraction: float = 1.0) -> Federation:
    config = FederationConfig(fraction=fraction, rounds=5, seed=SEED, privacy=privacy)
    return tiny_federation(tmp_path, config, PHONES, size=32)


def one_round(fed: Federation) -> dict:
    fed.start()
    plan = fed.plan_round(sorted(fed.strategy.client_sizes))
    return fed.complete_round(plan, seeded_updates(fed, plan))


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].double().flatten() for k in sorted(state)])


def test_the_noise_cannot_be_rebuilt_from_what_is_published_but_can_with_the_secret(tmp_path):
    """Round 1 of a DP run, and the same round without noise: their difference is the noise.
    An attacker who has the code, the run's seed and the published noise_std regenerates it as
    fedkey once drew it (a generator seeded by (seed, round)) and as it draws it now from every
    secret it can guess from the run (its seed as the passphrase): neither is the noise. The
    run's own secret.key rebuilds it to float32's rounding, so this test can tell."""
    noisy = federation(tmp_path / "noisy", DP)
    row = one_round(noisy)
    plain = federation(tmp_path / "plain", replace(DP, noise_multiplier=0.0))
    one_round(plain)
    noise = flat(noisy.global_state) - flat(plain.global_state)
    std = row["info"]["dp"]["noise_std"]
    assert noise.std().item() == pytest.approx(std, rel=0.1)
    template = noisy.global_state

    old = torch.Generator().manual_seed(client_seed(SEED, 1, "server-noise"))
    candidates = {
        "the seed's generator": torch.cat(
            [torch.randn(template[k].shape, generator=old).double().flatten() for k in template]
        ),
        "the seed as the passphrase": flat(
            SecretKey(passphrase_key(str(SEED))).normal_state(template, "gaussian", 1)
        ),
    }
    for name, unit in candidates.items():
        left = noise - std * unit
        assert left.std().item() > 1.2 * std, name  # ~sqrt(2) std: unrelated draws

    secret = SecretKey((tmp_path / "noisy" / SECRET_FILE).read_bytes())
    rebuilt = std * flat(secret.normal_state(template, "gaussian", 1))
    assert (noise - rebuilt).abs().max().item() < 1e-5 * std * 10


def test_nothing_the_run_writes_for_others_holds_the_secret(tmp_path):
    """The checkpoint (which phones download) and the metrics hold a fingerprint at most."""
    fed = federation(tmp_path, DP)
    row = one_round(fed)
    key = (tmp_path / SECRET_FILE).read_bytes()
    published = [
        fed.public_checkpoint(),
        fed.storage.checkpoint_path(1).read_bytes(),
        (tmp_path / "metrics.jsonl").read_bytes(),
        json.dumps(row).encode(),
    ]
    for blob in published:
        assert key not in blob and key.hex().encode() not in blob
    assert row["noise_reproducible"] is False and "SecretKey(fingerprint=" in repr(
        fed.privacy.secret.key()
    )


def test_dp_cohorts_are_drawn_from_the_secret_and_plain_ones_from_the_seed(tmp_path):
    """Under DP two runs with one seed draw different cohorts (1 in 2^-16 to be equal over two
    rounds of Poisson sampling at q = 1/2), the same with one passphrase; without DP the seed
    alone fixes them."""

    def cohorts(name: str, privacy: PrivacyConfig) -> list[list[str]]:
        fed = federation(tmp_path / name, privacy, fraction=0.5)
        fed.start()
        out = []
        for _ in range(2):
            plan = fed.plan_round(sorted(fed.strategy.client_sizes))
            fed.complete_round(plan, seeded_updates(fed, plan))
            out.append(plan.cohort)
        return out

    poisson = replace(DP, sampling="poisson")
    assert cohorts("a", poisson) != cohorts("b", poisson)
    named = replace(poisson, secret="research run 7")
    assert cohorts("c", named) == cohorts("d", named)
    assert cohorts("e", PrivacyConfig()) == cohorts("f", PrivacyConfig())


def test_the_streams_are_standard_normal_keyed_and_independent():
    key = SecretKey.fresh()
    a = key.normals(200_000, "gaussian", 1)
    assert a.dtype == torch.float64 and torch.isfinite(a).all()
    assert a.mean().item() == pytest.approx(0.0, abs=0.01)
    assert a.std().item() == pytest.approx(1.0, rel=0.01)
    assert torch.equal(a, key.normals(200_000, "gaussian", 1))  # a resumed run draws the same
    b = key.normals(200_000, "gaussian", 2)
    assert abs(float(np.corrcoef(a.numpy(), b.numpy())[0, 1])) < 0.02
    other = SecretKey.fresh().normals(200_000, "gaussian", 1)
    assert not torch.equal(a, other)
    template = {"b": torch.zeros(3), "a": torch.zeros(2, 2), "step": torch.tensor(1)}
    state = key.normal_state(template, "x")
    assert set(state) == {"a", "b"} and state["a"].shape == (2, 2)
    reordered = key.normal_state(dict(reversed(template.items())), "x")
    assert all(torch.equal(state[k], reordered[k]) for k in state)  # not the dict's order


def test_a_passphrase_is_reproducible_and_a_run_directory_keeps_its_secret(tmp_path):
    assert (
        RunSecret(passphrase="p").key().fingerprint == RunSecret(passphrase="p").key().fingerprint
    )
    assert RunSecret(passphrase="p").reproducible and not RunSecret(tmp_path).reproducible
    first = RunSecret(tmp_path).key()
    assert (tmp_path / SECRET_FILE).stat().st_mode & 0o777 == 0o600
    assert RunSecret(tmp_path).key().fingerprint == first.fingerprint
    assert RunSecret().key().fingerprint != RunSecret().key().fingerprint
    (tmp_path / SECRET_FILE).write_bytes(b"short")
    with pytest.raises(ValueError, match="is not a DP secret"):
        RunSecret(tmp_path).key()
