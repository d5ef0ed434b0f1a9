"""Aggregation primitives over state dicts (``dict[str, Tensor]``).

Modelled on Flower's ``server/strategy/aggregate.py``: small functions with no state across rounds.
Every method here is *streaming*: client states are consumed from an iterable exactly once and the
memory held is a constant number of model-sized float64 buffers, whatever the number of clients.
Softmax-weighted sums use the online-softmax trick (running max, running sum of exponentials and a
running weighted sum that is rescaled whenever the max grows), so no per-client tensor is kept.

Conventions shared by all functions:

* Only floating-point entries are aggregated; other entries (integer buffers such as
  ``num_batches_tracked``) are copied from the global state.
* Internally everything is float64 and works on deltas ``u_k = theta_k - theta`` (less cancellation);
  results are cast back to each global tensor's dtype.
* A client state must hold every floating key of the global state with the same shape; extra keys
  are ignored.
* Each accumulator's ``add`` accepts an optional ``tag`` (for example a device id); the per-client
  *scalars* (scores, distances) are kept for diagnostics, which is O(clients x layers) floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping

import torch
from torch import Tensor

StateDict = dict[str, Tensor]
NORMS = ("l2", "spectral")
#: FedAtt's normalizers: the cohort's softmax (eq. 4), or the fixed count m (:func:`fedatt_fixed`).
NORMALIZERS = ("softmax", "fixed")
ACC_DTYPE = torch.float64

__all__ = [
    "NORMALIZERS",
    "NORMS",
    "StateDict",
    "AttOptGradient",
    "LayerwiseAttention",
    "OnlineSoftmaxSum",
    "WeightedAverage",
    "attopt_step_scale",
    "fedatt",
    "fedatt_fixed",
    "fedattopt",
    "fedattopt_gradient",
    "fedavg",
    "fedmed_adaptive",
    "floating_keys",
    "js_divergence_softmax",
    "layer_distance",
    "model_distance",
    "num_parameters",
    "step_by",
]


# --------------------------------------------------------------------------- helpers


def floating_keys(state: Mapping[str, Tensor]) -> list[str]:
    """The keys of ``state`` whose tensors are floating point (the ones that get aggregated)."""
    return [k for k, v in state.items() if torch.is_floating_point(v)]


def num_parameters(state: Mapping[str, Tensor]) -> int:
    """Length n of the concatenated floating-point parameter vector."""
    return sum(state[k].numel() for k in floating_keys(state))


def _delta(global_t: Tensor, client_t: Tensor, key: str) -> Tensor:
    """``client - global`` as a fresh float64 tensor, after checking the shapes agree."""
    if client_t.shape != global_t.shape:
        raise ValueError(
            f"layer {key!r}: client shape {tuple(client_t.shape)} != global {tuple(global_t.shape)}"
        )
    return client_t.detach().to(device=global_t.device, dtype=ACC_DTYPE) - global_t.detach()


def _layer(client: Mapping[str, Tensor], key: str) -> Tensor:
    try:
        return client[key]
    except KeyError:
        raise ValueError(f"client state is missing layer {key!r}") from None


def _finish(global_state: Mapping[str, Tensor], new64: Mapping[str, Tensor]) -> StateDict:
    """Assemble the output: aggregated floats cast to the global dtype, other entries copied."""
    out: StateDict = {}
    for k, v in global_state.items():
        out[k] = new64[k].to(dtype=v.dtype) if k in new64 else v.detach().clone()
    return out


def step_by(
    global_state: Mapping[str, Tensor], sums: Mapping[str, Tensor], step: float = 1.0
) -> StateDict:
    """``theta + step * s`` per floating layer (``sums``: float64, e.g. a weighted sum of the
    deltas), in the global dtypes, other entries copied."""
    new = {
        k: global_state[k].detach().to(ACC_DTYPE) + step * sums[k]
        for k in floating_keys(global_state)
    }
    return _finish(global_state, new)


def _check_finite(x: float, what: str) -> float:
    if not math.isfinite(x):
        raise ValueError(f"{what} is not finite ({x}); the update contains NaN or Inf")
    return x


def layer_distance(a: Tensor, b: Tensor, norm: str = "l2") -> float:
    """FedAtt's layer score ``||a - b||``.

    ``"l2"``: L2 norm of the flattened difference (Plato's choice, the default).
    ``"spectral"``: the largest singular value (``torch.linalg.matrix_norm(ord=2)``, what the
    original code got from ``scipy.linalg.norm(ord=2)``) for tensors with 2 or more dimensions
    (reshaped to ``(shape[0], -1)``); 0-D and 1-D tensors fall back to the L2 norm, as scipy does.
    """
    d = b.detach().to(ACC_DTYPE) - a.detach().to(device=b.device, dtype=ACC_DTYPE)
    return _norm_of_delta(d, norm)


def _norm_of_delta(d: Tensor, norm: str) -> float:
    if norm == "l2" or d.dim() < 2:
        return float(torch.linalg.vector_norm(d))
    if norm == "spectral":
        return float(torch.linalg.matrix_norm(d.reshape(d.shape[0], -1), ord=2))
    raise ValueError(f"unknown norm {norm!r}; use one of {NORMS}")


def model_distance(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    """Whole-model L2 distance ``||a - b||_2`` over the floating keys of ``a`` (float64)."""
    total = 0.0
    for k in floating_keys(a):
        total += float(_delta(a[k], _layer(b, k), k).square().sum())
    return math.sqrt(total)


def _js_softmax64(p_logits: Tensor, q_logits: Tensor) -> float:
    log_p = torch.log_softmax(p_logits.reshape(-1), dim=0)
    log_q = torch.log_softmax(q_logits.reshape(-1), dim=0)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    kl_pm = torch.sum(log_p.exp() * (log_p - log_m))
    kl_qm = torch.sum(log_q.exp() * (log_q - log_m))
    # Clamp tiny negative rounding; JS is in [0, log 2].
    return max(0.0, float(0.5 * kl_pm + 0.5 * kl_qm))


def js_divergence_softmax(a: Tensor, b: Tensor) -> float:
    """FedMed's layer score: Jensen-Shannon divergence (natural log) between softmax(flatten(a))
    and softmax(flatten(b)).

    Weights are not distributions; FedMed (Wu et al. 2020) does not say how it maps them to one, so we use
    the softmax of the flattened layer (computed in log space in float64). Consequences worth
    knowing: a 1-element layer always maps to [1] (JS = 0), and a large layer maps to a nearly
    uniform distribution, so its JS values are small and its weights close to uniform.
    """
    return _js_softmax64(a.detach().to(ACC_DTYPE), b.detach().to(device=a.device, dtype=ACC_DTYPE))


# --------------------------------------------------------------------------- accumulators


class OnlineSoftmaxSum:
    """One-pass ``sum_k softmax(s)_k * x_k`` over a dict of tensors.

    Keeps a running max ``M``, a running normaliser ``Z = sum_k exp(s_k - M)`` and a running sum
    ``A = sum_k exp(s_k - M) x_k``; when a new score exceeds ``M`` both are rescaled by
    ``exp(M_old - M_new)``. ``result()`` is ``A / Z``. Memory: one buffer per key.
    """

    def __init__(self) -> None:
        self.max = -math.inf
        self.norm = 0.0
        self.count = 0
        self.acc: dict[str, Tensor] = {}

    def push(self, score: float) -> tuple[float, float]:
        """Register a score; return ``(scale for the old sums, weight of the new term)``."""
        _check_finite(score, "attention score")
        self.count += 1
        if score > self.max:
            scale = math.exp(self.max - score) if self.count > 1 else 0.0
            self.norm = self.norm * scale + 1.0
            self.max = score
            return scale, 1.0
        w = math.exp(score - self.max)
        self.norm += w
        return 1.0, w

    def accumulate(self, key: str, x: Tensor, scale: float, weight: float) -> None:
        """Fold ``x`` into buffer ``key`` with the pair returned by :meth:`push`."""
        acc = self.acc.get(key)
        if acc is None:
            self.acc[key] = x.to(ACC_DTYPE).mul(weight)
            return
        if scale != 1.0:
            acc.mul_(scale)
        acc.add_(x, alpha=weight)

    def add(self, score: float, xs: Mapping[str, Tensor]) -> None:
        """Add one term with score ``score`` and tensors ``xs`` (same keys every time)."""
        scale, weight = self.push(score)
        for k, x in xs.items():
            self.accumulate(k, x, scale, weight)

    def weight_of(self, score: float) -> float:
        """Final softmax weight of a term that was added with ``score``."""
        return math.exp(score - self.max) / self.norm

    def log_normalizer(self) -> float:
        """``log sum_k exp(s_k)`` (the log-sum-exp of all scores seen)."""
        return self.max + math.log(self.norm)

    def result(self) -> dict[str, Tensor]:
        """The softmax-weighted sum, one float64 tensor per key."""
        if self.count == 0:
            raise ValueError("no terms were added")
        return {k: a / self.norm for k, a in self.acc.items()}


class WeightedAverage:
    """Running ``theta + sum_k w_k u_k / sum_k w_k`` (FedAvg when ``w_k = n_k``)."""

    def __init__(self, global_state: Mapping[str, Tensor]) -> None:
        self.global_state = global_state
        self.keys = floating_keys(global_state)
        self.total_weight = 0.0
        self.count = 0
        self.acc: dict[str, Tensor] = {}

    def add(self, client_state: Mapping[str, Tensor], weight: float = 1.0) -> None:
        """Add one client state with a non-negative weight."""
        self.add_deltas(
            {k: _delta(self.global_state[k], _layer(client_state, k), k) for k in self.keys},
            weight,
        )

    def add_deltas(self, deltas: Mapping[str, Tensor], weight: float) -> None:
        """Add precomputed float64 deltas ``u = theta_k - theta`` (read, not kept)."""
        weight = float(weight)
        if not (weight >= 0.0 and math.isfinite(weight)):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        self.total_weight += weight
        self.count += 1
        for k, u in deltas.items():
            if k in self.acc:
                self.acc[k].add_(u, alpha=weight)
            else:
                self.acc[k] = u.mul(weight)

    def result(self) -> StateDict:
        """The weighted average, in the global state's dtypes."""
        if self.count == 0:
            raise ValueError("no client states were added")
        if self.total_weight <= 0.0:
            raise ValueError("total weight is zero: cannot average")
        new = {
            k: self.global_state[k].detach().to(ACC_DTYPE) + self.acc[k] / self.total_weight
            for k in self.keys
        }
        return _finish(self.global_state, new)


class LayerwiseAttention:
    """Layer-wise softmax attention over clients, shared by FedAtt (Ji et al. 2019) and FedMed (Wu et al. 2020).

    For every layer l: ``s_k^l = score_fn(w^l, w_k^l)``, ``alpha_k^l = softmax_k(s_k^l)`` and
    ``theta^l_{t+1} = theta^l - step * sum_k alpha_k^l (theta^l - theta_k^l)``
    ``= theta^l + step * sum_k alpha_k^l u_k^l``. One :class:`OnlineSoftmaxSum` per layer.

    ``score_fn(u, global_layer, client_layer)`` receives the float64 delta ``u_k^l`` and the raw
    layers; see :meth:`fedatt_scorer` and :meth:`fedmed_scorer`.
    """

    def __init__(
        self,
        global_state: Mapping[str, Tensor],
        score_fn: Callable[[Tensor, Tensor, Tensor], float],
        score_scale: Mapping[str, float] | None = None,
        score_cap: Mapping[str, float] | None = None,
    ) -> None:
        self.global_state = global_state
        self.keys = floating_keys(global_state)
        self.score_fn = score_fn
        # The attention cap: layer l's logit is its score times score_scale[l] (1 / (T S_l) for
        # FedAtt under a clip), so logits span a known interval; None: the raw score.
        self.score_scale = dict(score_scale) if score_scale is not None else None
        # Winsorized scores: layer l's raw score counts at most score_cap[l] (FedAtt under the
        # trim: the round's (k+1)-th largest distance); None: no cap. ``capped`` counts them.
        self.score_cap = dict(score_cap) if score_cap is not None else None
        self.capped = 0
        self.layers = {k: OnlineSoftmaxSum() for k in self.keys}
        self.scores: list[tuple[Hashable, dict[str, float]]] = []

    @staticmethod
    def fedatt_scorer(norm: str = "l2") -> Callable[[Tensor, Tensor, Tensor], float]:
        """FedAtt: ``s_k^l = ||w^l - w_k^l||`` (see :func:`layer_distance`)."""
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; use one of {NORMS}")
        return lambda u, g, c: _norm_of_delta(u, norm)

    @staticmethod
    def fedmed_scorer() -> Callable[[Tensor, Tensor, Tensor], float]:
        """FedMed: ``d_k^l = JS(softmax(w^l) || softmax(w_k^l))`` (see :func:`js_divergence_softmax`)."""
        return lambda u, g, c: js_divergence_softmax(g, c)

    def add(
        self,
        client_state: Mapping[str, Tensor],
        tag: Hashable = None,
        also: WeightedAverage | None = None,
        weight: float = 1.0,
    ) -> dict[str, float]:
        """Add one client; return its per-layer scores (the logits, after ``score_scale``).

        ``also``: a :class:`WeightedAverage` fed the same deltas with ``weight`` in this pass
        (FedMed computes its FedAvg fallback alongside).
        """
        layer_scores: dict[str, float] = {}
        deltas: dict[str, Tensor] = {}
        for k in self.keys:
            g = self.global_state[k]
            c = _layer(client_state, k)
            u = _delta(g, c, k)
            s = self._logit(k, float(self.score_fn(u, g, c)))
            self.layers[k].add(s, {k: u})
            layer_scores[k] = s
            if also is not None:
                deltas[k] = u
        if also is not None:
            also.add_deltas(deltas, weight)
        self.scores.append((tag, layer_scores))
        return layer_scores

    def add_scores(self, scores: Mapping[str, float], tag: Hashable = None) -> dict[str, float]:
        """Add one client by its layers' raw scores alone (a caller that sums the deltas itself
        with :meth:`weights` or :meth:`fixed_weights`: :meth:`result` then has nothing to
        return); return its logits, as :meth:`add` does."""
        layer_scores = {k: self._logit(k, float(scores[k])) for k in self.keys}
        for k, s in layer_scores.items():
            self.layers[k].push(s)
        self.scores.append((tag, layer_scores))
        return layer_scores

    def _logit(self, key: str, s: float) -> float:
        """Layer ``key``'s raw score ``s`` capped (``score_cap``) and scaled (``score_scale``)."""
        s = _check_finite(s, f"score of layer {key!r}")
        if self.score_cap is not None and s > self.score_cap[key]:
            # the cap is computed in float64 from the same delta: count real cuts only
            self.capped += s > self.score_cap[key] * (1 + 1e-6)
            s = self.score_cap[key]
        if self.score_scale is not None:
            s *= self.score_scale[key]
        return s

    @property
    def count(self) -> int:
        return len(self.scores)

    def weights(self) -> list[tuple[Hashable, dict[str, float]]]:
        """Final attention weights ``alpha_k^l`` per client (in insertion order) and layer."""
        return [
            (tag, {k: self.layers[k].weight_of(s) for k, s in sc.items()})
            for tag, sc in self.scores
        ]

    def result(self, step: float) -> StateDict:
        """``theta + step * sum_k alpha_k u_k`` per layer, in the global dtypes."""
        if not self.scores:
            raise ValueError("no client states were added")
        new = {}
        for k in self.keys:
            mean_u = self.layers[k].result()[k]
            new[k] = self.global_state[k].detach().to(ACC_DTYPE) + step * mean_u
        return _finish(self.global_state, new)

    def _ceiling(self, key: str, ceiling: Mapping[str, float] | None) -> float:
        """Layer ``key``'s logit ceiling: the given (public) one, else the cohort's largest."""
        return self.layers[key].max if ceiling is None else ceiling[key]

    def fixed_weights(
        self, ceiling: Mapping[str, float] | None = None
    ) -> list[tuple[Hashable, dict[str, float]]]:
        """The fixed normalizer's weights ``w_k^l = exp(s_k^l - c^l)`` per client (in insertion
        order) and layer, ``c^l`` the logits' ceiling (see :meth:`fixed_result`)."""
        return [
            (tag, {k: fixed_weight(s, self._ceiling(k, ceiling)) for k, s in sc.items()})
            for tag, sc in self.scores
        ]

    def fixed_scale(self, ceiling: Mapping[str, float] | None = None) -> dict[str, float]:
        """Per layer, the mean fixed weight ``(1/m) sum_k w_k^l``: the factor by which
        :meth:`fixed_result`'s step is FedAtt's :meth:`result`'s."""
        out = {}
        for k in self.keys:
            layer = self.layers[k]
            out[k] = layer.norm * math.exp(layer.max - self._ceiling(k, ceiling)) / self.count
        return out

    def fixed_result(self, step: float, ceiling: Mapping[str, float] | None = None) -> StateDict:
        """``theta + step * (1/m) sum_k w_k^l u_k^l`` per layer with ``w_k^l = exp(s_k^l - c^l)``:
        the softmax's relative weights over the fixed count m instead of their sum.

        ``ceiling``: per layer a public upper bound ``c^l`` of the logits (FedAtt under a bound:
        ``1/T``), so every ``w <= 1`` and one client's term has norm at most its own delta's;
        None: the cohort's largest logit (the largest weight is 1). In the global dtypes."""
        if not self.scores:
            raise ValueError("no client states were added")
        new = {}
        for k in self.keys:
            layer = self.layers[k]  # its buffer holds sum_k exp(s_k - max) u_k
            factor = math.exp(layer.max - self._ceiling(k, ceiling)) / self.count
            new[k] = self.global_state[k].detach().to(ACC_DTYPE) + step * factor * layer.acc[k]
        return _finish(self.global_state, new)


class AttOptGradient:
    r"""Streaming exact gradient of FedAttOpt's log loss (Jiang et al. 2020, eqs. 2-5).

    With theta the concatenated global parameters (length n), theta_k the m client vectors,
    ``s_k = theta^T theta_k / sqrt(n)``, ``a_k = softmax_k(s_k)``, ``d_k = ||theta - theta_k||_2``:

        L'(theta) = sum_k (log a_k + log d_k) = sum_k s_k - m * logsumexp_j(s_j) + sum_k log d_k

    Since ``ds_j/dtheta = theta_j / sqrt(n)`` and ``d(log d_k)/dtheta = (theta - theta_k) / d_k^2``:

        grad L' = (sum_k theta_k - m * sum_j a_j theta_j) / sqrt(n) + sum_k (theta - theta_k) / d_k^2

    (The paper's eqs. 8-10 drop the softmax normaliser's term and write ``2 (theta - theta_k)``
    summed over k for ``grad d_k``; the formula above is the exact derivative and is checked
    against autograd in the tests.) Using ``sum_j a_j = 1`` it is computed on deltas
    ``u_k = theta_k - theta`` for precision:

        grad = B - (m / sqrt(n)) * A,   B = sum_k u_k (1/sqrt(n) - 1/d_k^2),   A = sum_j a_j u_j

    Per client, one pass over its layers gives the scalars s_k and d_k, a second pass folds u_k
    into B (a running sum) and A (an online softmax): two model-sized buffers in all.

    A client identical to the server (``d_k = 0``) makes log d_k = -inf; its distance term is
    left out (it is already at the server model) while it still counts in the attention part.
    """

    def __init__(self, global_state: Mapping[str, Tensor], distance_floor: float = 0.0) -> None:
        self.global_state = global_state
        self.keys = floating_keys(global_state)
        # Bounded influence: d_k = max(d_k, floor) in the distance term, so that no phone's term
        # exceeds 1 / floor in norm (fedkey.federation.strategies.sensitivity); 0: the paper's step.
        self.distance_floor = float(distance_floor)
        self.n = num_parameters(global_state)
        if self.n == 0:
            raise ValueError("global state has no floating-point parameters")
        self.sqrt_n = math.sqrt(self.n)
        self.softmax = OnlineSoftmaxSum()
        self.b: dict[str, Tensor] = {}
        self.records: list[tuple[Hashable, float, float]] = []  # (tag, s_k, d_k)
        self.zero_distance = 0

    def add(self, client_state: Mapping[str, Tensor], tag: Hashable = None) -> tuple[float, float]:
        """Add one client; return its ``(s_k, d_k)``."""
        dot = 0.0
        sq = 0.0
        for k in self.keys:
            g = self.global_state[k]
            c = _layer(client_state, k)
            u = _delta(g, c, k)
            g64 = g.detach().reshape(-1).to(ACC_DTYPE)
            dot += float(
                torch.dot(g64, c.detach().reshape(-1).to(device=g.device, dtype=ACC_DTYPE))
            )
            sq += float(u.square().sum())
        s = _check_finite(dot / self.sqrt_n, "attention score s_k")
        d = math.sqrt(_check_finite(sq, "distance d_k"))
        d_eff = max(d, self.distance_floor)
        coef = 1.0 / self.sqrt_n - (1.0 / (d_eff * d_eff) if d_eff > 0 else 0.0)
        if d_eff == 0:
            self.zero_distance += 1
        scale, weight = self.softmax.push(s)
        for k in self.keys:
            u = _delta(self.global_state[k], client_state[k], k)
            self.softmax.accumulate(k, u, scale, weight)
            if k in self.b:
                self.b[k].add_(u, alpha=coef)
            else:
                self.b[k] = u.mul(coef)
        self.records.append((tag, s, d))
        return s, d

    @property
    def count(self) -> int:
        return len(self.records)

    def gradient(self) -> dict[str, Tensor]:
        """``grad_theta L'`` at the global model, float64, one tensor per floating key."""
        if not self.records:
            raise ValueError("no client states were added")
        a = self.softmax.result()
        c = self.count / self.sqrt_n
        return {k: self.b[k] - c * a[k] for k in self.keys}

    def loss(self) -> float:
        """``L' = sum_k (log a_k + log d_k)`` (``-inf`` if some ``d_k = 0``)."""
        lse = self.softmax.log_normalizer()
        total = 0.0
        for _, s, d in self.records:
            total += (s - lse) + (math.log(d) if d > 0 else -math.inf)
        return total

    def attention(self) -> list[tuple[Hashable, float]]:
        """Final ``a_k`` per client, in insertion order."""
        return [(tag, self.softmax.weight_of(s)) for tag, s, _ in self.records]

    def result(self, epsilon: float, grad: Mapping[str, Tensor] | None = None) -> StateDict:
        """``theta_{t+1} = theta_t - epsilon * grad L'``, in the global dtypes (``grad``: this
        accumulator's :meth:`gradient`, where the caller has it already)."""
        grad = self.gradient() if grad is None else grad
        new = {
            k: self.global_state[k].detach().to(ACC_DTYPE) - epsilon * grad[k] for k in self.keys
        }
        return _finish(self.global_state, new)


# --------------------------------------------------------------------------- pure functions


def fedavg(
    global_state: Mapping[str, Tensor], updates: Iterable[tuple[Mapping[str, Tensor], float]]
) -> StateDict:
    """FedAvg: ``theta_{t+1} = sum_k (w_k / sum_j w_j) theta_k`` over ``(state, w_k)`` pairs.

    Pass ``w_k = n_k`` for the data-size weighting of McMahan et al., 1.0 for a plain mean.
    ``global_state`` gives the keys, dtypes and non-floating entries (and the reference point of
    the deltas; the result does not depend on it otherwise).
    """
    acc = WeightedAverage(global_state)
    for state, weight in updates:
        acc.add(state, weight)
    return acc.result()


def fedatt(
    global_state: Mapping[str, Tensor],
    client_states: Iterable[Mapping[str, Tensor]],
    epsilon: float = 1.2,
    norm: str = "l2",
) -> StateDict:
    """FedAtt (Ji et al. 2019, eqs. 2-4): layer-wise attention on parameter distances.

    ``s_k^l = ||w^l - w_k^l||``, ``alpha_k^l = softmax_k(s_k^l)``,
    ``theta^l_{t+1} = theta^l_t - epsilon * sum_k alpha_k^l (theta^l_t - theta_k^l)``.
    Clients farther from the server get more weight, as in the paper and its code.
    """
    acc = LayerwiseAttention(global_state, LayerwiseAttention.fedatt_scorer(norm))
    for state in client_states:
        acc.add(state)
    return acc.result(epsilon)


def capped_logit_scale(layer_bounds: Mapping[str, float], temperature: float) -> dict[str, float]:
    """FedAtt's logit scale under a clip ``||u^l|| <= S_l``: layer l's distance times
    ``1 / (T S_l)``, so its logit lies in ``[0, 1/T]`` (the attention cap)."""
    return {k: 1.0 / (temperature * s) for k, s in layer_bounds.items()}


def fixed_weight(logit: float, ceiling: float) -> float:
    """The fixed normalizer's weight of a logit under its ceiling c: ``exp(s - c)``, at most 1."""
    return math.exp(logit - ceiling)


def fedatt_fixed(
    global_state: Mapping[str, Tensor],
    client_states: Iterable[Mapping[str, Tensor]],
    epsilon: float = 1.2,
    norm: str = "l2",
    layer_bounds: Mapping[str, float] | None = None,
    temperature: float = 1.0,
) -> StateDict:
    """FedAtt's attention (Ji et al. 2019, eq. 4) over the fixed count m: DP-FedAvg's sensitivity.

    With a clip ``||u_k^l|| <= S_l`` (``layer_bounds``, the engine's Bound.layers) the logit is
    FedAtt's capped one, ``s_k^l = ||u_k^l|| / (T S_l)`` in ``[0, 1/T]``; the weight is
    ``w_k^l = exp(s_k^l - 1/T)`` in ``[e^(-1/T), 1]`` (the public ceiling subtracted) and
    ``theta^l_{t+1} = theta^l + epsilon * (1/m) sum_k w_k^l u_k^l``. The ratios ``w_j / w_k`` are
    FedAtt's softmax's, so the step is FedAtt's eq. 4 with its layer step scaled by the mean
    weight ``(1/m) sum_k w_k^l``. One phone's term has norm at most its own clipped delta's and
    depends on nothing else, so replacing one phone moves the result by at most
    ``epsilon * 2 S / m`` (either clip scope): DP-FedAvg's uniform-mean sensitivity
    (fedkey.federation.strategies.sensitivity.fixed_attention_sensitivity). Without ``layer_bounds`` the logit
    is the raw distance and the ceiling the cohort's largest (no public bound, no DP analysis).
    """
    scale = None
    if layer_bounds is not None:
        scale = capped_logit_scale(layer_bounds, temperature)
    acc = LayerwiseAttention(global_state, LayerwiseAttention.fedatt_scorer(norm), scale)
    for state in client_states:
        acc.add(state)
    ceiling = None if scale is None else dict.fromkeys(scale, 1.0 / temperature)
    return acc.fixed_result(epsilon, ceiling)


def fedattopt_gradient(
    global_state: Mapping[str, Tensor], client_states: Iterable[Mapping[str, Tensor]]
) -> dict[str, Tensor]:
    """Exact ``grad_theta L'`` of FedAttOpt (Jiang et al. 2020) at the global model (float64); see
    :class:`AttOptGradient` for the derivation."""
    acc = AttOptGradient(global_state)
    for state in client_states:
        acc.add(state)
    return acc.gradient()


def attopt_step_scale(
    epsilon: float, distances: Iterable[float], distance_floor: float = 0.0
) -> float:
    """How far one FedAttOpt step moves against FedAvg's (1): ``epsilon * sum_k 1 / d_k^2``.

    In the terms of :class:`AttOptGradient`, ``theta_{t+1} = theta + sum_k c_k u_k`` with
    ``c_k = epsilon * (1/d_k^2 - 1/sqrt(n) + m a_k / sqrt(n))``; since ``sum_k a_k = 1`` the
    attention terms cancel in the sum, leaving ``sum_k c_k = epsilon * sum_k 1/d_k^2`` (``d_k`` at
    least ``distance_floor``; a phone at distance 0 adds nothing). FedAvg's weights sum to 1 (a
    weighted mean of the phones' models); 2 goes as far again past it; 0.01 barely moves. The
    scale goes as ``1 / d^2``: the step size epsilon suits one size of update only.
    """
    total = 0.0
    for d in distances:
        d_eff = max(float(d), distance_floor)
        if d_eff > 0:
            total += 1.0 / (d_eff * d_eff)
    return epsilon * total


def fedattopt(
    global_state: Mapping[str, Tensor],
    client_states: Iterable[Mapping[str, Tensor]],
    epsilon: float = 1.2,
) -> StateDict:
    """FedAttOpt (Jiang et al. 2020, eq. 7): one gradient step ``theta_t - epsilon * grad L'(theta_t)``."""
    acc = AttOptGradient(global_state)
    for state in client_states:
        acc.add(state)
    return acc.result(epsilon)


def fedmed_adaptive(
    global_state: Mapping[str, Tensor],
    client_states: Iterable[Mapping[str, Tensor]],
    eta: float = 1.0,
) -> StateDict:
    """FedMed adaptive aggregation (Wu et al. 2020, eqs. 2-5).

    ``d_k^l = JS(softmax(w^l) || softmax(w_k^l))``, ``gamma_k^l = softmax_k(d_k^l)``,
    ``theta^l_{t+1} = theta^l_t - eta * sum_k gamma_k^l (theta^l_t - theta_k^l)``
    (``eta = 1``: a gamma-weighted average of the client layers).
    """
    acc = LayerwiseAttention(global_state, LayerwiseAttention.fedmed_scorer())
    for state in client_states:
        acc.add(state)
    return acc.result(eta)
