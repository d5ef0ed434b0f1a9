"""The tables of `fedkey-bench paper`'s report: the language-model table of every ranking section
(lm_table), the code suite's column-measure evidence (code_table), the formatting helpers every
table shares, and the perplexity curves.

Written from results.json's objects alone (no torch), so a report can be rebuilt or tested
without running anything.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from fedkey_bench.common.markdown import markdown_table

DATASET_NAMES = {"ptb": "PTB", "wikitext-2": "WikiText-2"}
NAMES = {**DATASET_NAMES, "demo": "demo corpus", "nus-sms": "NUS SMS", "ubuntu-irc": "Ubuntu IRC"}
#: How each partition's phones are described in the tables.
PARTITIONS = {"iid": "100 IID phones", "articles": "100 phones of whole articles",
              "user": "one phone per owner"}  # fmt: skip

#: Every run's figures and command, beside results.md (results.json holds all of it too).
RUNS_CSV = "runs.csv"


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


#: results.json's runs stopped at a time limit (fedkey_bench.paper.results.Bench.begun): "<preset>/<run id>" ->
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
    `chance` (fedkey_bench.paper.seeds.seed_notes), where given, adds its cells by run id."""
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
        "cut it to the shortest sentence (https://github.com/pytorch/pytorch/issues/23141), so it trained on, and scored, "
        "*columns*: token j of every sentence in a batch of 10 (training) or 128 (evaluation), "
        "the first column all start tokens (`models/batching.py: column_batches`). These runs "
        "train that way (`--batching columns`) with the seed papers' whole protocol (all data, "
        "50 rounds, E 5, lr 0.01, no clipping) and pick the best round by that measure, as their "
        "code did. The position-only unigram knows nothing but where a word stands in its "
        "sentence (`fedkey ngram --positional`): on columns, where the context is the same "
        "position of other sentences, that is all a model can learn. The sentence ppl column "
        "is the same model scored as a language model.\n\n" + markdown_table(header, rows)
    )


#: Perplexities above this are left out of the curves: a diverged run's (1e283 at round 4 of a
#: WikiText-2 sweep run at server lr 10) would stretch the log axis past what matplotlib can
#: label. A uniform guess over our largest vocabulary (WikiText-2's 33k words) scores 33,278.
CEILING = 1e5


def plot_curves(
    runs: list[dict],
    out: Path,
    name: str,
    title: str,
    curve: str = "curve",
    split: str = "test",
    xlabel: str = "round (epoch for the centralized model)",
    top: float | None = None,
) -> Path | None:
    """Test (or validation: ``split="val"``) perplexity per round, one line per run (log scale;
    points above CEILING left out, the axis cut at `top` where given); `curve` names the
    results.json field (col_curve: the seed papers' column perplexity). A run may name its own
    line as "line": (colour index, line style), as the seeds' figure does (a colour per row, a
    style per seed), and its legend entry as "label"."""
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
        label = r.get("label") or r["method"] + (
            "" if r["kind"] != "federated" else f" (C {_c(r['fraction'])})"
        )
        ax.plot(x, y, color=f"C{colour % 10}", ls=ls, label=label)
    ax.set_yscale("log")
    if top is not None:
        ax.set_ylim(top=top)
    ax.set_xlabel(xlabel)
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
