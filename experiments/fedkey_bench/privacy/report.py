"""The report of `fedkey-bench privacy` (fedkey_bench.privacy.runner): results.md (the table first, then what it
shows and how it was made) and privacy.png (test perplexity against epsilon). Rebuilt from
results.json alone: `python -m fedkey_bench.privacy.report experiments/results/privacy` (or
privacy-irc, whose page fedkey_bench.privacy.grid_report writes)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from fedkey_bench.common.checkout import RESULTS, shown
from fedkey_bench.privacy.grid_report import write_grid_report
from fedkey_bench.privacy.numbers import fixed, general, ppl

STRATEGY_NAMES = {"fedavg": "DP-FedAvg", "fedatt": "DP-FedAtt"}


def cell_rows(runs: list[dict]) -> list[dict]:
    """The table's cells (not the clip probe), by strategy then epsilon (no DP first)."""
    cells = [r for r in runs if "strategy" in r]
    order = {s: i for i, s in enumerate(STRATEGY_NAMES)}
    return sorted(
        cells,
        key=lambda r: (
            order.get(r["strategy"], 99),
            r["strategy"],
            -1 if r["target_epsilon"] is None else r["target_epsilon"],
        ),
    )


def table(runs: list[dict]) -> str:
    lines = [
        "| strategy | target epsilon | epsilon reached | z | sensitivity | noise std / round "
        "| test ppl (final) | test ppl (best val, round) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in cell_rows(runs):
        name = STRATEGY_NAMES.get(r["strategy"], r["strategy"])
        target = "no DP" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        best = f"{ppl(r['best_test_ppl'])} ({r['best_round']})"
        lines.append(
            f"| {name if r['target_epsilon'] is not None else r['strategy']} | {target} "
            f"| {fixed(r['epsilon'])} | {fixed(r['noise_multiplier'], 3)} | {general(r['sensitivity'])} "
            f"| {general(r['noise_std'])} | {ppl(r['final_test_ppl'])} | {best} |"
        )
    return "\n".join(lines)


def _by(runs: list[dict]) -> dict[tuple[str, float | None], dict]:
    return {(r["strategy"], r["target_epsilon"]): r for r in cell_rows(runs)}


def findings(runs: list[dict]) -> str:
    """One paragraph, from the numbers: the noise ratio and the perplexity at each epsilon."""
    by = _by(runs)
    targets = sorted({e for (_, e) in by if e is not None})
    parts = []
    ratios = [
        by[("fedatt", e)]["noise_std"] / by[("fedavg", e)]["noise_std"]
        for e in targets
        if ("fedatt", e) in by and ("fedavg", e) in by and by[("fedavg", e)]["noise_std"]
    ]
    if ratios:
        parts.append(
            "At the same epsilon (the same z, the same clip S and cohort), DP-FedAtt's "
            f"sensitivity, and so its noise, is {statistics.mean(ratios):.2f}x DP-FedAvg's "
            "(the attention cap lets one phone carry up to e/(e+m-1) of the average instead of "
            "1/m, the others' weights shift when it is replaced, and FedAtt's server step 1.2 "
            "scales it all: fedkey.federation.strategies.sensitivity)."
        )
    for s in ("fedavg", "fedatt"):
        base = by.get((s, None))
        pts = [(e, by[(s, e)]) for e in targets if (s, e) in by]
        if not pts:
            continue
        seq = ", ".join(f"{ppl(r['final_test_ppl'])} at epsilon {e:g}" for e, r in pts)
        text = f"{STRATEGY_NAMES[s]} ends at test perplexity {seq}"
        if base is not None:
            text += f", against {ppl(base['final_test_ppl'])} without noise (same clip)"
        stuck = [e for e, r in pts if r["best_round"] == 0]
        if stuck:
            text += (
                f"; at epsilon {', '.join(f'{e:g}' for e in stuck)} no round's model beat the "
                "initial one on validation"
            )
        parts.append(text + ".")
    noisy = [r for (s, e), r in by.items() if e is not None and r.get("num_params")]
    if noisy:
        r = min(noisy, key=lambda r: r["noise_std"])
        norm = r["noise_std"] * math.sqrt(r["num_params"])
        parts.append(
            f"Even the least noise ({STRATEGY_NAMES[r['strategy']]} at epsilon "
            f"{r['target_epsilon']:g}: std {r['noise_std']:.3g} on each of the model's "
            f"{r['num_params']:,} parameters) has norm about {norm:.3g} per round, "
            + (
                f"{norm / r['clip']:.1f}x the clip S = {r['clip']:.3g} that bounds the whole "
                "averaged update (the noise is isotropic, the update is not)."
                if norm > r["clip"]
                else f"below the clip S = {r['clip']:.3g} that bounds the averaged update."
            )
        )
    pairs = [
        (e, by[("fedavg", e)], by[("fedatt", e)])
        for e in targets
        if ("fedavg", e) in by and ("fedatt", e) in by
    ]
    if pairs:
        worse = [e for e, a, b in pairs if b["final_test_ppl"] > a["final_test_ppl"]]
        parts.append(
            f"DP-FedAtt ends worse than DP-FedAvg at {len(worse)} of {len(pairs)} privacy levels"
            + (f" (epsilon {', '.join(f'{e:g}' for e in worse)})" if worse else "")
            + "."
        )
    return " ".join(parts)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = _by(runs)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, s in enumerate(STRATEGY_NAMES):
        color = f"C{i}"
        pts = sorted((e, r["final_test_ppl"]) for (st, e), r in by.items() if st == s and e)
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", color=color, label=STRATEGY_NAMES[s])
        if (s, None) in by:
            ax.axhline(
                by[(s, None)]["final_test_ppl"],
                color=color,
                linestyle="--",
                label=f"{s}, no DP (same clip)",
            )
    ax.set_xscale("log", base=2)
    targets = sorted({e for (_, e) in by if e is not None})
    ax.set_xticks(targets, [f"{e:g}" for e in targets])
    ax.set_xlabel("epsilon (delta 1e-5)")
    ax.set_ylabel("test perplexity (final round)")
    ax.set_yscale("log")
    ax.set_title("Privacy-utility: same clip, rounds and z at each epsilon")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(runs: list[dict], out: Path, commands: list[str], protocol: dict) -> None:
    """OUT/results.md and privacy.png: the grid's page when the runs carry a plan (the IRC
    workload: fedkey_bench.privacy.grid_report), else the PTB page below."""
    if any(r["id"] == "plan" for r in runs):
        write_grid_report(runs, out, commands)
        return
    probe = next((r for r in runs if r["id"].startswith("probe")), None)
    clip = next((r["clip"] for r in cell_rows(runs)), None)
    p = protocol
    lines = [
        "# Privacy-utility table (`fedkey-bench privacy`)",
        "",
        "What does differential privacy cost the model: test perplexity of DP-FedAvg and "
        "DP-FedAtt at each target epsilon, against the same runs without noise.",
        "",
        table(runs),
        "",
        findings(runs),
        "",
        "Command" + ("s" if len(commands) > 1 else "") + ":",
        "",
        *[f"    {shown(c)}" for c in commands],
        "",
        "## How it was made",
        "",
        f"PTB's first {p['max_train_tokens']:,} training words (vocabulary {p['vocab_size']:,}), "
        f"split IID over {p['clients']:,} phones; fixed-size cohorts of C = {p['fraction']} "
        f"({round(p['fraction'] * p['clients'])} phones a round), {p['rounds']} rounds of "
        f"{p['local_epochs']} local epoch (batches of {p['batch_size']} sentence"
        f"{'s' if p['batch_size'] > 1 else ''}, SGD lr 1.0, momentum 0.5), a one-layer GRU of "
        f"{p['hidden_size']} units (embedding "
        f"{p['hidden_size']}, tied), validation and test on the first {p['max_eval_sentences']} "
        f"sentences of each. Every cell has the same clip S = {general(clip)}"
        + (
            f": the median of the per-round median update norms of a {len(probe['median_norms'])}"
            f"-round FedAvg run with no bound and no noise "
            f"({', '.join(general(x) for x in probe['median_norms'])})"
            if probe
            else ""
        )
        + ". The no-DP cells clip with the same S (`--bound fixed --bound-norm S`) and add no "
        "noise. For each target epsilon the noise multiplier z is calibrated (fedkey_bench.privacy.runner."
        f"calibrate_noise) so that the server's RDP accountant, after {p['rounds']} rounds of "
        "`SampledWithoutReplacementDpEvent(N, m, Gaussian(z))` under replace-one adjacency, "
        f"reports the target at delta {p['delta']:g}; both strategies get the same z. The noise "
        "added each round is N(0, (z x sensitivity)^2) per coordinate (fedkey.federation.strategies."
        "sensitivity). 'test ppl (best val)' is the test perplexity of the round with the best "
        "validation perplexity. Initial test perplexity (round 0): "
        + ", ".join(sorted({fixed(r["initial_test_ppl"], 1) for r in cell_rows(runs)}))
        + ".",
        "",
        "Every cell (wall seconds, git commit):",
        "",
        *[
            f"- {r['id']}: {r['wall_seconds']:.0f} s, {r.get('git_commit') or '?'}"
            + (" (dirty)" if r.get("git_dirty") else "")
            for r in runs
        ],
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines))
    if cell_rows(runs):
        plot(runs, out / "privacy.png")


def protocol_of(runs: list[dict]) -> dict:
    """What write_report says of the protocol, read back from the cells' recorded settings."""
    c = json.loads(next(r["config"] for r in cell_rows(runs)))  # a JSON string
    keys = ("max_train_tokens", "vocab_size", "clients", "fraction", "rounds", "local_epochs",
            "batch_size", "hidden_size", "max_eval_sentences")  # fmt: skip
    return {**{k: c[k] for k in keys}, "delta": c["dp_delta"]}


def rebuild(folder: Path) -> Path:
    """FOLDER/results.md and privacy.png from FOLDER/results.json; -> results.md."""
    data = json.loads((folder / "results.json").read_text())
    runs = data["runs"]
    protocol = {} if any(r["id"] == "plan" for r in runs) else protocol_of(runs)
    write_report(runs, folder, data["bench_commands"], protocol)
    return folder / "results.md"


if __name__ == "__main__":
    print(rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "privacy"))
