"""The page of `fedkey-bench privacy` for a workload with a plan (the real IRC
population, mechanisms gaussian / tree / blt, simulated deployment cohorts): results.md (the
table with perplexity and top-1, the targets checked from the numbers, the cells not run yet,
then how it was made) and privacy.png. Rebuilt from results.json alone by
fedkey_bench.privacy.report.rebuild, which sends a results.json with a "plan" record here."""

from __future__ import annotations

from pathlib import Path

from fedkey_bench.common.checkout import shown
from fedkey_bench.privacy.numbers import fixed, general, ppl

STRATEGY_NAMES = {
    "fedavg": "DP-FedAvg",
    "fedatt-fixed": "DP-FedAtt (fixed)",
    "fedatt": "DP-FedAtt (softmax)",
}
MECHANISM_ORDER = ("gaussian", "tree", "blt")
#: The targets: at epsilon <= 8 on the real population, within 15% of the non-private
#: perplexity and 10% of its top-1; DP-FedAtt within 5% of DP-FedAvg's perplexity.
PPL_SLACK, TOP1_SLACK, FEDATT_SLACK, TARGET_EPSILON = 0.15, 0.10, 0.05, 8.0


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _rel_pct(x) -> str:
    """A relative change: a percentage, or the factor past 10x (a diverged model)."""
    if x is not None and x > 9:
        return f"{x + 1:.3g}x"
    return _pct(x)


def _key(r: dict) -> tuple:
    s = list(STRATEGY_NAMES).index(r["strategy"]) if r["strategy"] in STRATEGY_NAMES else 99
    mech = r.get("mechanism") or "gaussian"
    e = r.get("target_epsilon")
    return (
        s,
        -1 if e is None else MECHANISM_ORDER.index(mech) if mech in MECHANISM_ORDER else 9,
        r.get("noise_cohort") or 0,
        -1 if e is None else -e,
    )


def cell_rows(runs: list[dict]) -> list[dict]:
    """The table's cells (not the probe, not the plan): by strategy, mechanism, simulated
    cohort, then epsilon from the weakest guarantee down (no DP first)."""
    return sorted((r for r in runs if "strategy" in r), key=_key)


def _nodp(runs: list[dict]) -> dict[str, dict]:
    return {r["strategy"]: r for r in cell_rows(runs) if r["target_epsilon"] is None}


def _rel(x, base) -> float | None:
    return None if x is None or not base else x / base - 1


def table(runs: list[dict]) -> str:
    """The privacy-utility table; the relative columns are against the same strategy without
    DP (same clip): perplexity up, top-1 down are the cost."""
    base = _nodp(runs)
    lines = [
        "| strategy | mechanism | noise of a cohort of | target epsilon | epsilon (delta) | z "
        "| noise std / round | test ppl | top-1 | ppl vs no DP | top-1 vs no DP "
        "| best-val round: test ppl |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cell_rows(runs):
        nodp = r["target_epsilon"] is None
        b = base.get(r["strategy"])
        delta = r.get("deployment_delta") if r.get("noise_cohort") else None
        eps = "-" if nodp else f"{fixed(r['epsilon'])}" + (f" ({delta:.2g})" if delta else "")
        cohort = f"{r['noise_cohort']:,} (simulated)" if r.get("noise_cohort") else "ours"
        z = fixed(r["noise_multiplier"], 3) + (
            f" (z' {r['deployment_z']:.3f})" if r.get("noise_cohort") else ""
        )
        target = "-" if nodp else f"{r['target_epsilon']:g}"
        d_ppl = "" if nodp or not b else _rel_pct(_rel(r["final_test_ppl"], b["final_test_ppl"]))
        d_top = (
            "" if nodp or not b else _pct(_rel(r.get("final_bar_top1"), b.get("final_bar_top1")))
        )
        name = STRATEGY_NAMES.get(r["strategy"], r["strategy"])
        lines.append(
            f"| {name.removeprefix('DP-') if nodp else name} "
            f"| {'no DP (same clip)' if nodp else r.get('mechanism', 'gaussian')} "
            f"| {'-' if nodp else cohort} | {target} "
            f"| {eps} | {'-' if nodp else z} | {general(r['noise_std'])} "
            f"| {ppl(r['final_test_ppl'])} | {_pct(r.get('final_bar_top1'))} "
            f"| {d_ppl} | {d_top} | {r['best_round']}: {ppl(r['best_test_ppl'])} |"
        )
    return "\n".join(lines)


def targets(runs: list[dict], delta: float | None) -> str:
    """The two targets, checked from the table's numbers (final-round models)."""
    rows = cell_rows(runs)
    base = _nodp(runs)
    real = [
        r for r in rows
        if r["target_epsilon"] is not None and not r.get("noise_cohort")
        and r["epsilon"] is not None and r["epsilon"] <= TARGET_EPSILON * 1.005
    ]  # fmt: skip
    parts = []
    hits = []
    for r in real:
        b = base.get(r["strategy"])
        if b is None or r.get("final_bar_top1") is None or not b.get("final_bar_top1"):
            continue
        dp_ppl = _rel(r["final_test_ppl"], b["final_test_ppl"])
        dp_top = _rel(r["final_bar_top1"], b["final_bar_top1"])
        if dp_ppl is not None and dp_top is not None:
            ok = dp_ppl <= PPL_SLACK and dp_top >= -TOP1_SLACK
            hits.append((ok, dp_ppl, r))
            if ok:
                parts.append(
                    f"{r['id']} meets it (perplexity {_rel_pct(dp_ppl)}, top-1 {_pct(dp_top)})"
                )
    if hits:
        best = min(hits, key=lambda h: h[1])[2]
        head = (
            f"Target 1 (epsilon <= 8 at delta {general(delta)} = 1/N^1.1 on the real population, "
            "within 15% of the same model's non-private perplexity and 10% of its top-1): "
        )
        parts = [head + ("; ".join(parts) if parts else f"no cell meets it (the closest: {best['id']}, perplexity {_pct(min(h[1] for h in hits))})") + "."]  # fmt: skip
    else:
        parts = ["Target 1 (epsilon <= 8 on the real population): no DP cell with its no-DP "
                 "baseline has run yet."]  # fmt: skip
    sims = [
        f"{r['id']} perplexity {_rel_pct(_rel(r['final_test_ppl'], b['final_test_ppl']))}, top-1 "
        f"{_pct(_rel(r.get('final_bar_top1'), b.get('final_bar_top1')))}"
        for r in rows
        if r.get("noise_cohort") and (b := base.get(r["strategy"])) is not None
    ]
    if sims:
        parts.append(
            "With a simulated deployment cohort's noise (not this population, so not the "
            "target): " + "; ".join(sims) + "."
        )
    pairs = []
    for r in rows:
        if r["strategy"] == "fedavg" or r["target_epsilon"] is None:
            continue
        twin = next((a for a in rows if a["strategy"] == "fedavg" and _same_noise(a, r)), None)
        rel = None if twin is None else _rel(r["final_test_ppl"], twin["final_test_ppl"])
        if rel is not None:
            pairs.append(
                f"{r['id']} {_rel_pct(rel)} ({'met' if rel <= FEDATT_SLACK else 'missed'})"
            )
    parts.append(
        "Target 2 (DP-FedAtt within 5% of DP-FedAvg's perplexity at the same epsilon, or "
        "better): " + ("; ".join(pairs) if pairs else "no pair has run yet") + "."
    )
    return " ".join(parts)


def _same_noise(a: dict, b: dict) -> bool:
    keys = ("target_epsilon", "mechanism", "noise_cohort")
    return all(a.get(k) == b.get(k) for k in keys)


def plot(runs: list[dict], path: Path) -> None:
    """Test perplexity against epsilon: one line per strategy and mechanism (our cohort),
    hollow markers for the simulated cohorts, dashed lines without DP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = cell_rows(runs)
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    styles = {"gaussian": "o", "tree": "s", "blt": "^"}
    for i, s in enumerate(STRATEGY_NAMES):
        color = f"C{i}"
        for mech, style in styles.items():
            for sim in (False, True):
                pts = sorted(
                    (r["epsilon"], r["final_test_ppl"]) for r in rows
                    if r["strategy"] == s and r.get("mechanism") == mech
                    and r["target_epsilon"] is not None and bool(r.get("noise_cohort")) == sim
                )  # fmt: skip
                if pts:
                    label = f"{STRATEGY_NAMES[s]}, {mech}" + (", simulated cohort" if sim else "")
                    ax.plot(*zip(*pts, strict=True), marker=style, color=color, label=label,
                            mfc="none" if sim else color, linestyle=":" if sim else "-")  # fmt: skip
        base = _nodp(runs).get(s)
        if base is not None:
            ax.axhline(base["final_test_ppl"], color=color, linestyle="--",
                       label=f"{STRATEGY_NAMES[s]}, no DP")  # fmt: skip
    ax.set_xscale("log", base=2)
    targets = sorted({r["target_epsilon"] for r in rows if r["target_epsilon"] is not None})
    ax.set_xticks(targets, [f"{e:g}" for e in targets])
    ax.set_xlabel("epsilon (simulated cohorts: the deployment's)")
    ax.set_ylabel("test perplexity (final round)")
    ax.set_yscale("log")
    ax.set_title("Privacy-utility on the IRC population")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _scale_note(rows: list[dict], p: dict) -> str:
    """How long a cell took, and so why the run is as short as it is."""
    walls = sorted(r["wall_seconds"] for r in rows if "wall_seconds" in r)
    if not walls:
        return ""
    mid = walls[len(walls) // 2]
    return (
        f"Scale: a cell of {p['rounds']} rounds took about {mid / 60:.0f} minutes "
        f"(about {mid / p['rounds']:.0f} s a round with its setup, one process, "
        f"`--workers {p['workers']}`) on the shared 2-core machine, so the run is far shorter than production's hundreds of rounds "
        "with cohorts of hundreds to thousands; the model is still learning at its last round, "
        "and its perplexity and top-1 are those of an early model."
    )


def _noise_ratio(rows: list[dict]) -> str:
    """The fixed normalizer's noise over DP-FedAvg's, from the cells run under the same noise."""
    ratios = [
        r["noise_std"] / a["noise_std"]
        for r in rows
        if r["strategy"] == "fedatt-fixed" and r.get("noise_std")
        for a in rows
        if a["strategy"] == "fedavg" and a.get("noise_std") and _same_noise(a, r)
    ]
    return f": {ratios[0]:.2f}x DP-FedAvg's noise here" if ratios else ""


def _share(cohorts: list[int], n: int) -> str:
    """How much of our population of n the simulated cohorts would take each round."""
    return ", ".join("more than all" if c >= n else f"{c / n:.0%}" for c in cohorts)


def not_run(runs: list[dict], plan: dict) -> list[str]:
    """The planned cells without a result yet."""
    have = {r["id"] for r in runs}
    return [c["id"] for c in plan["cells"] if c["id"] not in have]


def write_grid_report(runs: list[dict], out: Path, commands: list[str]) -> None:
    """OUT/results.md and privacy.png from results.json's runs (with the plan record)."""
    plan = next(r for r in runs if r["id"] == "plan")
    p, rows = plan["protocol"], cell_rows(runs)
    probe = next((r for r in runs if r["id"].startswith("probe")), None)
    clip = p["clip"] if p["clip"] is not None else (probe or {}).get("clip")
    missing = not_run(runs, plan)
    m, n = plan["cohort"], p["clients"]
    lines = [
        "# Privacy-utility on the IRC population (`fedkey-bench privacy --workload irc`)",
        "",
        "What does differential privacy cost a keyboard model trained on real people's typing: "
        "test perplexity and top-1 of DP-FedAvg and DP-FedAtt under the gaussian (DP-FedAvg), "
        "tree and BLT (DP-FTRL) mechanisms at each target epsilon, against the same runs "
        "without noise.",
        "",
        table(runs),
        "",
        targets(runs, plan["delta"]),
        "",
        f"Not run yet ({len(missing)} of {len(plan['cells'])} planned cells; the bench resumes "
        "them): " + (", ".join(missing) if missing else "none") + ".",
        "",
        "Command" + ("s" if len(commands) > 1 else "") + ":",
        "",
        *[f"    {shown(c)}" for c in commands],
        "",
        "## How it was made",
        "",
        f"Ubuntu IRC chat, one phone per sender: the {n:,} senders with the most training "
        f"messages (`--partition user --clients {n}`), vocabulary {p['vocab_size']:,}, "
        f"validation and test on the first {p['max_eval_sentences']} messages of each. "
        f"Cohorts of {m} phones (C = {p['fraction']}), {p['rounds']} rounds of "
        f"{p['local_epochs']} local epoch (batches of {p['batch_size']} messages, SGD lr "
        f"{p['lr']}, momentum 0.5), a one-layer GRU of {p['hidden_size']} units (embedding "
        f"{p['hidden_size']}, tied). Every cell has the same clip S = {general(clip)}"
        + (
            f" (the median of the per-round median update norms of a "
            f"{len(probe['median_norms'])}-round FedAvg run with no bound and no noise)"
            if probe and p["clip"] is None
            else ""
        )
        + "; the no-DP cells clip with it too (`--bound fixed`) and add no noise. "
        f"Delta is 1/N^1.1 = {plan['delta']:.3g} for this N = {n:,} (fedkey.federation.privacy.gaussian."
        "population_delta). For each target epsilon the noise multiplier z is calibrated "
        "(fedkey_bench.privacy.runner.calibrate_noise) on the accountant the server uses: gaussian, "
        f"{p['rounds']} rounds of fixed-size sampling of m of N under replace-one adjacency; "
        "tree and blt, zCDP at the default minimum separation b = floor(N / m) (fedkey.federation.privacy.tree."
        f"tree_rho, fedkey.federation.privacy.blt.blt_rho; here b = {max(1, n // m)}, so each phone trains at "
        f"most {-(-p['rounds'] // max(1, n // m))} time(s) in the run). DP-FedAtt (fixed) is "
        "FedAtt with the fixed normalizer, whose sensitivity is DP-FedAvg's "
        "2S/m times FedAtt's server step (fedkey.federation.strategies.sensitivity)"
        + _noise_ratio(rows)
        + "; DP-FedAtt (softmax) is the paper's attention, whose sensitivity is several times "
        "larger. Both strategies get the same z. 'noise std / round' is z x sensitivity per "
        "coordinate (the tree's nodes; its prefix sums carry up to log2 T of them). 'test ppl' "
        "and 'top-1' are the last round's model; top-1 is the share of test words that are "
        "the model's likeliest word a suggestion bar can show (never </s> or <unk>: the "
        "metrics' bar_top1, what production keyboards report as top-1 recall).",
        "",
        f"This population is too small for production's cohorts (thousands a round: DESIGN.md "
        f"section 3): a cohort of {', '.join(f'{c:,}' for c in p['noise_cohorts'])} would be "
        f"{_share(p['noise_cohorts'], n)} of its {n:,} phones, every round, leaving no sampling "
        "or separation to amplify privacy (b = floor(N / M) = "
        f"{', '.join(str(max(1, n // c)) for c in p['noise_cohorts'])}). "
        "The rows 'noise of a cohort of M (simulated)' (pfl-research's noise_cohort_size) train "
        f"the cohort of {m} with the noise a deployment of cohort M would add: its population "
        "N' = N M / m keeps this sampling rate (and separation), its delta is 1/N'^1.1, its "
        "accountant gives z' for the target epsilon, and its noise on its average, "
        f"z' x 2S / M, is exactly what this cohort gets with z = z' m / M ({m}/M of z'). Their "
        "epsilon is the deployment's (the run's own server accounts a far larger one for this "
        "population at that small z: `server_epsilon` in results.json); the training signal "
        f"is still the {m} phones' average, so these rows show what the noise costs, not what "
        "a larger cohort's averaging would gain.",
        "",
        _scale_note(rows, p),
        "",
        "Every run (wall seconds, git commit):",
        "",
        *[
            f"- {r['id']}: {r['wall_seconds']:.0f} s, {r.get('git_commit') or '?'}"
            + (" (dirty)" if r.get("git_dirty") else "")
            for r in runs
            if "wall_seconds" in r
        ],
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines))
    if rows:
        plot(runs, out / "privacy.png")
