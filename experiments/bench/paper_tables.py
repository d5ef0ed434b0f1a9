"""The tables of `fedkey-bench paper`'s report: the language-model table of every ranking section
(lm_table), those the old suites feed (the seed papers' table at the cpu-8round cut, privacy,
beyond, lr, full, and the code suite's column-measure evidence), the formatting helpers every
table shares, and the perplexity curves.

Written from results.json's objects alone (no torch), so a report can be rebuilt or tested
without running anything.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from bench.paper_old_suites import SEEDS, SEEDS_CLIENT_STEPS, SEEDS_DP
from bench.paper_spec import command_flag
from bench.report import markdown_table

DATASET_NAMES = {"ptb": "PTB", "wikitext-2": "WikiText-2"}
NAMES = {**DATASET_NAMES, "demo": "demo corpus"}
#: How each partition's phones are described in the tables.
PARTITIONS = {"iid": "100 IID phones", "articles": "100 phones of whole articles",
              "user": "one phone per owner"}  # fmt: skip
#: Issue 5's targets at C = 0.1: 10% below the best seed number.
TARGETS = {"ptb": 102.0, "wikitext-2": 65.0}


def _f(v, spec=".2f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def _key(v) -> float:
    """A perplexity to sort by: a missing or infinite one last."""
    return v if isinstance(v, (int, float)) and math.isfinite(v) else math.inf


def _c(fraction) -> str:
    return "0.1->0.5 (AdaFL)" if fraction is None else f"{fraction:g}"


def _pct(ours, ref) -> str:
    if ours is None or ref is None or not ref:
        return "-"
    return f"{(ours / ref - 1) * 100:+.1f}%"


def _x(ours, ref) -> str:
    if ours is None or ref is None or not ref:
        return "-"
    return f"{ours / ref:.2f}x"


#: results.json's runs stopped at a time limit (bench.paper_results.Bench.begun): "<preset>/<run id>" ->
#: [rounds done, rounds, and where the bench noted them, the best validation perplexity so far
#: and its round].
Begun = Mapping[str, Sequence[float]]


def _where(begun: Sequence[float] | None, kind: str) -> str:
    """Where a run not done stands: not run yet, or how far one stopped at a time limit got and
    its best validation perplexity so far."""
    if begun is None:
        return "not run yet"
    unit = "epoch" if kind == "central" else "round"
    at = f"begun: {unit} {begun[0]:g} of {begun[1]:g}"
    if len(begun) < 4:
        return at
    return f"{at} (best val ppl so far {begun[2]:.2f}, {unit} {begun[3]:g})"


def _ratio(ours, theirs) -> str:
    if ours is None or theirs is None or not theirs:
        return "-"
    return f"{(ours / theirs - 1) * 100:+.0f}%"


def _mb(n) -> str:
    return f"{n / 1e6:,.0f}"


def _diverged(r: dict) -> bool:
    """No round beat the initial model on validation: the reported model is the untrained one."""
    return r["kind"] == "federated" and r["best_round"] == 0


def held_at(run: dict, cs: Collection[float], default: float | None) -> float | None:
    """The C whose centralized model `run` is held against: its own C where a centralized model
    of that C is among `cs`, else `default` (the reference model's C; FedSGD's C 1 and AdaFL's
    rising C saw more examples than any centralized model that was run)."""
    return run["fraction"] if run["fraction"] in cs else default


def lm_table(runs: list[dict], central: dict | None, ngram: dict | None,
             waiting: Sequence[tuple[str, float | None, str]] = (),
             chance: Mapping[str, str] | None = None) -> str:  # fmt: skip
    """One row per method: test perplexity and the keyboard metrics, against the centralized
    model and the n-gram; the reference rows first, then the federated runs held against them,
    best first; each other centralized model (another C's) followed by its C's runs likewise;
    then the runs not done yet (`waiting`: (method, C of a federated run or None, where it
    stands)).
    `chance` (bench.paper_seeds.seed_notes), where given, adds its cells by run id."""
    header = ["method", "C", "test ppl", "vs centralized", "top-1", "top-1 vs 3-gram", "top-3",
              "KSR", "best round / rounds", *(["seed to seed"] if chance else [])]  # fmt: skip
    # A run is held against the centralized model of as many examples as its C (C 0.5: the gpu
    # preset's); one without against `central`, named (held_at).
    same = {r["fraction"]: r["test_ppl"] for r in [*runs, *filter(None, [central])]
            if r["kind"] == "central"}  # fmt: skip
    cp, cc = (central["test_ppl"], central["fraction"]) if central else (None, None)
    nt = ngram["top1"] if ngram else None
    # by id: a superseded run comes here as a relabelled copy (_marked), the reference too
    others = [r for r in runs if r["kind"] == "central" and r["id"] != (central or {}).get("id")]
    later = sorted({r["fraction"] for r in others} - {cc}, key=_key)  # other C's own models
    fed = sorted((r for r in runs if r["kind"] == "federated"), key=lambda r: _key(r["test_ppl"]))

    def at(c):  # the federated runs held against the centralized model of C c
        return [r for r in fed if held_at(r, later, cc) == c]

    order = [*filter(None, [central, ngram]), *(r for r in others if r["fraction"] not in later)]
    order += at(cc)
    for c in later:
        order += [r for r in others if r["fraction"] == c] + at(c)
    rows = []
    for r in order:
        ref = r["kind"] != "federated"
        label = f"**{r['method']}**" if ref else r["method"]
        rounds = "-" if r["kind"] == "ngram" else f"{r['best_round']} / {r['rounds']}"
        home = held_at(r, same, cc) if r["kind"] == "federated" else cc
        fewer = home != r["fraction"] and r["kind"] == "federated" and cc is not None
        base = same.get(home, cp)
        vs = _pct(r["test_ppl"], base) + (f" vs C {cc:g}'s" if fewer else "")
        rows.append([label, _c(r["fraction"]) if r["kind"] == "federated" else "-",
                     _f(r["test_ppl"]), vs, _f(r["top1"], ".3f"),
                     _x(r["top1"], nt), _f(r["top3"], ".3f"), _f(r["ksr"], ".3f"), rounds,
                     *([chance.get(r["id"], "-")] if chance else [])])  # fmt: skip
    rows += [[m, _c(c) if c else "-", where, *[""] * (len(header) - 3)] for m, c, where in waiting]
    return markdown_table(header, rows)


def by_central(runs: list[dict]) -> dict[str, list[dict]]:
    """A ranking figure's runs, one part per C that has its own centralized model ("": one part
    where one C or none has): that model and the federated runs held against it, as lm_table
    holds them (a run at a C without one, FedSGD's or AdaFL's, in the first C's part)."""
    cs = sorted({r["fraction"] for r in runs if r["kind"] == "central"}, key=_key)
    if len(cs) < 2:
        return {"": runs}
    return {f"_c{c:g}": [r for r in runs if held_at(r, cs, cs[0]) == c or r["kind"] == "ngram"]
            for c in cs}  # fmt: skip


def paper_table(runs: list[dict]) -> str:
    """One row per (C, method): each dataset's test perplexity beside the seed papers' number."""
    keyed = {(r["method"], r["fraction"], r["dataset"]): r for r in runs}
    order = []
    for r in runs:
        if (r["method"], r["fraction"]) not in order:
            order.append((r["method"], r["fraction"]))
    rank = {1.0: 0, 0.1: 1, 0.5: 2, None: 3}  # FedSGD, C 0.1, C 0.5, AdaFL's own fraction
    order.sort(key=lambda k: rank.get(k[1], 4))
    header = ["C", "method"]
    for ds in DATASET_NAMES:
        header += [f"{DATASET_NAMES[ds]} ours", "seed papers", "ours vs seed papers"]
    rows = []
    for method, c in order:
        row = [_c(c), method]
        for ds in DATASET_NAMES:
            run = keyed.get((method, c, ds))
            theirs = SEEDS.get((method, c), {}).get(ds)
            ours = run["test_ppl"] if run else None
            row += [_f(ours) + (" (diverged)" if run and _diverged(run) else ""), _f(theirs),
                    _ratio(ours, theirs)]  # fmt: skip
        rows.append(row)
    table = markdown_table(header, rows)
    if any(_diverged(r) for r in runs):
        table += ("\n\n(diverged): every round's model was worse on validation than the initial "
                  "one, so the reported model is the untrained one (perplexity ~ the vocabulary size).")  # fmt: skip
    return table


def detail_table(runs: list[dict]) -> str:
    """Every run: the numbers behind the summary and what each cost."""
    header = ["run", "test ppl", "best val ppl", "best round", "final test ppl", "top-1",
              "top-3", "KSR", "rounds to ppl < 90", "updates", "uplink MB", "downlink MB",
              "epsilon", "wall s"]  # fmt: skip
    rows = [
        [
            f"{r['suite']}: {DATASET_NAMES.get(r['dataset'], r['dataset'])}, {r['method']}"
            + (f", C {_c(r['fraction'])}" if r["kind"] == "federated" else ""),
            _f(r["test_ppl"]),
            _f(r["best_val_ppl"]),
            r["best_round"],
            _f(r["final_test_ppl"]),
            _f(r["top1"], ".3f"),
            _f(r["top3"], ".3f"),
            _f(r["ksr"], ".3f"),
            r["rounds_to_ppl_90"] if r["rounds_to_ppl_90"] is not None else "never",
            r["updates"],
            _mb(r["uplink_bytes"]),
            _mb(r["downlink_bytes"]),
            _f(r["epsilon"]),
            _f(r["wall_seconds"], ".0f"),
        ]
        for r in runs
    ]
    return markdown_table(header, rows)


def privacy_tables(runs: list[dict]) -> str:
    parts = []
    rand = [r for r in runs if r["group"].startswith("beta=")]
    if rand:
        betas = sorted(SEEDS_DP)
        header = ["method"] + [f"beta = {b:g}" for b in betas]
        rows = []
        for i, method in enumerate(("FedAvg", "FedAtt")):
            ours = {r["group"]: r["test_ppl"] for r in rand if r["method"].startswith(method)}
            rows.append([f"{method} (ours)"] + [_f(ours.get(f"beta={b:g}")) for b in betas])
            rows.append(
                [f"{method} (FedAtt paper, Ji et al. 2019, Table III)"]
                + [_f(SEEDS_DP[b][i]) for b in betas]
            )
        ds = DATASET_NAMES.get(rand[0]["dataset"], rand[0]["dataset"])
        parts.append(
            f"Randomization (each phone adds beta * N(0, 1) to its weights; no formal guarantee), "
            f"{ds}, C 0.1, test perplexity:\n\n" + markdown_table(header, rows)
        )
    dp = [r for r in runs if r["group"].startswith("z=")]
    if dp:
        header = ["noise multiplier z", "clip S", "C", "epsilon (delta 1e-5)", "test ppl"]
        rows = [
            [
                r["group"][2:],
                command_flag(r["command"], "--dp-clip"),
                _c(r["fraction"]),
                _f(r["epsilon"]),
                _f(r["test_ppl"]),
            ]  # fmt: skip
            for r in sorted(dp, key=lambda r: float(r["group"][2:]))
        ]
        parts.append(
            "DP-FedAvg (clip each update to S, N(0, (z S)^2) on the sum, RDP accountant with "
            "sampling rate C; epsilon after the last round):\n\n" + markdown_table(header, rows)
        )
    return "\n\n".join(parts)


def beyond_table(runs: list[dict], paper: list[dict]) -> str:
    """Each improvement beside the best seed method's number, the ceiling and our best paper run."""
    header = [
        "dataset",
        "row",
        "test ppl",
        "vs best seed",
        "vs centralized",
        "top-1",
        "top-3",
        "KSR",
    ]
    rows = []
    for ds in DATASET_NAMES:
        mine = [r for r in runs if r["dataset"] == ds]
        if not mine:
            continue
        best_seed = min(v[ds] for (m, c), v in SEEDS.items() if c == 0.1)
        central = next((r["test_ppl"] for r in mine if r["kind"] == "central"), None)
        base = [r for r in paper if r["dataset"] == ds and r["fraction"] == 0.1]
        if base:
            best = min(base, key=lambda r: r["test_ppl"])
            mine = [{**best, "method": f"best paper run at C 0.1: {best['method']}"}] + mine
        for r in mine:
            rows.append([DATASET_NAMES[ds], r["method"], _f(r["test_ppl"]),
                         _ratio(r["test_ppl"], best_seed), _ratio(r["test_ppl"], central),
                         _f(r["top1"], ".3f"), _f(r["top3"], ".3f"), _f(r["ksr"], ".3f")])  # fmt: skip
    return markdown_table(header, rows)


def lr_table(runs: list[dict]) -> str:
    """Test perplexity after each epoch of the centralized runs with the seed papers' lr and
    ours."""
    epochs = max(len(r["curve"]) - 1 for r in runs)
    header = ["optimizer (centralized, all of PTB)"] + [
        f"after epoch {e}" for e in range(1, epochs + 1)
    ]
    rows = [[r["method"]] + [_f(p[2]) for p in r["curve"][1:]] for r in runs]
    seeds = {m: v["ptb"] for (m, c), v in SEEDS.items() if c == 0.1}
    return (
        f"One epoch is ~4.2k SGD steps of 10 sentences; one client of the seed papers' protocol "
        f"takes {SEEDS_CLIENT_STEPS:,} (50 rounds x E 5 x 42 batches), and FedAvg of IID clients "
        f"at a small lr moves about as far as one client does. The seed papers report "
        f"{_f(seeds['FedAvg'])} for FedAvg and {_f(min(seeds.values()))} for their best method "
        f"on PTB at C 0.1.\n\n" + markdown_table(header, rows)
    )


def code_table(runs: list[dict]) -> str:
    """The code suite: the seed papers' measure (column perplexity) beside their table, and the
    sentence-level perplexity of the same models."""
    header = ["dataset", "C", "method", "column ppl (their measure)", "seed papers",
              "ours vs seed papers", "sentence ppl of the same model", "best round"]  # fmt: skip
    rows = [[DATASET_NAMES[r["dataset"]], _c(r["fraction"]) if r["kind"] == "federated" else "-",
             r["method"], _f(r.get("col_test_ppl")),
             _f(r["seed_ppl"]), _ratio(r.get("col_test_ppl"), r["seed_ppl"]), _f(r["test_ppl"]),
             str(r["best_round"])] for r in runs]  # fmt: skip
    return (
        "The seed papers' published code (fed-att) gave its DataLoader lists of token ids of "
        "unequal length; the default collate of the PyTorch of its day transposed each batch and "
        "cut it to the shortest sentence (pytorch/pytorch#23141), so it trained on, and scored, "
        "*columns*: token j of every sentence in a batch of 10 (training) or 128 (evaluation), "
        "the first column all start tokens (`models/batching.py: column_batches`). These runs "
        "train that way (`--batching columns`) with the seed papers' whole protocol (all data, "
        "50 rounds, E 5, lr 0.01, no clipping) and pick the best round by that measure, as their "
        "code did. The position-only unigram knows nothing but where a word stands in its "
        "sentence (`fedkey ngram --positional`): on columns, where the context is the same "
        "position of other sentences, that is all a model can learn. The sentence ppl column "
        "is the same model scored as a language model.\n\n" + markdown_table(header, rows)
    )


def old_targets_table(runs: list[dict]) -> str:
    """Issue 5's targets (the old suites): best federated run at C = 0.1 vs 10% under the best seed and the
    centralized model trained on the same data (the beyond suite's for the preset's data, the lr
    suite's at the same lr for the full suite's)."""
    header = ["dataset", "training data", "our best federated at C 0.1", "test ppl", "target",
              "met", "centralized", "within 5% of it"]  # fmt: skip
    scopes = (("the preset's", ("paper", "beyond"), "beyond"), ("all", ("full",), "lr"))
    rows = []
    for ds, target in TARGETS.items():
        for scope, suites, central_suite in scopes:
            fed = [r for r in runs if r["dataset"] == ds and r["kind"] == "federated"
                   and r["fraction"] == 0.1 and r["suite"] in suites]  # fmt: skip
            if not fed:
                continue
            best = min(fed, key=lambda r: r["test_ppl"])
            central = [r for r in runs if r["dataset"] == ds and r["kind"] == "central"
                       and r["suite"] == central_suite]  # fmt: skip
            if central_suite == "lr":  # the one with the federated runs' lr
                central = [r for r in central if _lr(r) == _lr(best)]
            cp = central[0]["test_ppl"] if central else None
            rows.append([DATASET_NAMES[ds], scope, best["method"], _f(best["test_ppl"]),
                         f"<= {target:g}", "yes" if best["test_ppl"] <= target else "no", _f(cp),
                         "-" if cp is None else ("yes" if best["test_ppl"] <= 1.05 * cp else "no")])  # fmt: skip
    return markdown_table(header, rows)


def _lr(r: dict) -> float | None:
    lr = command_flag(r["command"], "--lr")
    return None if lr == "-" else float(lr)


#: Perplexities above this are left out of the curves: a diverged run's (1e283 at round 4 of a
#: WikiText-2 sweep run at server lr 10) would stretch the log axis past what matplotlib can
#: label. A uniform guess over our largest vocabulary (WikiText-2's 33k words) scores 33,278.
CEILING = 1e5


def plot_curves(
    runs: list[dict], out: Path, name: str, title: str, curve: str = "curve", split: str = "test"
) -> Path | None:
    """Test (or validation: ``split="val"``) perplexity per round, one line per run (log scale;
    points above CEILING left out); `curve` names the results.json field (col_curve: the seed
    papers' column perplexity). A run may name its own line as "line": (colour index, line
    style), as the seeds' figure does (a colour per row, a style per seed)."""
    at = 1 if split == "val" else 2
    runs = [dict(r, curve=r[curve]) for r in runs if len(r.get(curve, ())) > 1]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, r in enumerate(runs):
        x = [p[0] for p in r["curve"]]
        y = [p[at] if p[at] is not None and p[at] <= CEILING else math.nan for p in r["curve"]]
        colour, ls = r.get("line", (i % 10, "-" if i < 10 else "--"))
        ax.plot(x, y, color=f"C{colour % 10}", ls=ls,
                label=r["method"] + ("" if r["kind"] != "federated" else f" (C {_c(r['fraction'])})"))  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("round (epoch for the centralized model)")
    measure = "validation" if split == "val" else "test"
    ax.set_ylabel(("column " if curve == "col_curve" else "") + f"{measure} perplexity (log scale)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
