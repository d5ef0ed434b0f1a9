"""The round's noise mechanism: one interface, one class per mechanism (as pfl-research's
pfl/privacy has one class per mechanism behind its PrivacyMechanism base).

    NoiseMechanism       what a round's DP is, whichever the mechanism:
        observe(N)           what the population fixes (the default delta; DP-FTRL's b)
        selection_rng, cohort  how the round's cohort is drawn where the analysis decides it
        add_noise(...)       the noise on the round's aggregate, and its accounting
        retune()             adaptive clipping fixed sigma_b: the aggregate's noise is z_u
        start_info, row_fields, would_exceed   what the rows report; the budget stop
        planned_epsilon(T, N)  epsilon after T planned rounds (the budget's calibration)
        state_dict, load_state_dict            the server state's "accountant", "secret", ...
    NoPrivacy            without DP (no --dp-clip): every call a no-op
    AccountedMechanism   what every DP mechanism shares: the secret, the accountant, the clip

The DP mechanisms are fedkey.federation.privacy.dp_fedavg.GaussianMechanism (DP-FedAvg, McMahan
et al. 2018, with the RDP accountant of fedkey.federation.privacy.gaussian) and
fedkey.federation.privacy.ftrl's TreeMechanism (Kairouz et al. 2021) and BLTMechanism
(Dvijotham et al. 2024); fedkey.federation.privacy.round.MECHANISMS maps --dp-mechanism to them.
Their noise and, where the analysis samples, their cohorts are drawn from the server's secret
(fedkey.federation.privacy.secret), keyed by round, so a resumed run draws the same.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from fedkey.federation.config import FederationConfig
from fedkey.federation.influence.bounding import ClippedRound
from fedkey.federation.privacy.clipping import ClipRule
from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.strategies import ClientUpdate, Strategy

if TYPE_CHECKING:
    from fedkey.federation.plan import RoundPlan

StateDict = dict[str, torch.Tensor]

#: Float32 models: the clip and the cast round, which moved the tight example of
#: tests/federation/strategies/test_sensitivity.py up to 6e-5 past Delta at S = 0.01; every
#: mechanism's noise is z times the sensitivity times this margin.
FLOAT32_MARGIN = 1 + 1e-4


def plan_population(plan: RoundPlan, strategy: Strategy) -> int:
    """The N the round's cohort was drawn from (simulate's plans: its whole population)."""
    return plan.population or len(strategy.client_sizes)


class Accountant(Protocol):
    """What RoundPrivacy reads of an accountant (fedkey.federation.privacy.gaussian's
    PrivacyAccountant, fedkey.federation.privacy.tree's TreeAccountant, the BLT's)."""

    @property
    def epsilon(self) -> float: ...
    @property
    def rho(self) -> float: ...
    @property
    def delta(self) -> float | None: ...
    def observe(self, population: int) -> None: ...
    def delta_for(self, population: int = 0) -> float | None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, d: Mapping[str, Any]) -> None: ...


class NoiseMechanism(ABC):
    """The round's noise mechanism (see the module's docstring); one is chosen per run."""

    #: --dp-mechanism's name (None: no DP).
    name: ClassVar[str | None]
    accountant: Accountant | None

    @abstractmethod
    def observe(self, population: int, check: bool = False) -> None:
        """A population the run draws from (> 0); with `check` (known from the start), refuse
        in one line a rule it cannot meet."""

    @abstractmethod
    def selection_rng(self, r: int, attempt: int = 0) -> np.random.Generator | None:
        """The generator of round r's cohort under DP (keyed by the secret), or None."""

    @abstractmethod
    def cohort(self, r: int, available: list[str], rng: np.random.Generator) -> list[str] | None:
        """Round r's cohort where DP's analysis decides how it is drawn, else None."""

    @abstractmethod
    def add_noise(
        self,
        plan: RoundPlan,
        updates: list[ClientUpdate],
        new_state: StateDict,
        bounded: ClippedRound,
        global_state: StateDict,
    ) -> tuple[StateDict, dict | None]:
        """The aggregate with the round's noise, accounted for, and the row's ``info.dp`` (None
        without DP)."""

    @abstractmethod
    def retune(self) -> None:
        """Adaptive clipping fixed sigma_b: what the mechanism keeps of z_u."""

    @abstractmethod
    def start_info(self) -> dict:
        """Round 0's ``info.dp`` of the mechanism ({}: nothing to say)."""

    @abstractmethod
    def row_fields(self) -> dict:
        """Every metrics row's epsilon, rho, delta and noise_reproducible."""

    @abstractmethod
    def would_exceed(self, population: int) -> bool:
        """Whether one more round (of the usual cohort) would pass the budget."""

    @abstractmethod
    def planned_epsilon(self, rounds: int, population: int) -> float:
        """Epsilon after `rounds` rounds (of the usual cohort of `population` phones), from
        none: what a run plans (fedkey.federation.privacy.calibrate)."""

    @abstractmethod
    def state_dict(self) -> dict:
        """The server state's part of the mechanism: "accountant" first."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Adopt the mechanism's part of a server state (the whole of it may be passed)."""


class NoPrivacy(NoiseMechanism):
    """No DP (no --dp-clip): no noise, no accountant, the strategy selects the cohorts."""

    name = None
    accountant = None

    def observe(self, population: int, check: bool = False) -> None:
        return None

    def selection_rng(self, r: int, attempt: int = 0) -> np.random.Generator | None:
        return None  # the run's seed draws the cohort, reproducibly

    def cohort(self, r: int, available: list[str], rng: np.random.Generator) -> list[str] | None:
        return None

    def add_noise(
        self,
        plan: RoundPlan,
        updates: list[ClientUpdate],
        new_state: StateDict,
        bounded: ClippedRound,
        global_state: StateDict,
    ) -> tuple[StateDict, dict | None]:
        return new_state, None

    def retune(self) -> None:
        return None

    def start_info(self) -> dict:
        return {}

    def row_fields(self) -> dict:
        return dict.fromkeys(("epsilon", "rho", "delta", "noise_reproducible"))

    def would_exceed(self, population: int) -> bool:
        return False

    def planned_epsilon(self, rounds: int, population: int) -> float:
        return 0.0

    def state_dict(self) -> dict:
        return {"accountant": None}

    def load_state_dict(self, state: dict) -> None:
        return None


class AccountedMechanism(NoiseMechanism):
    """A DP mechanism: the run's config and strategy (its fraction, population and
    sensitivity are DP's too), the secret its noise comes from, the clip rule (fixed S, or
    adaptive clipping's C_t and z_u) and an accountant, which each mechanism makes."""

    name: ClassVar[str]
    accountant: Accountant

    def __init__(
        self, config: FederationConfig, strategy: Strategy, secret: RunSecret, clip: ClipRule
    ) -> None:
        self.config = config
        self.strategy = strategy
        self.secret = secret
        self.clip = clip

    def selection_rng(self, r: int, attempt: int = 0) -> np.random.Generator | None:
        """The secret's generator of round r's cohort (its `attempt`-th draw): the accountant's
        analysis assumes nobody can predict who is drawn."""
        return self.secret.key().rng("cohort", r, attempt)

    def row_fields(self) -> dict:
        """The accountant's epsilon, rho and delta (fedkey.federation.metrics_row), and whether
        the noise is reproducible from a passphrase."""
        acc = self.accountant
        return {
            "epsilon": acc.epsilon,
            "rho": acc.rho,
            "delta": acc.delta,
            "noise_reproducible": self.secret.reproducible,
        }

    def state_dict(self) -> dict:
        """ "accountant", and "secret": the secret's fingerprint
        (fedkey.federation.privacy.secret), so that a resume with another is refused."""
        return {
            "accountant": self.accountant.state_dict(),
            "secret": self.secret.key().fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """The accountant's state, where the run has one, from the secret it was noised with."""
        if state.get("accountant"):
            self._check_secret(state.get("secret"))
            self.accountant.load_state_dict(state["accountant"])

    def _check_secret(self, fingerprint: str | None) -> None:
        """A DP run resumes only with the secret its noise was drawn from."""
        if fingerprint is None:
            raise ValueError(
                "this run's DP noise was drawn from its public seed (a fedkey without a secret): "
                "its epsilon bounds nothing; start the run again"
            )
        if not self.secret.exists():
            raise ValueError(
                "this run's DP secret is gone (secret.key is missing from the run directory): "
                "its noise cannot continue; restore the file or start the run again"
            )
        if self.secret.key().fingerprint != fingerprint:
            raise ValueError(
                "this run's DP noise was drawn with another secret: resume it with the "
                "secret.key (or the --dp-secret) it ran with"
            )
