"""DP-FTRL: tree-aggregated noise on the running sum of the rounds' aggregates, no sampling.

What production keyboards train with (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu 2021,
"Practical and Private (Deep) Learning without Sampling or Shuffling", ICML; Xu et al. 2023,
"Federated Learning of Gboard Language Models with Differential Privacy"). ``--dp-mechanism
tree`` selects it; ``gaussian`` (fedkey.federation.privacy.gaussian) stays DP-FedAvg.

The model (FTRL)
----------------
Round t's clipped aggregate is the strategy's step ``g_t = A_t - theta_{t-1}`` (A_t: what the
strategy aggregates from the bounded updates; FedAvg's is the mean of the clipped deltas). The
server keeps the prefix sum ``s_t = g_1 + ... + g_t`` and releases it noised, ``~s_t = s_t +
n_t``, through the tree below. Kairouz et al.'s Algorithm 1 (DP-FTRL) takes

    theta_t = argmin_theta <-~s_t, theta> + (lambda / 2) ||theta - theta_0||^2
            = theta_0 + ~s_t / lambda,

with the pseudo-gradient ``-g_t`` as their gradient and ``lambda = 1``: FedAvg's step of server
learning rate 1, whose noiseless iterates ``theta_0 + s_t`` are exactly plain FedAvg's. The
engine applies it incrementally, ``theta_t = theta_{t-1} + g_t + (n_t - n_{t-1})``, as
TensorFlow Federated's tree "residual" query does: the nodes the two releases share cancel, so
only the nodes in one decomposition and not the other are drawn (:func:`residual_nodes`), and
with zero noise the model is bit for bit the one the gaussian mechanism with zero noise gives.
A server optimizer (``--server-opt``) steps on the released increments ``~s_t - ~s_{t-1}``:
post-processing of the releases, so the guarantee is the same (with momentum, the heavy-ball
form of the paper's DP-FTRLM).

The tree (Kairouz et al. 2021, Section 4 and Appendix D; Dwork et al. 2010, Chan et al. 2011)
---------------------------------------------------------------------------------------------
Node ``(l, j)`` covers the rounds ``j 2^l + 1 .. (j + 1) 2^l`` and carries ``N(0, sigma_v^2)``
per coordinate, drawn once from the server's secret stream for (l, j) (fedkey.federation.privacy.secret); ``~s_t`` sums the nodes of the dyadic decomposition of ``[1, t]`` (:func:`prefix_nodes`:
one node per set bit of t, at most ``floor(log2 t) + 1``), so ``Var n_t = sum_v sigma_v^2``
(popcount(t) sigma^2 at a constant sigma). ``sigma_v = z max_{t in v} Delta_t``, where
``Delta_t`` is the replace-one L2 sensitivity the strategy declares for round t's aggregate
(fedkey.federation.strategies.sensitivity): every node's noise is at least z times the sensitivity of
each of its rounds. Regenerating nodes from the secret makes the tree restartable: a resumed run
needs only the secret and the rounds' ``Delta_t`` (:meth:`TreeNoise.state_dict`).

The participation rule and the accounting
-----------------------------------------
Phones are not sampled: each round takes its cohort from the available phones that did not
train in the last ``b - 1`` rounds (``--dp-min-separation b``): two participations of one phone
are at least b rounds apart, so in T rounds a phone trains at most ``k = ceil(T / b)`` times.

Derivation. Let phone i train in rounds P (gaps >= b), and replace its data (replace-one, as
the strategies' ``Delta_t``). Release the nodes in the order they complete; a round's aggregate
depends only on earlier releases, so node v is a Gaussian mechanism on ``sum_{t in v} g_t``,
whose two values (i's data or the replacement, same earlier releases) differ by at most
``n_v max_{t in v} Delta_t`` with ``n_v = |P cap v|``; its noise is ``z max Delta_t``, so it is
``n_v^2 / (2 z^2)``-zCDP. Adaptive composition (Bun and Steinke 2016, Lemma 2.3) over the nodes
complete by T gives

    rho_T = (1 / (2 z^2)) max_P sum_v n_v^2,

and every release ``~s_t`` (t <= T) is post-processing of those nodes. Bound the max level by
level (:func:`worst_case_square_sum`): the complete level-l nodes tile the first ``L_l = 2^l
floor(T / 2^l)`` rounds; b-separated rounds in any L consecutive rounds number at most
``ceil(L / b)``, so ``n_v <= c_l = min(K_l, ceil(2^l / b))`` with ``sum_v n_v <= K_l = ceil(L_l /
b)``; a sum of squares under these caps is largest with the counts packed,
``F(K, c) = floor(K / c) c^2 + (K mod c)^2``. Hence

    rho_T <= sum_{l=0}^{floor(log2 T)} F(K_l, c_l) / (2 z^2).

With ``b >= T`` (one participation) it is ``(floor(log2 T) + 1) / (2 z^2) = ceil(log2(T + 1)) /
(2 z^2)``, dp_accounting's SingleEpochTreeAggregationDpEvent; with b = 2, T = 4 it is
``(2 + 2 + 4) / (2 z^2)``, which the rounds {1, 3} reach. (Kairouz et al.'s Appendix D computes
the max over P exactly by dynamic programming; this closed form is an upper bound, equal to it
in those cases and tested against brute force in tests/federation/privacy/test_tree.py.)

Epsilon: rho-zCDP is ``(alpha, rho alpha)``-RDP for every alpha (Bun and Steinke 2016), so
dp_accounting's RdpAccountant composes ``ZCDpEvent(rho)`` and converts it to epsilon at delta,
or ``rho + 2 sqrt(rho ln(1 / delta))`` (Bun and Steinke 2016, Prop. 1.3) where that is smaller
(:func:`zcdp_epsilon`).

With adaptive clipping (``--dp-clip-quantile``, fedkey.federation.privacy.adaptive_clip) each round also releases a
noised count of the unclipped updates: the nodes then carry ``z_u max Delta_t`` and the counts
add ``ceil(T / b) / (2 sigma_b^2)`` (:func:`count_rho`; derived in fedkey.federation.privacy.adaptive_clip), at most
what z alone costs. Delta defaults to ``1 / N^1.1`` for N phones (fedkey.federation.privacy.gaussian.PopulationDelta).

What it assumes: the noise is drawn on the server from a secret (fedkey.federation.privacy.secret); which phones are
available and which drop out do not depend on their data; the rule above is what the server
enforces (fedkey.federation.privacy.ftrl.FTRLMechanism.cohort), with ``b`` fixed for the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from dp_accounting import ZCDpEvent
from dp_accounting.rdp import RdpAccountant
from torch import Tensor

from fedkey.federation.privacy.gaussian import PopulationDelta, known_delta
from fedkey.federation.privacy.secret import RunSecret

StateDict = dict[str, Tensor]
#: A tree node (level l, index j): the rounds j 2^l + 1 .. (j + 1) 2^l (1-based).
Node = tuple[int, int]

__all__ = [
    "Node",
    "TreeAccountant",
    "TreeNoise",
    "count_rho",
    "default_separation",
    "eligible",
    "node_rounds",
    "prefix_nodes",
    "residual_nodes",
    "separation_problem",
    "tree_rho",
    "worst_case_square_sum",
    "zcdp_epsilon",
]


# --------------------------------------------------------------------------- the tree


def node_rounds(node: Node) -> range:
    """The rounds node ``(l, j)`` sums: ``j 2^l + 1 .. (j + 1) 2^l``."""
    level, index = node
    return range(index * 2**level + 1, (index + 1) * 2**level + 1)


def prefix_nodes(t: int) -> list[Node]:
    """The dyadic decomposition of the rounds ``[1, t]``: one node per set bit of t, largest
    first (Kairouz et al. 2021, Section 4). ``prefix_nodes(6) == [(2, 0), (1, 2)]``: rounds 1-4
    and 5-6."""
    if t < 0:
        raise ValueError(f"a prefix of {t} rounds")
    nodes: list[Node] = []
    start = 0
    for level in reversed(range(t.bit_length())):
        if t >> level & 1:
            nodes.append((level, start >> level))
            start += 1 << level
    return nodes


def residual_nodes(t: int) -> tuple[list[Node], list[Node]]:
    """(added, removed): ``n_t - n_{t-1}`` is the noise of ``added`` less that of ``removed``,
    the nodes of one decomposition and not the other (the shared ones cancel exactly)."""
    if t < 1:
        raise ValueError(f"round {t}: rounds are 1-based")
    now, before = prefix_nodes(t), prefix_nodes(t - 1)
    return [v for v in now if v not in before], [v for v in before if v not in now]


def node_noise(
    template: Mapping[str, Tensor], secret: RunSecret, node: Node, std: float
) -> StateDict:
    """The node's ``N(0, std^2)`` on every floating entry of ``template`` (float64), drawn from
    the secret's stream for the node (fedkey.federation.privacy.secret), so it is the same at every redraw."""
    unit = secret.key().normal_state(template, "tree", node[0], node[1])
    return {k: v.mul_(std) for k, v in unit.items()}


def _add(total: StateDict, part: Mapping[str, Tensor], sign: float = 1.0) -> None:
    for key, value in part.items():
        total[key] = value * sign if key not in total else total[key].add_(value, alpha=sign)


class TreeNoise:
    """The online tree aggregation of DP-FTRL: the noise of each release, node by node.

    ``release(template, sensitivity)`` opens the next round t with its ``Delta_t`` and returns
    ``n_t - n_{t-1}`` (None with noise multiplier 0), what the engine adds to the round's
    aggregate. Pure in the sense that matters for a restart: the noise is a function of the
    secret, the noise multiplier and the recorded ``Delta_1 .. Delta_t``, which
    :meth:`state_dict` holds.
    """

    def __init__(self, secret: RunSecret, noise_multiplier: float) -> None:
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        self.secret = secret
        self.noise_multiplier = float(noise_multiplier)
        self.sensitivities: list[float] = []  # Delta_t of rounds 1..t

    @property
    def rounds(self) -> int:
        """Rounds released so far."""
        return len(self.sensitivities)

    def node_std(self, node: Node) -> float:
        """``sigma_v = z max_{t in v} Delta_t`` (the node must be complete)."""
        rounds = node_rounds(node)
        if rounds.stop - 1 > self.rounds:
            raise ValueError(f"node {node} ends after round {self.rounds}")
        return self.noise_multiplier * max(self.sensitivities[t - 1] for t in rounds)

    def prefix_noise(self, template: Mapping[str, Tensor], t: int | None = None) -> StateDict:
        """``n_t``: the noise of the release of ``s_t`` (default: the latest), float64."""
        total: StateDict = {}
        for node in prefix_nodes(self.rounds if t is None else t):
            _add(total, node_noise(template, self.secret, node, self.node_std(node)))
        return total

    def release_std(self, t: int | None = None) -> float:
        """The per-coordinate standard deviation of ``n_t``: ``sqrt(sum_v sigma_v^2)``."""
        nodes = prefix_nodes(self.rounds if t is None else t)
        return math.sqrt(sum(self.node_std(v) ** 2 for v in nodes))

    def release(self, template: Mapping[str, Tensor], sensitivity: float) -> StateDict | None:
        """Open the next round with its sensitivity ``Delta_t``; ``n_t - n_{t-1}`` (float64, the
        floating keys of ``template``), or None when the noise multiplier is 0."""
        if not sensitivity >= 0 or math.isinf(sensitivity):
            raise ValueError(f"a round's sensitivity must be finite and >= 0, got {sensitivity}")
        self.sensitivities.append(float(sensitivity))
        if self.noise_multiplier == 0:
            return None
        added, removed = residual_nodes(self.rounds)
        total: StateDict = {}
        for nodes, sign in ((added, 1.0), (removed, -1.0)):
            for node in nodes:
                _add(total, node_noise(template, self.secret, node, self.node_std(node)), sign)
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"sensitivities": list(self.sensitivities)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.sensitivities = [float(x) for x in d.get("sensitivities", [])]


# --------------------------------------------------------------------------- participation


def default_separation(population: int, cohort: int) -> int:
    """The largest b a population of N phones allows cohorts of m: ``floor(N / m)`` (each round
    then still finds m phones that did not train in the last b - 1 rounds)."""
    return max(1, population // max(1, cohort))


def separation_problem(population: int, cohort: int, b: int) -> str | None:
    """Why N phones cannot give every round a cohort of m under separation b (None: they can).
    The last b - 1 rounds hold at most (b - 1) m phones, so b m <= N is needed."""
    if b * cohort <= population:
        return None
    return (
        f"--dp-min-separation {b}: {population} phones cannot fill cohorts of {cohort} when a "
        f"phone trains at most once every {b} rounds (b x cohort <= phones: b <= "
        f"{default_separation(population, cohort)} here, or a smaller --fraction)"
    )


def eligible(available: Sequence[str], last_round: Mapping[str, int], r: int, b: int) -> list[str]:
    """The phones of ``available`` that round r may select: those that last trained in a round
    s with ``r - s >= b`` (or never), sorted."""
    return sorted(d for d in set(available) if d not in last_round or r - last_round[d] >= b)


# --------------------------------------------------------------------------- accounting


def worst_case_square_sum(rounds: int, b: int) -> int:
    """An upper bound on ``max_P sum_v n_v^2`` over the nodes complete by ``rounds`` and the
    b-separated participation sets P (the module's derivation): ``sum_l F(K_l, c_l)``."""
    if rounds < 0 or b < 1:
        raise ValueError(f"rounds must be >= 0 and b >= 1, got {rounds}, {b}")
    total = 0
    for level in range(rounds.bit_length()):  # the levels with a complete node: 2^l <= rounds
        size = 1 << level
        covered = size * (rounds >> level)  # L_l: the rounds the complete level-l nodes tile
        k = -(-covered // b)  # K_l = ceil(L_l / b)
        c = min(k, -(-size // b))  # c_l = min(K_l, ceil(2^l / b))
        q, r = divmod(k, c)
        total += q * c * c + r * r
    return total


def tree_rho(rounds: int, noise_multiplier: float, b: int) -> float:
    """rho-zCDP of ``rounds`` releases of the tree at noise multiplier z under separation b."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return worst_case_square_sum(rounds, b) / (2 * noise_multiplier**2)


@lru_cache(maxsize=4096)
def zcdp_epsilon(rho: float, delta: float) -> float:
    """Epsilon at ``delta`` of a rho-zCDP mechanism: dp_accounting's RDP conversion of
    ``ZCDpEvent(rho)``, or Bun and Steinke's ``rho + 2 sqrt(rho ln(1 / delta))`` (2016, Prop.
    1.3) where that is smaller (a large rho, whose best RDP order lies below the accountant's
    smallest); both are valid bounds."""
    if rho == 0:
        return 0.0
    if math.isinf(rho):
        return math.inf
    acc = RdpAccountant()
    acc.compose(ZCDpEvent(rho))
    return min(float(acc.get_epsilon(delta)), rho + 2 * math.sqrt(rho * math.log(1 / delta)))


def count_rho(rounds: int, count_stddev: float, b: int) -> float:
    """rho-zCDP of adaptive clipping's noised counts (fedkey.federation.privacy.adaptive_clip) over ``rounds``
    rounds under separation b: one Gaussian of sensitivity 1 (replace-one: a phone's bit flips)
    against sigma_b per participation, at most ``ceil(rounds / b)`` of them."""
    if rounds == 0:
        return 0.0
    if count_stddev == 0:
        return math.inf
    return -(-rounds // b) / (2 * count_stddev**2)


class TreeAccountant(PopulationDelta):
    """The privacy spent by the tree mechanism so far: ``rho`` (zCDP) and ``epsilon`` at delta.

    The same interface as fedkey.federation.privacy.gaussian.PrivacyAccountant (``step``, ``epsilon``, ``exhausted``,
    ``would_exceed``, state); the population and cohort it is given are not part of the analysis
    (nothing is sampled), except that the default delta is ``1 / N^1.1`` of the largest
    population seen (fedkey.federation.privacy.gaussian.PopulationDelta). ``min_separation`` is b; the engine sets
    it once it knows the population when it was left to the default (None until then: nothing
    can be accounted). With adaptive clipping, ``noise_multiplier`` is the nodes' z_u and
    ``count_stddev`` sigma_b, whose counts add :func:`count_rho` (fedkey.federation.privacy.adaptive_clip).
    """

    #: What the state records (fedkey.federation.privacy.blt's accountant is this one with BLT's rho).
    mechanism = "tree"

    def __init__(
        self,
        noise_multiplier: float,
        min_separation: int | None,
        delta: float | None = 1e-5,
        target_epsilon: float | None = None,
        count_stddev: float | None = None,
    ) -> None:
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if min_separation is not None and min_separation < 1:
            raise ValueError(f"the minimum separation must be >= 1, got {min_separation}")
        super().__init__(delta)
        self.noise_multiplier = float(noise_multiplier)
        self.min_separation = min_separation
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.count_stddev = count_stddev
        self.steps = 0

    def _b(self) -> int:
        if self.min_separation is None:
            raise RuntimeError("the tree's minimum separation is not known yet")
        return self.min_separation

    def rho_after(self, rounds: int) -> float:
        if not rounds:
            return 0.0
        rho = tree_rho(rounds, self.noise_multiplier, self._b())
        if self.count_stddev is not None:
            rho += count_rho(rounds, self.count_stddev, self._b())
        return rho

    def step(self, population: int = 0, cohort: int = 0) -> float:
        """Account for one more release; the new epsilon."""
        self.observe(population)
        self.steps += 1
        return self.epsilon

    @property
    def rho(self) -> float:
        """rho-zCDP spent so far."""
        return self.rho_after(self.steps)

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far, at :attr:`delta`."""
        if self.steps == 0:
            return 0.0
        return zcdp_epsilon(self.rho, known_delta(self.delta))

    @property
    def exhausted(self) -> bool:
        return self.target_epsilon is not None and self.epsilon >= self.target_epsilon

    def planned_epsilon(self, rounds: int, population: int = 0) -> float:
        """Epsilon at the delta of ``population`` phones after ``rounds`` releases, from none:
        what a run plans (fedkey.federation.privacy.calibrate; b must be known)."""
        return zcdp_epsilon(self.rho_after(rounds), known_delta(self.delta_for(population)))

    def would_exceed(self, population: int = 0, cohort: int = 0) -> bool:
        """Whether one more release would take epsilon past ``target_epsilon``."""
        if self.target_epsilon is None:
            return False
        delta = known_delta(self.delta_for(population))
        return zcdp_epsilon(self.rho_after(self.steps + 1), delta) > self.target_epsilon

    def state_dict(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism,
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "count_stddev": self.count_stddev,
            "min_separation": self.min_separation,
            **self._delta_state(),
            "target_epsilon": self.target_epsilon,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore the releases spent and the run's b (the rest stays as constructed)."""
        stored = d.get("mechanism") or "gaussian"
        if stored != self.mechanism:
            raise ValueError(
                f"this run was accounted with the {stored} mechanism: resume it with "
                f"--dp-mechanism {stored}"
            )
        stored = d.get("min_separation")
        if stored is not None:
            if self.min_separation is not None and int(stored) != self.min_separation:
                raise ValueError(
                    f"this run's phones were kept {stored} rounds apart: resume it with "
                    f"--dp-min-separation {stored}"
                )
            self.min_separation = int(stored)
        self._load_delta_state(d)
        self.steps = int(d.get("steps", 0))
