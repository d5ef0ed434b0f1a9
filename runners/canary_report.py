"""The canary audit's record and report: OUT/results.json (Results, one object per arm, updated
under a lock so an interrupted audit resumes) and what is written from it alone: results.md (each
arm's exposure, perplexity and epsilon; the exposure per round) and exposure.png (write_report)."""

from __future__ import annotations

import fcntl
import json
import math
import shlex
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from fedkey.common.files import atomic_write
from fedkey.models.canary import DEFAULT_ALPHABET, DEFAULT_TEMPLATE, CanaryFormat
from fedkey.runners.canary_arms import STRATEGIES

__all__ = [
    "CHANCE",
    "Results",
    "mean_exposure",
    "per_round_table",
    "plot",
    "rounds_with",
    "write_report",
]

T = TypeVar("T")

#: The mean exposure of a secret at a uniformly random rank (|R| large): log2 e.
CHANCE = 1.0 / math.log(2.0)
#: The plot's perplexity axis stops here (a diverged model's perplexity reaches 1e60).
PPL_SCALE = 1e5


class Results:
    """OUT/results.json: {"bench_commands": the command lines that produced it (the key the
    research harness's results.json files use too), "runs": one object per arm}, updated one arm
    at a time under a file lock and replaced atomically, so an interrupted audit loses at most
    its current arm."""

    def __init__(self, out: Path):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "results.json"

    def _data(self) -> dict:
        if not self.path.exists():
            return {"bench_commands": [], "runs": []}
        return {"bench_commands": [], **json.loads(self.path.read_text())}

    def read(self) -> list[dict]:
        runs: list[dict] = self._data()["runs"]
        return runs

    def commands(self) -> list[str]:
        lines: list[str] = self._data()["bench_commands"]
        return lines

    def pending(
        self, items: Iterable[T], run: Callable[[T], tuple[str, list[str]]], dry_run: bool = False
    ) -> list[T]:
        """The items whose run (``run(item)``: its id and command line) is not in results.json
        with the same command. With ``dry_run``, print every item's command line; none."""
        done = {(r["id"], r["command"]) for r in self.read()}
        todo = []
        for item in items:
            run_id, argv = run(item)
            line = shlex.join(argv)
            if dry_run:
                print(line)
            elif (run_id, line) not in done:
                todo.append(item)
        return todo

    @contextmanager
    def _updating(self) -> Iterator[dict]:
        with (self.out / ".results.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._data()
            yield data
            atomic_write(self.path, json.dumps(data, indent=1))

    def add(self, result: dict, audit_command: str) -> None:
        """Record one arm (replacing an earlier run of the same id) and the command that ran it."""
        with self._updating() as data:
            data["runs"] = [r for r in data["runs"] if r["id"] != result["id"]] + [result]
            if audit_command and audit_command not in data["bench_commands"]:
                data["bench_commands"] = [*data["bench_commands"], audit_command]


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _ordered(runs: list[dict]) -> list[dict]:
    """No DP first (FedAvg, FedAtt), then DP from the most noise to the least, each planted arm
    before its control."""
    strategy = {s: i for i, (s, _) in enumerate(STRATEGIES)}
    return sorted(
        runs,
        key=lambda r: (
            r["noise_multiplier"] is not None,
            -(r["noise_multiplier"] or 0.0),
            strategy.get(r["strategy"], len(strategy)),
            not r.get("planted", True),
        ),
    )


def mean_exposure(run: dict) -> float | None:
    """The mean exposure over the rounds from the first one that aggregated the canary phone's
    update (one round's exposure of one secret is a noisy measure; this is less so)."""
    if not run["canary_rounds"]:
        return None
    after = [p["exposure"] for p in run["curve"] if p["round"] >= run["canary_rounds"][0]]
    return sum(after) / len(after)


def rounds_with(run: dict) -> str:
    """The rounds whose aggregate held the canary phone's update, and those whose outlier
    filter rejected it."""
    text = ", ".join(map(str, run["canary_rounds"])) or "none"
    if run.get("canary_rejected"):
        text += f" (rejected by the outlier filter: {', '.join(map(str, run['canary_rejected']))})"
    return text


def per_round_table(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: a row per round, each arm's exposure (and a * when the canary phone's
    update was in that round's aggregate)."""
    runs = _ordered(runs)
    rounds = sorted({p["round"] for r in runs for p in r["curve"]})
    by = {(r["id"], p["round"]): p for r in runs for p in r["curve"]}
    rows = []
    for n in rounds:
        cells = [str(n)]
        for r in runs:
            p = by.get((r["id"], n))
            mark = " *" if p is not None and p["canary_phone"] else ""
            cells.append("-" if p is None else _f(p["exposure"]) + mark)
        rows.append(cells)
    return ["round", *(r["label"] for r in runs)], rows


def write_report(runs: list[dict], out: Path, commands: list[str]) -> None:
    """results.md and exposure.png from results.json's objects."""
    runs = _ordered(runs)
    if not runs:
        return
    cfg = runs[0]["config"]
    fmt = CanaryFormat.parse(
        cfg.get("canary_format", DEFAULT_TEMPLATE),
        cfg.get("canary_alphabet", " ".join(DEFAULT_ALPHABET)),
    )
    secret = fmt.draw(cfg["seed"])
    bits = math.log2(fmt.size)
    phone = runs[0]["canary_phone"]
    m = round(cfg["clients"] * cfg["fraction"])
    summary = [
        [
            r["label"],
            str(r["config"]["repeats"]) if r.get("planted", True) else "0",
            _f(r["exposure"]),
            _f(mean_exposure(r)),
            _f(r["max_exposure"]),
            _f(r["rank"], ".0f"),
            _f(r["test_ppl"], ".4g"),
            _f(r["epsilon"], ".1f"),
            _f(r["noise_std"], ".3g"),
            rounds_with(r),
            f"{r['wall_seconds']:.0f}",
        ]
        for r in runs
    ]
    header, rows = per_round_table(runs)
    dp = any(r["dp"] for r in runs)
    lines = [
        "# Canary audit: memorization of one phone's secret",
        "",
        f"The secret `{secret}` (drawn with seed {cfg['seed']} from `{fmt.template}`, each `_` one "
        f"of the {len(fmt.alphabet)} words {' '.join(fmt.alphabet)}: |R| = {fmt.size:,} candidates) "
        f"is planted {cfg['repeats']} times in the shard of {phone}, one of {cfg['clients']} "
        f"phones (the {Path(cfg['data']).name} corpus, one phone per owner, the largest "
        f"first); {m} of them train each round, "
        f"E = {cfg['local_epochs']}, {cfg['rounds']} rounds. Exposure (Carlini et al. 2019, "
        '"The Secret Sharer") = log2 |R| - log2 rank of the secret among all candidates by the '
        f"global model's likelihood, computed exactly every round: {bits:.2f} bits when the "
        f"model ranks the secret first, {CHANCE:.2f} on average at chance. A model indifferent to "
        "the secret ranks it uniformly at random, so it shows an exposure of x bits or more with "
        "probability 2^-x: 4.3 bits 1 time in 20, 6.6 bits 1 time in 100, per round.",
        "",
        (
            "Without DP no update is bounded (`--bound off`, the seed papers' server). "
            if cfg.get("bound_norm") is None
            else f"Without DP every update is clipped to the DP arms' S = {cfg['bound_norm']:.3g} "
            "(`--bound fixed`) and no noise is added. "
        )
        + (
            f"With DP (`--dp-clip {cfg['dp_clip']:g} --dp-noise-multiplier z`) the server clips "
            "each update to S and adds to every weight Gaussian noise of std z x the aggregate's "
            f"sensitivity (2S/m for the uniform mean of m = {m} updates, larger for FedAtt's "
            "attention: the 'noise std' column); epsilon at the server's delta after the last round. "
            + (
                "Under tree and blt (DP-FTRL) that noise goes on the running sum of the rounds' "
                "aggregates, correlated across rounds, and a phone trains at most once every b "
                "rounds. "
                if any(r.get("mechanism") in ("tree", "blt") for r in runs)
                else ""
            )
            + "Each DP arm runs again with nothing planted (`--canary-repeats 0`): the same "
            "cohorts and the same seeded noise, so the difference between the two is what the "
            f"phone's data did. The initial model's test perplexity is "
            f"{runs[0]['initial_test_ppl']:.0f}."
            if dp
            else ""
        )
        + (
            " The no-DP arms run so too: what the language alone (the words and digits the "
            "corpus favours) gives the secret."
            if any(not r["dp"] and not r.get("planted", True) for r in runs)
            else ""
        ),
        "",
        _markdown_table(
            ["arm", "copies planted", "exposure, last round", f"mean from {phone}'s first round",
             "max", "rank", "test ppl", "epsilon", "noise std", f"rounds with {phone}",
             "seconds"],
            summary,
        ),  # fmt: skip
        "",
        f"Exposure per round, bits (* = {phone}'s update was aggregated that round):",
        "",
        _markdown_table(header, rows),
        "",
        "![exposure per round](exposure.png)",
        "",
        *(["Reproduce: " + "; ".join(f"`{c}`" for c in commands if c), ""] if any(commands) else []),
        "Runs: " + "; ".join(f"{r['label']}: `{r['command']}`" for r in runs),
        "",
        f"Code: {runs[0]['git_commit']}" + (" (with local changes)" if runs[0]["git_dirty"] else "")
        + f"; {runs[0]['device']}.",
    ]  # fmt: skip
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(runs, out / "exposure.png", bits, phone)


def plot(runs: list[dict], path: Path, bits: float, phone: str) -> None:
    """Exposure per round of the planted arms; each DP arm beside its control; test perplexity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _ordered(runs)
    planted = [r for r in runs if r.get("planted", True)]
    colors = {r["label"]: f"C{i}" for i, r in enumerate(planted)}
    with_control = {r["label"].split(",")[0] for r in runs if not r.get("planted", True)}
    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in runs:
        xs = [p["round"] for p in r["curve"]]
        ys = [p["exposure"] for p in r["curve"]]
        own = r.get("planted", True)
        color = colors.get(r["label"] if own else r["label"].split(",")[0], "grey")
        if own:
            style = "--" if r["dp"] else "-"
            ax.plot(xs, ys, style, marker="o", ms=3, color=color, label=r["label"])
            hit = [p for p in r["curve"] if p["canary_phone"]]
            ax.plot([p["round"] for p in hit], [p["exposure"] for p in hit], "o", ms=7,
                    mfc="none", color=color)  # fmt: skip
            bx.plot(xs, [p["test_ppl"] for p in r["curve"]], style, marker="o", ms=3,
                    color=color, label=r["label"])  # fmt: skip
        if r["dp"] or r["label"].split(",")[0] in with_control:
            cx.plot(xs, ys, "-" if own else ":", marker="o" if own else "x", ms=3, color=color,
                    label=r["label"])  # fmt: skip
    for axis in (ax, cx):
        axis.axhline(bits, color="grey", lw=0.8)
        axis.text(0, bits, "log2 |R|: ranked first", va="bottom", fontsize=8, color="grey")
        axis.axhline(CHANCE, color="grey", lw=0.8, ls=":")
        axis.text(0, CHANCE, "chance (mean)", va="bottom", fontsize=8, color="grey")
        axis.set(xlabel="round", ylabel="exposure (bits)", ylim=(0, bits + 1))
        if axis.get_legend_handles_labels()[0]:  # no DP arm and no control: nothing beside
            axis.legend(fontsize=7)
    ax.set_title(f"canary exposure (circled: {phone} aggregated)", fontsize=10)
    cx.set_title("planted (solid) vs nothing planted (dotted)", fontsize=10)
    bx.set(xlabel="round", ylabel="test perplexity", yscale="log")
    ppls = [p["test_ppl"] for r in planted for p in r["curve"]]
    top = max(ppls)
    bx.set_ylim(bottom=10 ** math.floor(math.log10(min(ppls))))
    if top > PPL_SCALE:  # a diverged DP model would flatten the others to the bottom
        bx.set_ylim(top=PPL_SCALE)
    bx.set_title(
        "test perplexity" + (f" (above {PPL_SCALE:.0e}: off the scale)" if top > PPL_SCALE else ""),
        fontsize=10,
    )
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
