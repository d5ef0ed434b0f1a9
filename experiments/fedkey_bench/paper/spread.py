"""How unequal the server's per-phone weights are in each round (does attention do
anything where clients differ?).

Each metrics row's ``info`` holds the round's weights per phone, as the strategy wrote them
(federation/strategies/methods.py): FedAtt's ``attention_mean`` (Ji et al. 2019, eq. 5: the softmax
over phones of ``||w^l - w_k^l||``, per layer, averaged here over the layers), FedAttOpt's
``attention`` (Jiang et al. 2020, eq. 3), FedMed's ``attention_mean`` in its adaptive rounds, and
FedAvg's ``weights`` (n_k / n, McMahan et al. 2017) for comparison. From them: the largest and
smallest weight, and the entropy ``H = -sum_k w_k ln w_k`` beside its uniform value ``ln m``
(H / ln m = 1: every phone weighs the same; lower: the weight gathers on few phones). The report's
table of their mean per run, and a figure of the evenness per round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.paper.tables import NAMES, PARTITIONS, _c, _f, _key

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


def _ordered(runs: list[dict]) -> list[dict]:
    """The runs with weights, by text and partition, then C (AdaFL's rising C last), each in
    the order the runs ended."""
    runs = [r for r in runs if r.get("weight_spread")]
    return sorted(
        runs, key=lambda r: (r["dataset"], r.get("partition", "iid"), _key(r["fraction"]))
    )


def _evenness(r: dict) -> str:
    sp = r["weight_spread"]
    return _f(sum(s["evenness"] for s in sp) / len(sp), ".4f")


def spread_table(runs: list[dict]) -> str:
    """The mean evenness (entropy / ln m) of the server's weights over each run's rounds: one
    row per text, phones and C, one column per method (each round's, with its largest and
    smallest weight and entropy: the run's weight_spread in results.json)."""
    ordered = _ordered(runs)
    methods: list[str] = []
    for r in ordered:
        if r["method"] not in methods:
            methods.append(r["method"])
    cells: dict[tuple, dict[str, str]] = {}
    for r in ordered:
        key = (NAMES.get(r["dataset"], r["dataset"]), PARTITIONS.get(r.get("partition", "iid"), "-"),
               _c(r.get("fraction")), f"{sum(s['m'] for s in r['weight_spread']) / len(r['weight_spread']):.0f}")  # fmt: skip
        cells.setdefault(key[:3], {"m": key[3]})[r["method"]] = _evenness(r)
    header = ["text", "phones", "C", "m", *methods]
    rows = [[*key, c["m"], *(c.get(m, "") for m in methods)] for key, c in cells.items()]
    return markdown_table(header, rows) if rows else ""


def spread_section(runs: list[dict]) -> list[str]:
    """The report's section on the server's weights: its heading, what it shows, the table."""
    return ["### Does attention do anything where phones differ? The server's weights per round",
            "", "From each round's per-phone weights in the metrics rows (fedkey_bench.paper.spread): FedAtt's "
            "and FedMed's attention (averaged over layers), FedAttOpt's, and FedAvg's n_k / n for "
            "comparison. Evenness = entropy / ln m, averaged over a run's rounds: 1 when every "
            "phone weighs the same; m: the phones a round (2 of the demo's 22 at C 0.1, all of "
            "them at C 1). Every round of every run, with its largest and smallest weight and "
            "entropy: each run's `weight_spread` in [`results.json`](results.json).", "",
            spread_table(runs) or "No federated run with weights is done yet."]  # fmt: skip


def plot_spread(runs: list[dict], out: Path, name: str, title: str) -> Path | None:
    """Evenness of the server's weights (entropy / ln m) per round, one line per run."""
    runs = [r for r in runs if len(r.get("weight_spread") or ()) > 1]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    for i, r in enumerate(runs):
        sp = r["weight_spread"]
        ax.plot([s["round"] for s in sp], [s["evenness"] for s in sp], color=f"C{i % 10}",
                label=f"{r['method']} ({sp[0]['source']})")  # fmt: skip
    ax.set_xlabel("round")
    ax.set_ylabel("evenness: entropy / ln m (1 = equal weights)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
