"""How unequal the server's per-phone weights are in each round (issue 18, item 4: does attention do
anything where clients differ?).

Each metrics row's ``info`` holds the round's weights per phone, as the strategy wrote them
(server/strategies/methods.py): FedAtt's ``attention_mean`` (Ji et al. 2019, eq. 5: the softmax
over phones of ``||w^l - w_k^l||``, per layer, averaged here over the layers), FedAttOpt's
``attention`` (Jiang et al. 2020, eq. 3), FedMed's ``attention_mean`` in its adaptive rounds, and
FedAvg's ``weights`` (n_k / n, McMahan et al. 2017) for comparison. From them: the largest and
smallest weight, and the entropy ``H = -sum_k w_k ln w_k`` beside its uniform value ``ln m``
(H / ln m = 1: every phone weighs the same; lower: the weight gathers on few phones).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: The info keys that hold per-phone weights, the attentive ones first.
WEIGHT_KEYS = ("attention_mean", "attention", "weights")


def spread(weights: Mapping[str, float]) -> dict[str, float]:
    """{m, max, min, entropy, evenness} of one round's weights (normalized to sum 1 first;
    evenness = entropy / ln m, 1 for a single phone)."""
    values = [float(w) for w in weights.values()]
    total = sum(values)
    if not values or not total > 0:
        raise ValueError("no positive weights to measure")
    p = [v / total for v in values]
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    m = len(p)
    return {
        "m": m,
        "max": max(p),
        "min": min(p),
        "entropy": entropy,
        "evenness": entropy / math.log(m) if m > 1 else 1.0,
    }


def round_spreads(rows: list[dict]) -> list[dict]:
    """Per aggregated round: {round, source (the info key), m, max, min, entropy, evenness}; rounds
    whose info holds no weights (round 0, FedMed's plain-average rounds) are left out."""
    out = []
    for row in rows:
        info = row.get("info") or {}
        for key in WEIGHT_KEYS:
            w = info.get(key)
            if isinstance(w, Mapping) and w:
                out.append({"round": row["round"], "source": key, **spread(w)})
                break
    return out
