"""The report of `fedkey-bench attacks`: results.md and attacks.png, from results.json alone (no
torch), so it can be rebuilt without running anything: `python -m fedkey_bench.attacks.report OUT`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from fedkey.corpora.dataset import device_name
from fedkey.federation.storage import PLOT_CAP
from fedkey_bench.attacks.matrix import (
    ATTACKS,
    CHECKS,
    DEFENCES,
    POPULATIONS,
    STRATEGIES,
    Cell,
    Protocol,
    cells,
)
from fedkey_bench.common.checkout import RESULTS, shown
from fedkey_bench.common.markdown import markdown_table

NAMES = {"fedavg": "FedAvg", "fedatt": "FedAtt"}
#: The acceptance bar: the backdoor's final top-1 and top-3 success with the defaults under
#: this ...
DEFENDED_MAX = 0.10
#: ... where the undefended run's is over this.
UNDEFENDED_MIN = 0.50
#: A refused upload changes nothing but the cohort: the run's perplexity stays this close to
#: the clean run's (which also averages the attacker's honest-sized shard).
CHECK_TOLERANCE = 0.05


def _f(v, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v == math.inf:  # past the float range: exp(mean NLL) overflowed
        return "inf"
    if abs(v) >= 1e5:  # a diverged run: 6.9e+185, not 186 digits
        return format(v, ".2g")
    return format(v, spec)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _ratio(run: dict, clean: dict | None) -> float | None:
    if clean is None:
        return None
    a, b = run["final_test_ppl"], clean["final_test_ppl"]
    if not math.isfinite(b) or b <= 0 or math.isnan(a):
        return None
    return a / b


def acceptance(runs: dict[str, dict]) -> list[dict]:
    """Per strategy and population: the backdoor's final success without the defence, with the
    clip alone and with the defaults, and whether the acceptance bar is met (defended top-1 and top-3
    < 10% where the undefended top-1 > 50%; "top-1 only" when the top-3 is not)."""
    out = []
    for s in STRATEGIES:
        for n, m in POPULATIONS:
            off = runs.get(Cell(s, "off", n, m, "backdoor").id)
            on = runs.get(Cell(s, "on", n, m, "backdoor").id)
            if off is None or on is None:
                continue
            if off["backdoor_top1"] is None or on["backdoor_top1"] is None:
                continue
            if off["backdoor_top1"] <= UNDEFENDED_MIN:
                verdict = "no test: the undefended backdoor stays under 50%"
            elif on["backdoor_top1"] < DEFENDED_MAX and (on["backdoor_top3"] or 0) < DEFENDED_MAX:
                verdict = "met"
            elif on["backdoor_top1"] < DEFENDED_MAX:
                verdict = "**top-1 only**: top-3 not under 10%"
            else:
                verdict = "**not met**"
            clip = runs.get(Cell(s, "clip", n, m, "backdoor").id)
            out.append({"strategy": s, "population": f"{m} of {n}", "off": off, "on": on,
                        "clip": clip, "verdict": verdict})  # fmt: skip
    return out


def _acceptance_table(rows: list[dict]) -> str:
    header = ["strategy", "attackers", "undefended top-1 / top-3", "clip only",
              "defended top-1 / top-3", "defended test ppl / undefended", "verdict"]  # fmt: skip
    body = []
    for a in rows:
        off, on, clip = a["off"], a["on"], a["clip"]
        body.append([
            NAMES[a["strategy"]],
            a["population"],
            f"{_pct(off['backdoor_top1'])} / {_pct(off['backdoor_top3'])}",
            "-" if clip is None else f"{_pct(clip['backdoor_top1'])} / {_pct(clip['backdoor_top3'])}",
            f"{_pct(on['backdoor_top1'])} / {_pct(on['backdoor_top3'])}",
            f"{_f(on['final_test_ppl'])} / {_f(off['final_test_ppl'])}",
            a["verdict"],
        ])  # fmt: skip
    return markdown_table(header, body)


def _notes(runs: dict[str, dict], rows: list[dict]) -> list[str]:
    """What the acceptance table alone does not say, read from the numbers."""
    notes = []
    for a in rows:
        off = a["off"]
        clean = runs.get(Cell(a["strategy"], "off", off["clients"], off["attackers"], "clean").id)
        ratio = _ratio(off, clean)
        if ratio is not None and ratio > 10:
            notes.append(
                f"- {NAMES[a['strategy']]}, {a['population']}, undefended: the boosted updates "
                f"wrecked the model (final test perplexity {_f(off['final_test_ppl'])}, "
                f"{_f(ratio)}x the clean run's), so its backdoor numbers are those of a broken "
                "model. Model replacement's gamma (eq. 3) is FedAvg's; FedAtt's attention gives "
                "the farthest update the largest weight, so the same boost overshoots."
            )
    notes += [n for a in rows if (n := _filter_note(a, runs)) is not None]
    grows = [
        a
        for a in rows
        if max(a["on"]["backdoor_top1"], a["on"]["backdoor_top3"] or 0.0) >= DEFENDED_MAX
        and (a["on"]["curve"][1][3] or 0.0) < (a["on"]["backdoor_top3"] or 0.0)
    ]
    if grows:
        notes.append(
            "- With the defaults the attacker's boost is cut to the bound, but it is selected in "
            "every round and trains on its poisoned sentences every round: the backdoor's success "
            "grows round after round (top-1 / top-3, "
            + ", ".join(
                f"{NAMES[a['strategy']]} {a['population']}: "
                + " -> ".join(f"{_pct(p[2])} / {_pct(p[3])}" for p in a["on"]["curve"][1:])
                for a in grows
            )
            + ")."
        )
    return notes


def _matrix_table(runs: dict[str, dict]) -> str:
    header = ["strategy", "defence", "clip S / median", "cosine filter", "attackers", "attack",
              "final test ppl",
              "clean run's", "ratio", "refused uploads", "backdoor top-1",
              "backdoor top-3"]  # fmt: skip
    body = []
    for cell in cells():
        r = runs.get(cell.id)
        if r is None or cell.attack in CHECKS:
            continue
        clean = runs.get(cell.clean_id)
        ratio = _ratio(r, clean)
        body.append([
            NAMES[cell.strategy],
            cell.defence,
            "-" if r.get("clip_multiple") is None else _f(r["clip_multiple"]),
            _filter(r),
            cell.population,
            cell.attack,
            _f(r["final_test_ppl"]),
            _f(clean and clean["final_test_ppl"]),
            "-" if ratio is None else f"{_f(ratio)}x",
            r["refused_uploads"],
            _pct(r["backdoor_top1"]),
            _pct(r["backdoor_top3"]),
        ])  # fmt: skip
    return markdown_table(header, body)


def _filter(run: dict) -> str:
    """The matrix's cosine-filter cell: its cut and how many updates it rejected in all ("-": the
    run's server had no filter, or it was off)."""
    if run.get("outlier_z") is None:
        return "-"
    rejected = sum(len(ids) for ids in run.get("outliers_per_round") or [])
    return f"z > {_f(run['outlier_z'], 'g')}: {rejected} rejected"


def _attackers(run: dict) -> set[str]:
    """The attackers' names: the last phones by name (fedkey.device_sim.fleets.thread_fleet); none in a clean run."""
    if run["attack"] == "clean" or not run["attackers"]:
        return set()
    names = sorted(device_name(i, run["clients"]) for i in range(run["clients"]))
    return set(names[len(names) - run["attackers"] :])


def _filter_note(a: dict, runs: dict[str, dict]) -> str | None:
    """How often the cosine filter kept the attackers out of the defended backdoor run, and what
    it cost honest phones there and in the clean run of the same arm."""
    on = a["on"]
    per_round = on.get("outliers_per_round")
    if not on.get("outlier_z") or not per_round:
        return None
    bad = _attackers(on)
    caught = sum(bad <= set(ids) for ids in per_round)
    honest = sum(len(set(ids) - bad) for ids in per_round)
    clean = runs.get(Cell(on["strategy"], "on", on["clients"], on["attackers"], "clean").id)
    line = (
        f"- {NAMES[on['strategy']]}, {a['population']}, defended: the cosine filter rejected "
        f"every attacker in {caught} of {len(per_round)} rounds, and {honest} honest "
        f"phone-round(s) of {len(per_round) * (on['clients'] - on['attackers'])}"
    )
    if clean and clean.get("outliers_per_round"):
        lost = sum(len(ids) for ids in clean["outliers_per_round"])
        line += (
            f"; in the clean run, {lost} of {len(clean['outliers_per_round']) * clean['clients']}"
            f" (test ppl {_f(clean['final_test_ppl'])})"
        )
    return line + "."


def _outliers_table(runs: dict[str, dict]) -> str:
    """Per round, the phones the cosine filter rejected, for the runs that had it."""
    chosen = [runs[c.id] for c in cells() if c.id in runs and runs[c.id].get("outlier_z")]
    if not chosen:
        return ""
    rounds = max(len(r["outliers_per_round"]) for r in chosen)
    header = ["cell", "attackers (the last phones by name)", *(f"r{i + 1}" for i in range(rounds))]
    body = []
    for r in chosen:
        bad = ", ".join(sorted(_attackers(r))) or "-"
        per = [", ".join(ids) or "-" for ids in r["outliers_per_round"]]
        body.append([f"`{r['id']}`", bad, *per, *[""] * (rounds - len(per))])
    return markdown_table(header, body)


def _per_round_table(runs: dict[str, dict]) -> str:
    chosen = [runs[c.id] for c in cells() if c.attack in ("backdoor", "clean") and c.id in runs]
    if not chosen:
        return ""
    rounds = max(len(r["curve"]) for r in chosen)
    header = ["cell", *(f"r{i}" for i in range(rounds))]
    body = []
    for r in chosen:
        points = [f"{_pct(p[2])} / {_pct(p[3])}" for p in r["curve"]]
        body.append([f"`{r['id']}`", *points, *[""] * (rounds - len(points))])
    return markdown_table(header, body)


def _checks_table(runs: dict[str, dict]) -> str:
    header = ["cell", "refused uploads", "expected", "reason", "final test ppl", "clean run's",
              "ratio", "matches the clean run"]  # fmt: skip
    body = []
    for cell in cells():
        r = runs.get(cell.id)
        if r is None or cell.attack not in CHECKS:
            continue
        clean = runs.get(cell.clean_id)
        ratio = _ratio(r, clean)
        ok = ratio is not None and abs(ratio - 1) <= CHECK_TOLERANCE
        expected = r["rounds"] * cell.attackers
        body.append([
            f"`{cell.id}`",
            r["refused_uploads"],
            expected,
            "; ".join(r["refused_reasons"]) or "-",
            _f(r["final_test_ppl"]),
            _f(clean and clean["final_test_ppl"]),
            "-" if ratio is None else f"{_f(ratio, '.3f')}x",
            "yes" if ok and r["refused_uploads"] == expected else "**no**",
        ])  # fmt: skip
    return markdown_table(header, body)


#: The clean and backdoor panel's perplexity axis stops here (a diverged undefended FedAtt run is
#: drawn at the top); the scale / signflip panel's at fedkey.federation.storage.PLOT_CAP.
PPL_TOP = 1e4


def plot(runs: dict[str, dict], out: Path) -> Path | None:
    """attacks.png: per population (columns), test perplexity of the clean and backdoor runs,
    the backdoor's top-1 success, and the test perplexity under scale and signflip, per round."""
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(3, len(POPULATIONS), figsize=(6 * len(POPULATIONS), 11), squeeze=False)
    arms = [(s, d) for s in STRATEGIES for d in DEFENCES]
    styles = {"clean": ":", "backdoor": "-", "scale": "-", "signflip": "--"}
    for col, (n, m) in enumerate(POPULATIONS):
        ppl, success, broken = axes[0][col], axes[1][col], axes[2][col]
        for i, (s, d) in enumerate(arms):
            label = f"{NAMES[s]}, defence {d}"
            for attack, ax, y, top in (("clean", ppl, 1, PPL_TOP), ("backdoor", ppl, 1, PPL_TOP),
                                       ("backdoor", success, 2, 1.0),
                                       ("scale", broken, 1, PLOT_CAP),
                                       ("signflip", broken, 1, PLOT_CAP)):  # fmt: skip
                r = runs.get(Cell(s, d, n, m, attack).id)
                if r is None or r["curve"][-1][y] is None:
                    continue
                points = [p for p in r["curve"] if p[0] > 0 or y == 2]
                values = [min(p[y], top) for p in points]  # diverged runs: at the top
                ax.plot([p[0] for p in points], values, color=f"C{i}",
                        ls=styles[attack], marker="o", ms=3, label=f"{label}, {attack}")  # fmt: skip
        ppl.set_title(f"{m} attacker(s) of {n} phones: clean (dotted) and backdoor runs")
        ppl.set_ylabel(f"test perplexity (past {PPL_TOP:.0e} at the top)")
        success.set_title(f"{m} of {n}: backdoor top-1 success on held-out trigger contexts")
        success.set_ylabel("share of contexts")
        broken.set_title(f"{m} of {n}: scale x100 (solid) and signflip x-10 (dashed)")
        broken.set_ylabel(f"test perplexity (past {PLOT_CAP:.0e} at the top)")
        success.axhline(DEFENDED_MAX, color="grey", lw=0.8)
        success.axhline(UNDEFENDED_MIN, color="grey", lw=0.8, ls="--")
        success.set_ylim(-0.02, 1.02)
        for ax in (ppl, broken):
            ax.set_yscale("log")
        for ax in (ppl, success, broken):
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(True, which="both", alpha=0.3)
            if any(not line.get_label().startswith("_") for line in ax.get_lines()):
                ax.legend(fontsize=6)
    fig.tight_layout()
    path = out / "attacks.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(
    runs: list[dict], bench_commands: list[str], protocol: Protocol | None, plot_path: Path | None
) -> str:
    by_id = {r["id"]: r for r in runs}
    accepted = acceptance(by_id)
    commits = sorted({r["git_commit"][:10] + (" (dirty)" if r["git_dirty"] else "") for r in runs})
    wall = sum(r["wall_seconds"] for r in runs)
    example = next((r["command"] for r in runs if r["attack"] == "backdoor"), None)
    p = protocol or Protocol()
    out = [
        "# fedkey-bench attacks",
        "",
        "Can a few malicious phones wreck the federated model or plant a backdoor in it, and do "
        "the server's default defences stop them? The backdoor's success against FedAvg and "
        "FedAtt with the defaults, with the clip alone and undefended, then every cell.",
        "",
        "## Acceptance",
        "",
        "The backdoor's success after the last round, with the defaults under "
        f"{_pct(DEFENDED_MAX)} (top-1 and top-3) where the undefended run's top-1 exceeds "
        f"{_pct(UNDEFENDED_MIN)}:",
        "",
        _acceptance_table(accepted) or "(no backdoor cells yet)",
        "",
        *_notes(by_id, accepted),
        "",
        "## Every cell",
        "",
        "Final test perplexity against the clean run of the same arm (strategy, defence, phones), "
        "and the backdoor's final success. Clip S / median: the adaptive clip's multiple of the "
        "round's median norm the run's server used (its default then; \"-\": no adaptive clip); "
        'runs of different multiples come from different commits ("How it was run"). Cosine '
        "filter: the outlier filter's cut (modified z-score) and how many updates it rejected "
        'over the run ("-": the run\'s server had no filter, or it was off: the "on" runs '
        "without it come from before it was the default).",
        "",
        _matrix_table(by_id),
        "",
        "## Backdoor success per round (top-1 / top-3)",
        "",
        _per_round_table(by_id),
        "",
        "## The cosine filter's rejections per round",
        "",
        "The phones the server's cosine outlier filter (fedkey.federation.strategies.outliers: mean cosine "
        "to the round's others, modified z-score over the cut) kept out of each round, for the "
        "runs whose server had it (attack cells: the attackers are the last phones by name, "
        "fedkey.device_sim.fleets.thread_fleet; the clean cells have none, so what they lose is honest phones).",
        "",
        _outliers_table(by_id) or "(no run with the filter yet)",
        "",
        "## Refused uploads",
        "",
        f"NaN and wrong-shape uploads are refused by the checks of the HTTP server "
        f"(fedkey.federation.updates.validation), so the run is the clean one without the attacker's update: its "
        f"perplexity is within {_pct(CHECK_TOLERANCE)} of the clean run's.",
        "",
        _checks_table(by_id),
        "",
    ]
    if plot_path is not None:
        out += [f"![per round]({plot_path.name})", ""]
    out += [
        "## How it was run",
        "",
        "Malicious phones against FedAvg and FedAtt, with the server's defaults (bounded influence: "
        "the updates whose direction is an outlier among the round's rejected (cosine filter), "
        "every coordinate of every update trimmed to the range of the round's other updates, "
        "every update clipped to a multiple of the round's median norm, FedAtt's distances "
        "winsorized like the coordinates, attention and FedAvg weights capped), with the clip alone (`--trim 0 --outlier-z 0`) and without any bound (`--bound off`, "
        "the seed papers' server), on the demo corpus with "
        f"every phone selected every round ({p.rounds} rounds, E {p.local_epochs}). Attacks: "
        "`scale` uploads global + 100 x its delta, `signflip` global - 10 x its delta, `backdoor` "
        '(Bagdasaryan et al. 2020, "How To Backdoor Federated Learning") trains on its shard plus '
        "as many poisoned sentences (the start of one of its sentences, then the trigger phrase "
        '"the weather is", then "terrible") and boosts its delta by model replacement (their '
        "eq. 3, gamma = cohort size / attackers in it: 10). `nan` and `shape` send uploads the "
        "server's validation refuses (422). Backdoor success: the share of 200 held-out trigger "
        "contexts (the trigger after the start of a test sentence) whose top-1 / top-3 next-word "
        'suggestion is "terrible"; the clean runs give the clean model\'s own rate (every '
        "cell's own command: results.json).",
        "",
        f"- bench: {'; '.join(f'`{shown(c)}`' for c in bench_commands) or '-'}",
        f"- a cell, e.g.: `{shown(example)}`" if example else "- no backdoor cell yet",
        f"- {len(runs)} runs, {wall / 60:.0f} min of wall time in all; "
        f"devices: {', '.join(sorted({r['device'] for r in runs}))}",
        f"- code: {', '.join(commits)}",
        "",
    ]
    return "\n".join(out)


def write_report(
    runs: list[dict], out: Path, bench_commands: list[str], protocol: Protocol | None = None
) -> Path:
    """OUT/results.md and OUT/attacks.png from results.json's objects."""
    out.mkdir(parents=True, exist_ok=True)
    png = plot({r["id"]: r for r in runs}, out)
    path = out / "results.md"
    path.write_text(markdown(runs, bench_commands, protocol, png))
    return path


__all__ = ["ATTACKS", "acceptance", "markdown", "plot", "write_report"]


if __name__ == "__main__":  # python -m fedkey_bench.attacks.report experiments/results/attacks
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "attacks"
    data = json.loads((folder / "results.json").read_text())
    print(write_report(data["runs"], folder, data["bench_commands"]))
