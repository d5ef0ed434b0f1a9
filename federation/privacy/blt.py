"""DP-FTRL with BLT noise: the matrix mechanism of a Buffered Linear Toeplitz factorization.

``--dp-mechanism blt`` selects it; ``tree`` (fedkey.federation.privacy.tree) is the tree aggregation it replaces,
``gaussian`` (fedkey.federation.privacy.gaussian) DP-FedAvg. Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024,
"Efficient and Near-Optimal Noise Generation for Streaming Differential Privacy" (FOCS) defines
the BLT; McMahan, Xu, Zhang 2024, "A Hassle-free Algorithm for Private Learning in Practice:
Don't Use Tree Aggregation, Use BLTs" (EMNLP Industry; arXiv 2408.08868) runs it in federated
training under min-separation participation, as here.

The factorization
-----------------
The strategy C is the n x n lower-triangular Toeplitz matrix with ``C[t, s] = c_{t - s}``,

    c_0 = 1,   c_i = sum_j omega_j theta_j^(i - 1)   (i >= 1),

d buffers with decays theta_j and output scales omega_j (:class:`BLT`). They are optimized
offline for a run of n rounds at separation b (tools/blt_params.py: jax-privacy's
``buffered_toeplitz.optimize``, the largest per-round variance of the noisy prefix sums at unit
sensitivity) and shipped in federation/privacy/blt_params.json; the core install needs no jax.

The mechanism (Denisov, McMahan, Rush, Smith, Thakurta 2022, "Improved Differential Privacy for
SGD via Optimal Private Linear Operators on Adaptive Streams", Section 2)
---------------------------------------------------------------------------------------------
Round t's clipped aggregate is the strategy's step ``g_t = A_t - theta_{t-1}`` (as for the tree,
fedkey.federation.privacy.tree), with ``Delta_t`` the replace-one L2 sensitivity the strategy declares for it.
Scale each step to unit sensitivity, ``y_t = g_t / Delta_t``, and release ``C Y + z W`` (W
i.i.d. N(0, 1) per coordinate, z the noise multiplier). Multiplying by ``C^{-1}`` and by
``Delta_t`` is post-processing, and gives the noisy steps

    ~g_t = g_t + z Delta_t x_t,    x = C^{-1} W,

so ``theta_t = theta_{t-1} + ~g_t = theta_0 + s_t + n_t`` with ``n_t = z sum_{s <= t} Delta_s
x_s``: FTRL on the noisy prefix sums, as the tree applies it, and with z = 0 bit for bit the
gaussian mechanism's model at zero noise. ``x_t`` streams with the d buffers of C (McMahan, Xu,
Zhang 2024, Algorithm 3): ``x_t = w_t - sum_j omega_j S_j``, then ``S_j <- theta_j S_j + x_t``
(:class:`BLTNoise`), so the server holds d copies of the model's floating entries (float64).
``w_t`` is drawn from the server's secret stream for t (fedkey.federation.privacy.secret), so a restarted
server regenerates the buffers by replaying the draws (:meth:`BLTNoise.state_dict`
keeps only the rounds' ``Delta_t``).

The participation rule and the accounting
-----------------------------------------
The rule is the tree's (fedkey.federation.privacy.tree.eligible, ``--dp-min-separation b``): phones are not
sampled, each round's cohort is drawn from the available phones that did not train in the last
``b - 1`` rounds, so phone i's rounds P are b-separated, at most ``k = ceil(T / b)`` of them.

Derivation. Replacing phone i's data changes ``y_t`` by ``u_t`` with ``||u_t|| <= 1`` for t in P
and by nothing elsewhere (given the same earlier releases: ``Delta_t`` and round t's cohort
depend only on them). ``C Y`` moves by ``sum_{t in P} C[:, t] u_t^T``, whose squared Frobenius
norm is ``sum_{s, t in P} (C^T C)_{st} <u_s, u_t> <= sum_{s, t in P} (C^T C)_{st} = ||C 1_P||^2``
(C >= 0 entrywise, so ``C^T C >= 0``). Under adaptively chosen inputs a lower-triangular C's
Gaussian mechanism is as private as on fixed ones (Denisov et al. 2022, Theorem 2.1), so the
releases of the first T rounds, which involve only ``C_T = C[:T, :T]``, are

    rho_T = sens_b(C_T)^2 / (2 z^2)-zCDP,   sens_b(C_T) = max_P ||C_T 1_P||

(Bun and Steinke 2016, Prop. 1.6). For Toeplitz coefficients that are non-negative and
non-increasing (checked when the table is read) the maximum is attained at ``P = {1, 1 + b, ...,
1 + (k - 1) b}`` (Kalinin and Lampert 2024, "Banded Square Root Matrix Factorization for
Differentially Private Model Training", Theorem 2; jax-privacy's
``toeplitz.minsep_sensitivity_squared``), which :func:`minsep_sensitivity` evaluates and
tests/federation/privacy/test_blt.py checks against every b-separated P for small T. With b >= T (one
participation) it is C's largest column norm, ``||c_{0..T-1}||``. Epsilon is the conversion of
rho (fedkey.federation.privacy.tree.zcdp_epsilon); adaptive clipping's counts add
``fedkey.federation.privacy.tree.count_rho`` as for the tree (fedkey.federation.privacy.adaptive_clip's derivation holds with
``sens_b(C_T)^2 >= k``: C's diagonal is 1 and its entries non-negative).

Which factorization a run uses (:func:`select_blt`): the shipped entry of the fewest rounds n >=
the run's, then the largest separation <= min(b, n). Any C is private at any b (rho is computed
for the run's own b and rounds); the entry only decides how well the noise is shaped. A run
longer than every entry is refused in one line naming the command that computes more.

What it assumes: what the tree assumes (fedkey.federation.privacy.tree): the noise's secret is secret, which phones
are available and drop out does not depend on their data, and the rule above is enforced
(fedkey.federation.privacy.ftrl.FTRLMechanism.cohort) with b fixed for the run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedkey.federation.privacy.secret import RunSecret
from fedkey.federation.privacy.tree import TreeAccountant, count_rho

StateDict = dict[str, Tensor]
#: How to add an entry to the table (the `blt` optional extra).
COMPUTE_MORE = ".venv-blt/bin/python tools/blt_params.py --rounds {n} --separations {b}"

__all__ = [
    "BLT",
    "BLTAccountant",
    "BLTNoise",
    "blt_rho",
    "load_table",
    "minsep_sensitivity",
    "rounds_problem",
    "select_blt",
]


# --------------------------------------------------------------------------- the factorization


@dataclass(frozen=True)
class BLT:
    """One shipped factorization: C's buffers, the run it was optimized for (n rounds at
    separation b) and its sensitivity there, sens_b(C_n), as jax-privacy computed it."""

    rounds: int
    min_separation: int
    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]
    sensitivity: float

    def coefs(self, t: int) -> np.ndarray:
        """C's Toeplitz coefficients ``c_0 .. c_{t-1}`` (float64)."""
        powers = np.arange(max(t - 1, 0), dtype=np.float64)[:, None]
        tail = (np.asarray(self.buf_decay) ** powers * np.asarray(self.output_scale)).sum(axis=1)
        return np.concatenate([[1.0], tail])[:t]

    def inverse_coefs(self, t: int) -> np.ndarray:
        """``C^{-1}``'s Toeplitz coefficients ``c'_0 .. c'_{t-1}`` (forward substitution)."""
        c, inv = self.coefs(t), np.zeros(t)
        for i in range(t):
            inv[i] = (1.0 if i == 0 else 0.0) - c[1 : i + 1] @ inv[:i][::-1]
        return inv

    def matrix(self, t: int) -> np.ndarray:
        """``C_t``, the leading t x t block of C."""
        c = self.coefs(t)
        idx = np.subtract.outer(np.arange(t), np.arange(t))
        return np.where(idx >= 0, c[np.clip(idx, 0, None)], 0.0)


def minsep_sensitivity(coefs: np.ndarray, b: int) -> float:
    """``sens_b(C_T) = ||C_T 1_P||`` at ``P = {0, b, 2b, ...}`` for C_T's coefficients ``coefs``
    (T of them): the worst b-separated participation when they are non-negative and
    non-increasing (the module's derivation), which this checks."""
    if b < 1:
        raise ValueError(f"the minimum separation must be >= 1, got {b}")
    if np.any(coefs < 0) or np.any(np.diff(coefs) > 0):
        raise ValueError("the BLT's Toeplitz coefficients must be non-negative and non-increasing")
    total = np.zeros(len(coefs))
    for start in range(0, len(coefs), b):
        total[start:] += coefs[: len(coefs) - start]
    return math.sqrt(float(total @ total))


@lru_cache(maxsize=1)
def load_table() -> tuple[BLT, ...]:
    """The factorizations fedkey ships (federation/privacy/blt_params.json), each checked usable."""
    text = resources.files("fedkey.federation.privacy").joinpath("blt_params.json").read_text()
    table = tuple(
        BLT(
            rounds=int(e["rounds"]),
            min_separation=int(e["min_separation"]),
            buf_decay=tuple(float(x) for x in e["buf_decay"]),
            output_scale=tuple(float(x) for x in e["output_scale"]),
            sensitivity=float(e["sensitivity"]),
        )
        for e in json.loads(text)["entries"]
    )
    for blt in table:
        minsep_sensitivity(blt.coefs(blt.rounds), blt.min_separation)  # raises if not monotone
    return table


def rounds_problem(rounds: int) -> str | None:
    """Why no shipped factorization covers a run of `rounds` rounds (None: one does)."""
    longest = max(blt.rounds for blt in load_table())
    if rounds <= longest:
        return None
    return (
        f"--dp-mechanism blt ships factorizations for runs of up to {longest} rounds: use "
        f"--rounds {longest} or fewer, or compute one with `pip install 'fedkey[blt]'` and "
        f"`{COMPUTE_MORE.format(n=rounds, b='B')}`"
    )


def select_blt(rounds: int, b: int) -> BLT:
    """The factorization of a run of `rounds` rounds at separation b: the entry of the fewest
    rounds n >= `rounds`, then of the largest separation <= min(b, n)."""
    fits = [e for e in load_table() if e.rounds >= rounds and e.min_separation <= min(b, e.rounds)]
    if not fits:
        problem = rounds_problem(rounds) or (
            f"--dp-mechanism blt has no factorization for {rounds} rounds at separation {b}: "
            f"compute one with `{COMPUTE_MORE.format(n=rounds, b=b)}`"
        )
        raise ValueError(problem)
    return min(fits, key=lambda e: (e.rounds, -e.min_separation))


def find_blt(rounds: int, b: int) -> BLT:
    """The shipped entry optimized for exactly n = `rounds` at separation b (a resumed run's)."""
    for blt in load_table():
        if (blt.rounds, blt.min_separation) == (rounds, b):
            return blt
    raise ValueError(
        f"this run was noised with the BLT for {rounds} rounds at separation {b}, which this "
        f"install does not ship: compute it with `{COMPUTE_MORE.format(n=rounds, b=b)}`"
    )


def blt_rho(rounds: int, noise_multiplier: float, b: int, blt: BLT) -> float:
    """rho-zCDP of the first `rounds` releases of `blt` at noise multiplier z, separation b."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return minsep_sensitivity(blt.coefs(rounds), b) ** 2 / (2 * noise_multiplier**2)


# --------------------------------------------------------------------------- the noise


def unit_draw(template: Mapping[str, Tensor], secret: RunSecret, t: int) -> StateDict:
    """``w_t``: N(0, 1) on every floating entry of `template` (float64), drawn from the secret's
    stream for round t (fedkey.federation.privacy.secret)."""
    return secret.key().normal_state(template, "blt", t)


class BLTNoise:
    """The streaming ``x = C^{-1} W`` of the BLT mechanism and each round's noise.

    ``release(template, sensitivity)`` opens round t with its ``Delta_t`` and returns ``z Delta_t
    x_t`` (None with noise multiplier 0), what the engine adds to the round's aggregate. The
    buffers ``S_j`` hold unit-scale sums (z and Delta_t multiply the output only), so they are a
    function of the secret and t alone: a restored state replays the t draws to rebuild them.
    """

    def __init__(self, secret: RunSecret, noise_multiplier: float, blt: BLT | None = None) -> None:
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        self.secret = secret
        self.noise_multiplier = float(noise_multiplier)
        self.blt = blt  # fixed with the run's b (fedkey.federation.privacy.ftrl)
        self.sensitivities: list[float] = []  # Delta_t of rounds 1..t
        self._buffers: StateDict | None = None  # key -> (d, *shape), after self._stepped rounds
        self._stepped = 0

    @property
    def rounds(self) -> int:
        """Rounds released so far."""
        return len(self.sensitivities)

    def _blt(self) -> BLT:
        if self.blt is None:
            raise RuntimeError("the BLT is fixed with the run's minimum separation")
        return self.blt

    def _step(self, template: Mapping[str, Tensor]) -> StateDict:
        """``x_t`` for the next t, the buffers updated (McMahan, Xu, Zhang 2024, Algorithm 3)."""
        blt = self._blt()
        theta = torch.tensor(blt.buf_decay, dtype=torch.float64)
        omega = torch.tensor(blt.output_scale, dtype=torch.float64)
        w = unit_draw(template, self.secret, self._stepped + 1)
        if self._buffers is None:
            self._buffers = {
                k: torch.zeros((len(theta), *v.shape), dtype=v.dtype) for k, v in w.items()
            }
        out: StateDict = {}
        for key, draw in w.items():
            buf = self._buffers[key]
            x = draw - torch.tensordot(omega, buf, dims=1)
            buf.mul_(theta.view(-1, *([1] * draw.dim()))).add_(x)
            out[key] = x
        self._stepped += 1
        return out

    def _catch_up(self, template: Mapping[str, Tensor]) -> None:
        """Rebuild the buffers of a restored state: replay the draws of the rounds before."""
        while self._stepped < self.rounds - 1:
            self._step(template)

    def release(self, template: Mapping[str, Tensor], sensitivity: float) -> StateDict | None:
        """Open the next round with its sensitivity ``Delta_t``; ``z Delta_t x_t`` (float64, the
        floating keys of `template`), or None when the noise multiplier is 0."""
        if not sensitivity >= 0 or math.isinf(sensitivity):
            raise ValueError(f"a round's sensitivity must be finite and >= 0, got {sensitivity}")
        self.sensitivities.append(float(sensitivity))
        if self.noise_multiplier == 0:
            return None
        self._catch_up(template)
        scale = self.noise_multiplier * sensitivity
        return {k: x.mul_(scale) for k, x in self._step(template).items()}

    def prefix_noise(self, template: Mapping[str, Tensor]) -> StateDict:
        """``n_t = z sum_{s <= t} Delta_s x_s``, the noise in the model after the rounds so far,
        recomputed from the secret (float64)."""
        fresh = BLTNoise(self.secret, self.noise_multiplier, self.blt)
        total: StateDict = {}
        for sens in self.sensitivities:
            for key, x in (fresh.release(template, sens) or {}).items():
                total[key] = total[key].add_(x) if key in total else x
        return total

    def release_std(self) -> float:
        """The per-coordinate standard deviation of ``n_t``: ``z ||(A D C^{-1})[t, :]||`` with A
        the prefix sums and D the rounds' ``Delta``s."""
        t = self.rounds
        if t == 0:
            return 0.0
        inv = self._blt().inverse_coefs(t)
        sens = np.asarray(self.sensitivities)
        # row t of A D C^{-1}: entry u sums Delta_s c'_{s - u} over u <= s <= t
        weights = [float(sens[u:] @ inv[: t - u]) for u in range(t)]
        return self.noise_multiplier * math.sqrt(sum(w * w for w in weights))

    def state_dict(self) -> dict[str, Any]:
        return {"sensitivities": list(self.sensitivities)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.sensitivities = [float(x) for x in d.get("sensitivities", [])]
        self._buffers, self._stepped = None, 0


# --------------------------------------------------------------------------- accounting


class BLTAccountant(TreeAccountant):
    """The privacy spent by the BLT mechanism: the tree's accountant (fedkey.federation.privacy.tree: the
    interface, b fixed by the population, the budget stop) with rho of the module's derivation.

    ``rounds`` is the run's planned length, which picks the factorization (:func:`select_blt`)
    once b is known; a resumed run keeps the one it was noised with."""

    mechanism = "blt"

    def __init__(
        self,
        noise_multiplier: float,
        min_separation: int | None,
        rounds: int,
        delta: float | None = 1e-5,
        target_epsilon: float | None = None,
        count_stddev: float | None = None,
    ) -> None:
        super().__init__(noise_multiplier, min_separation, delta, target_epsilon, count_stddev)
        problem = rounds_problem(rounds)
        if problem is not None:
            raise ValueError(problem)
        self.rounds = rounds
        self._entry: BLT | None = None

    @property
    def blt(self) -> BLT:
        """The run's factorization (b must be known)."""
        if self._entry is None:
            self._entry = select_blt(self.rounds, self._b())
        return self._entry

    def rho_after(self, rounds: int) -> float:
        if not rounds:
            return 0.0
        rho = blt_rho(rounds, self.noise_multiplier, self._b(), self.blt)
        if self.count_stddev is not None:
            rho += count_rho(rounds, self.count_stddev, self._b())
        return rho

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.min_separation is not None:
            state["blt"] = {"rounds": self.blt.rounds, "min_separation": self.blt.min_separation}
        return state

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """The tree's (the releases, b), and the factorization the run was noised with."""
        super().load_state_dict(d)
        entry = d.get("blt")
        if entry is not None:
            self._entry = find_blt(int(entry["rounds"]), int(entry["min_separation"]))
