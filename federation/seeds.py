"""The run's seeded draws: a phone's training seed by (seed, round, name), so a run is
deterministic and can resume at any round (fedkey.federation.engine). The seed is public (phones are told
it): DP's noise never comes from it, but from the server's secret (fedkey.federation.privacy.secret)."""

from __future__ import annotations

import numpy as np


def client_seed(seed: int, round_idx: int, device_id: str) -> int:
    """A device's training seed for a round: independent of which process trains it."""
    ss = np.random.SeedSequence([seed, round_idx, *device_id.encode()])
    return int(ss.generate_state(1)[0])
