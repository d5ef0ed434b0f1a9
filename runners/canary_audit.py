"""`fedkey audit canary`: does the federation memorize one phone's secret, and does DP stop it?

The audit of Carlini et al. 2019 ("The Secret Sharer"), run through fedkey's own commands: one
`fedkey simulate --canary` per arm plants `repeats` copies of a random secret of the format
'my secret is _ _ _ _' (10^4 candidates, models.canary) in the first phone's shard and records the
secret's exposure (models.exposure: log2 |R| - log2 rank, 13.3 bits at most, ~1.4 at chance)
beside perplexity after every round. The arms:

    FedAvg, FedAtt            no DP and no bound on any update (--bound off: the seed papers')
    DP-FedAvg, DP-FedAtt      --dp-clip S --dp-noise-multiplier z, for each z asked (the server
                              clips each update to S and adds noise z x the aggregate's
                              sensitivity; the accountant reports epsilon every round)
    ..., not planted          each DP arm again with --canary-repeats 0: the same run (same
                              cohorts, same seeded noise) where no phone holds the secret, so
                              its exposure is what chance gives that noise; the planted arm's
                              excess over it is what the phone's data added

Every run is a child process (`python -m cli simulate ...`) with its own folder; its summary goes
into OUT/results.json with the command, the git commit and the machine, and a run whose command is
already there is not run again, so an interrupted audit resumes. results.md and exposure.png are
written from results.json alone (write_report).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from common.files import atomic_write
from models.canary import CanaryFormat

__all__ = [
    "AuditConfig",
    "Arm",
    "Results",
    "arms",
    "canary_phone",
    "command",
    "per_round_table",
    "run_audit",
    "summarize",
    "write_report",
]

T = TypeVar("T")

#: Where this code lives: git says from here which commit an arm ran (None outside a checkout).
_SOURCE = Path(__file__).resolve().parents[1]


def canary_phone(clients: int) -> str:
    """The phone whose shard holds the canary: the first (corpora.dataset.plant_canary), named
    as corpora.dataset.device_name names it."""
    return f"device-{0:0{len(str(clients - 1))}d}"


#: The mean exposure of a secret at a uniformly random rank (|R| large): log2 e.
CHANCE = 1.0 / math.log(2.0)
#: The plot's perplexity axis stops here (a diverged model's perplexity reaches 1e60).
PPL_SCALE = 1e5


@dataclass(frozen=True)
class AuditConfig:
    """The federation every arm runs (the arms differ only in strategy and privacy)."""

    data: str = "demo"
    clients: int = 20  # the demo's 20 owners, one phone each
    fraction: float = 0.5
    rounds: int = 8  # FedAvg ranks the secret first by round 7 (device-00 in rounds 2, 7, 8)
    local_epochs: int = 2
    repeats: int = 20  # copies of the canary in the first phone's shard
    dp_clip: float = 1.0
    dp_noise_multipliers: tuple[float, ...] = (1.0, 0.1)
    max_eval_sentences: int = 200
    seed: int = 0
    workers: int = 2

    def flags(self, repeats: int) -> list[str]:
        return [
            "--data", self.data, "--partition", "user", "--clients", str(self.clients),
            "--fraction", f"{self.fraction:g}", "--rounds", str(self.rounds),
            "--local-epochs", str(self.local_epochs), "--max-eval-sentences",
            str(self.max_eval_sentences), "--ksr-sentences", "0", "--seed", str(self.seed),
            "--canary", "--canary-repeats", str(repeats), "--workers", str(self.workers),
        ]  # fmt: skip


@dataclass(frozen=True)
class Arm:
    id: str
    label: str
    strategy: str
    noise: float | None = None  # the DP noise multiplier z; None: no DP
    planted: bool = True  # False: the control, nothing planted (--canary-repeats 0)

    @property
    def dp(self) -> bool:
        return self.noise is not None

    def flags(self, cfg: AuditConfig) -> list[str]:
        if self.noise is None:  # the undefended arm: no bound on any phone's update
            return ["--strategy", self.strategy, "--bound", "off"]
        return [
            "--strategy", self.strategy, "--dp-clip", f"{cfg.dp_clip:g}",
            "--dp-noise-multiplier", f"{self.noise:g}",
        ]  # fmt: skip


STRATEGIES = (("fedavg", "FedAvg"), ("fedatt", "FedAtt"))


def arms(cfg: AuditConfig) -> list[Arm]:
    """FedAvg and FedAtt without DP, then with DP at each noise multiplier of `cfg`, each DP arm
    beside its control (the same run with nothing planted)."""
    out = [Arm(s, name, s) for s, name in STRATEGIES]
    for z in cfg.dp_noise_multipliers:
        for s, name in STRATEGIES:
            out.append(Arm(f"{s}-dp-z{z:g}", f"DP-{name} z {z:g}", s, z))
            out.append(
                Arm(f"{s}-dp-z{z:g}-control", f"DP-{name} z {z:g}, not planted", s, z, False)
            )
    return out


def command(arm: Arm, cfg: AuditConfig, run_dir: Path) -> list[str]:
    """The fedkey command line of one arm (without the interpreter)."""
    flags = cfg.flags(cfg.repeats if arm.planted else 0)
    return ["fedkey", "simulate", *flags, *arm.flags(cfg), "--out", str(run_dir)]


def summarize(rows: list[dict], arm: Arm, clients: int) -> dict:
    """One results.json object from an arm's metrics rows (round 0 = the initial model)."""
    last, phone = rows[-1], canary_phone(clients)
    return {
        "id": arm.id,
        "label": arm.label,
        "strategy": arm.strategy,
        "dp": arm.dp,
        "noise_multiplier": arm.noise,
        "planted": arm.planted,
        "rounds": last["round"],
        "exposure": last["canary_exposure"],
        "rank": last["canary_rank"],
        "max_exposure": max(r["canary_exposure"] for r in rows),
        "test_ppl": last["test_ppl"],
        "initial_test_ppl": rows[0]["test_ppl"],
        "best_test_ppl": last["best_test_ppl"],
        "epsilon": last.get("epsilon"),
        # DP: the std of the noise added to every weight each round (z x the sensitivity)
        "noise_std": ((last.get("info") or {}).get("dp") or {}).get("noise_std"),
        # Rounds whose aggregate held the canary phone's update.
        "canary_phone": phone,
        "canary_rounds": [r["round"] for r in rows if phone in r["aggregated"]],
        "curve": [
            {
                "round": r["round"],
                "exposure": r["canary_exposure"],
                "rank": r["canary_rank"],
                "val_ppl": r["val_ppl"],
                "test_ppl": r["test_ppl"],
                "epsilon": r.get("epsilon"),
                "canary_phone": phone in r["aggregated"],
            }
            for r in rows
        ],
    }


# -- results.json and the runs ---------------------------------------------------------------------


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


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=_SOURCE, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def _device() -> str:
    """Where the arms train: the GPU's name, or the CPU's model and core count."""
    import torch

    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"cpu ({model}, {os.cpu_count()} cores)"


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_fedkey(
    run_id: str,
    cmd: list[str],
    run_dir: Path,
    env: dict[str, str],
    on_round: Callable[[int], None] = lambda n: None,
    results: Path | None = None,
) -> tuple[list[dict], dict]:
    """Run `cmd` (["fedkey", verb, ...]) with this interpreter, its output in RUN_DIR/log.txt;
    -> (its metrics rows, the provenance fields of its results.json object). `on_round(rounds
    recorded so far)` follows metrics.jsonl. Ctrl-C stops the child; a failed run raises
    RuntimeError with the end of its log. `results`: the folder the audit writes into, which is
    not a change to the code (git_dirty)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    commit = _git("rev-parse", "HEAD")
    aside = []
    top = _git("rev-parse", "--show-toplevel")
    if results is not None and top is not None and results.resolve().is_relative_to(top):
        aside = [f":!{results.resolve().relative_to(top)}"]
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", top or ".", *aside))
    line = shlex.join(cmd)
    (run_dir / "command.txt").write_text(line + "\n")
    start = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "cli", *cmd[1:]], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            while child.poll() is None:
                time.sleep(1.0)
                rows = _rows(run_dir)
                on_round(int(rows[-1].get("round", 0)) if rows else 0)
        finally:
            if child.poll() is None:  # interrupted: stop it and its training processes
                child.terminate()
                child.wait()
    if child.returncode != 0:
        tail = (run_dir / "log.txt").read_text()[-2000:]
        raise RuntimeError(f"{run_id}: `{line}` exited {child.returncode}\n{tail}")
    provenance = {
        "wall_seconds": round(time.perf_counter() - start, 1),
        "command": line,
        "git_commit": commit,
        "git_dirty": dirty,
        "device": _device(),
    }
    return _rows(run_dir), provenance


def run_arm(
    arm: Arm,
    cfg: AuditConfig,
    runs_dir: Path,
    on_round: Callable[[int], None] = lambda n: None,
    results: Path | None = None,
) -> dict:
    """Run one arm as a child process (its log in its folder); its summary, with the command
    and the machine. `on_round(rounds recorded so far)` follows its metrics.jsonl."""
    run_dir = runs_dir / arm.id
    # The default format (the report's): no FEDKEY_CANARY_FORMAT / _ALPHABET from the shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDKEY_CANARY")}
    rows, provenance = run_fedkey(
        arm.id, command(arm, cfg, run_dir), run_dir, env, on_round, results
    )
    return {**summarize(rows, arm, cfg.clients), **provenance, "config": asdict(cfg)}


def select(choices: list[Arm], only: list[str] | None) -> list[Arm]:
    if not only:
        return choices
    unknown = [o for o in only if o not in {a.id for a in choices}]
    if unknown:
        raise ValueError(
            f"no arm {', '.join(unknown)}; the arms are {', '.join(a.id for a in choices)}"
        )
    return [a for a in choices if a.id in only]


def run_audit(
    cfg: AuditConfig,
    out: Path,
    runs_dir: Path,
    only: list[str] | None = None,
    dry_run: bool = False,
    audit_command: str = "",
) -> list[dict]:
    """Run every arm not yet in OUT/results.json with the same command, then write the report;
    -> the results of every arm in results.json."""
    from tqdm import tqdm

    store = Results(out)
    todo = store.pending(
        select(arms(cfg), only), lambda a: (a.id, command(a, cfg, runs_dir / a.id)), dry_run
    )
    if dry_run:
        return store.read()
    bar = tqdm(total=len(todo) * cfg.rounds, desc="audit canary", unit="round")
    for i, arm in enumerate(todo):
        bar.set_postfix_str(arm.label)

        def follow(done: int, base: int = i * cfg.rounds) -> None:
            bar.update(base + min(done, cfg.rounds) - bar.n)

        result = run_arm(arm, cfg, runs_dir, on_round=follow, results=out)
        follow(cfg.rounds)
        store.add(result, audit_command)
        bar.write(
            f"{arm.label}: exposure {result['exposure']:.2f} bits (max "
            f"{result['max_exposure']:.2f}), test ppl {result['test_ppl']:.1f}, "
            f"{result['wall_seconds']:.0f} s"
        )
    bar.close()
    runs = store.read()
    write_report(runs, out, store.commands())
    return runs


# -- the report ------------------------------------------------------------------------------------


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
    fmt = CanaryFormat()
    secret = fmt.draw(cfg["seed"])
    bits = math.log2(fmt.size)
    phone = runs[0]["canary_phone"]
    m = round(cfg["clients"] * cfg["fraction"])
    summary = [
        [
            r["label"],
            str(cfg["repeats"]) if r.get("planted", True) else "0",
            _f(r["exposure"]),
            _f(mean_exposure(r)),
            _f(r["max_exposure"]),
            _f(r["rank"], ".0f"),
            _f(r["test_ppl"], ".4g"),
            _f(r["epsilon"], ".1f"),
            _f(r["noise_std"], ".3g"),
            ", ".join(map(str, r["canary_rounds"])) or "none",
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
        f"of {len(fmt.alphabet)} number words: |R| = {fmt.size:,} candidates) is planted "
        f"{cfg['repeats']} times in the shard of {phone}, one of {cfg['clients']} phones "
        f"(the demo corpus, one phone per owner); {m} of them train each round, "
        f"E = {cfg['local_epochs']}, {cfg['rounds']} rounds. Exposure (Carlini et al. 2019, "
        '"The Secret Sharer") = log2 |R| - log2 rank of the secret among all candidates by the '
        f"global model's likelihood, computed exactly every round: {bits:.2f} bits when the "
        f"model ranks the secret first, {CHANCE:.2f} on average at chance. A model indifferent to "
        "the secret ranks it uniformly at random, so it shows an exposure of x bits or more with "
        "probability 2^-x: 4.3 bits 1 time in 20, 6.6 bits 1 time in 100, per round.",
        "",
        "Without DP no update is bounded (`--bound off`, the seed papers' server). "
        + (
            f"With DP (`--dp-clip {cfg['dp_clip']:g} --dp-noise-multiplier z`) the server clips "
            "each update to S and adds to every weight Gaussian noise of std z x the aggregate's "
            f"sensitivity (2S/m for the uniform mean of m = {m} updates, larger for FedAtt's "
            "attention: the 'noise std' column); epsilon at delta 1e-5 after the last round. "
            "Each DP arm runs again with nothing planted (`--canary-repeats 0`): the same "
            "cohorts and the same seeded noise, so the difference between the two is what the "
            f"phone's data did. The initial model's test perplexity is "
            f"{runs[0]['initial_test_ppl']:.0f}."
            if dp
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
        if r["dp"]:
            cx.plot(xs, ys, "-" if own else ":", marker="o" if own else "x", ms=3, color=color,
                    label=r["label"])  # fmt: skip
    for axis in (ax, cx):
        axis.axhline(bits, color="grey", lw=0.8)
        axis.text(0, bits, "log2 |R|: ranked first", va="bottom", fontsize=8, color="grey")
        axis.axhline(CHANCE, color="grey", lw=0.8, ls=":")
        axis.text(0, CHANCE, "chance (mean)", va="bottom", fontsize=8, color="grey")
        axis.set(xlabel="round", ylabel="exposure (bits)", ylim=(0, bits + 1))
        axis.legend(fontsize=7)
    ax.set_title(f"canary exposure (circled: {phone} aggregated)", fontsize=10)
    cx.set_title("DP: planted (solid) vs nothing planted (dotted)", fontsize=10)
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
