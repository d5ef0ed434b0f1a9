"""How far FedAttOpt's server step reaches each round, against the size of the phones' updates:
why no fixed step size epsilon trains with it.

FedAttOpt (Jiang et al. 2020, eq. 7, its exact gradient) moves the model by
``sum_k c_k u_k`` (u_k = theta_k - theta) with ``sum_k c_k = epsilon * sum_k 1 / d_k^2``, d_k =
||u_k|| (fedkey.federation.strategies.aggregate.attopt_step_scale): its reach against FedAvg's 1 goes as
``1 / d^2``. The strategy writes it into each round's info as ``step_scale``; each round's info also
holds the median update norm (``clip.median_norm``, fedkey.federation.influence.bounding) for every method. From them,
per FedAttOpt run: the scale each round and the validation perplexity after it; and per other run
at the same client lr, how far its updates shrank, hence the epsilon that would have given
FedAvg's reach at its first and at its last round (``d^2 / m``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path

from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.paper.spec import command_flag
from fedkey_bench.paper.tables import NAMES, _f

#: Past this reach the report counts a round as overshooting (twice FedAvg's step).
FAR = 2.0


def step_scales(rows: list[dict]) -> list[list[float]]:
    """[[round, scale, the paper's step's scale], ...] of a FedAttOpt run's metrics rows: the
    info's ``step_scale`` and, where --max-reach cut it, ``capped_from`` (else the same); for rows
    written before the strategy recorded it, the scale from its ``distance`` and ``epsilon`` (those
    runs had no distance floor and no cap: no bounded or capped FedAttOpt ran before)."""
    # here, not at the top: fedkey.federation.strategies imports torch, which `fedkey --help` must not load
    from fedkey.federation.strategies.aggregate import attopt_step_scale

    out = []
    for row in rows:
        info = row.get("info") or {}
        if info.get("mode") != "fedattopt":
            continue
        scale = info.get("step_scale")
        if scale is None and isinstance(info.get("distance"), Mapping):
            scale = attopt_step_scale(float(info["epsilon"]), info["distance"].values())
        if scale is not None:
            out.append([row["round"], float(scale), float(info.get("capped_from", scale))])
    return out


def update_norms(rows: list[dict]) -> list[list[float]]:
    """[[round, median norm of the phones' updates], ...] from each round's ``clip`` info."""
    out = []
    for row in rows:
        norm = ((row.get("info") or {}).get("clip") or {}).get("median_norm")
        if norm is not None:
            out.append([row["round"], float(norm)])
    return out


def step_table(runs: list[dict]) -> str:
    """Per FedAttOpt run with scales: epsilon, the scale at round 1, its median and largest, the
    rounds past FAR, the median validation perplexity after those rounds and after the others."""
    header = ["run", "epsilon", "rounds", "reach: round 1", "median", "largest",
              f"rounds past {FAR:g}x", "val ppl after those: median", "after the others: median",
              "best val ppl (round)", "the paper's step's reach: median", "largest"]  # fmt: skip
    rows = []
    for r in runs:
        scales = r.get("step_scale") or []
        if not scales:
            continue
        val = {int(c[0]): c[1] for c in r.get("curve") or [] if c[1] is not None}
        far = [val[int(k)] for k, s, *_ in scales if s > FAR and int(k) in val]
        near = [val[int(k)] for k, s, *_ in scales if s <= FAR and int(k) in val]
        values = [s[1] for s in scales]
        asked = [s[-1] for s in scales]  # where --max-reach cut the step, what it cut it from
        rows.append([f"`{r['id']}`", command_flag(r["command"], "--epsilon"), len(scales),
                     _f(values[0], ".2f"), _f(statistics.median(values), ".2f"),
                     _f(max(values), ".2f"), len(far),
                     _f(statistics.median(far), ".3g") if far else "-",
                     _f(statistics.median(near), ".3g") if near else "-",
                     f"{_f(r['best_val_ppl'])} ({r['best_round']})",
                     _f(statistics.median(asked), ".2f"), _f(max(asked), ".2f")])  # fmt: skip
    return markdown_table(header, rows) if rows else ""


def shrink_table(runs: list[dict], of: list[dict]) -> str:
    """The other runs of each FedAttOpt run's suite, dataset and client lr: their updates' median
    norm at the first and the last round, and the epsilon at which FedAttOpt would reach as far
    as FedAvg there (d^2 / m, m phones a round)."""
    header = ["dataset", "run", "client lr", "update norm: round 1", "last round",
              "epsilon for FedAvg's reach: round 1", "last round"]  # fmt: skip
    rows = []
    # each (suite, dataset, client lr) once, however many FedAttOpt runs share it
    for suite, dataset, lr in dict.fromkeys(
        (ref["suite"], ref["dataset"], command_flag(ref["command"], "--lr")) for ref in of
    ):
        for r in runs:
            norms = r.get("update_norms") or []
            if (r["dataset"] != dataset or r["suite"] != suite or len(norms) < 2
                    or r.get("step_scale") or command_flag(r["command"], "--lr") != lr):  # fmt: skip
                continue
            m = max(1.0, r["updates"] / r["rounds"])  # phones a round, as the run recorded them
            first, last = norms[0][1], norms[-1][1]
            rows.append([NAMES.get(r["dataset"], r["dataset"]), f"`{r['id']}`", lr,
                         _f(first, ".1f"), _f(last, ".1f"), _f(first**2 / m, ".0f"),
                         _f(last**2 / m, ".0f")])  # fmt: skip
    return markdown_table(header, rows) if rows else ""


def step_section(runs: list[dict], plot: Path | None = None) -> list[str]:
    """The report's section: both tables and the figure; nothing while no run has scales."""
    mine = [r for r in runs if r["suite"] in ("rank", "noniid") and r.get("kind") == "federated"]
    attopt = [r for r in mine if r.get("step_scale")]
    if not attopt:
        return []
    out = ["", "## FedAttOpt's server step: why no fixed epsilon trains", "",
           "FedAttOpt's update (Jiang et al. 2020, eq. 7, the exact gradient) is theta + "
           "sum_k c_k u_k with sum_k c_k = epsilon * sum_k 1 / d_k^2 (u_k a phone's update, d_k "
           "its norm; `fedkey.federation.strategies.aggregate.attopt_step_scale`, recorded each round as "
           "`step_scale`). Call it the reach: FedAvg's is 1 (a weighted mean of the phones' "
           "models), 2 goes as far again past it. It goes as 1 / d^2, so a step size that reaches "
           "as far as FedAvg for one size of update reaches (d / d')^2 as far for updates of "
           "size d'. The sweep chooses epsilon from its first rounds. fedkey's --max-reach R "
           "cuts a round's step to reach R where the paper's would go further; the last two "
           "columns say how far the paper's would have gone.", "", step_table(attopt), ""]  # fmt: skip
    shrink = shrink_table(mine, attopt)
    if shrink:
        out += ["The other runs of the same suite and dataset at the same client lr: how far "
                "their phones' updates shrank as they trained (the median norm from each round's "
                "info), and the epsilon that gives FedAvg's reach (d^2 / m) at each end.", "",
                shrink, ""]  # fmt: skip
    return out + ([f"![{plot.stem}]({plot.name})"] if plot else [])


def plot_steps(runs: list[dict], out: Path, name: str) -> Path | None:
    """Each FedAttOpt run's reach and validation perplexity per round, log scales, one above the
    other."""
    runs = [
        r for r in runs if r["suite"] in ("rank", "noniid") and len(r.get("step_scale") or ()) > 1
    ]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 5.5), sharex=True)
    for i, r in enumerate(runs):
        colour = f"C{i % 10}"
        rounds = [s[0] for s in r["step_scale"]]
        top.plot(rounds, [s[1] for s in r["step_scale"]], "o-", ms=3, color=colour, label=r["id"])
        if any(s[-1] != s[1] for s in r["step_scale"]):  # cut by --max-reach: from what
            top.plot(rounds, [s[-1] for s in r["step_scale"]], "--", color=colour, lw=0.8,
                     label=f"{r['id']}: the paper's step")  # fmt: skip
        curve = [c for c in r["curve"] if c[0] > 0 and c[1] is not None]
        bottom.plot([c[0] for c in curve], [c[1] for c in curve], "o-", ms=3, color=colour)
    top.axhline(1.0, color="grey", lw=0.8, ls="--")
    top.set_yscale("log")
    top.set_ylabel("reach against FedAvg's (1)")
    top.legend(fontsize=7)
    bottom.set_yscale("log")
    bottom.set_ylabel("validation perplexity")
    bottom.set_xlabel("round")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    top.set_title("FedAttOpt: each round's step against FedAvg's, and the model after it")
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
