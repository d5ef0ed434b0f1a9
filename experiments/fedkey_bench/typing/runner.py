"""`fedkey-bench typing`: the real-typing table. Does a federated keyboard, fine-tuned from the
base on the phones, suggest better than the Kneser-Ney 3-gram a server could only build by
collecting the phones' text?

Per population (one phone per sender, `--partition user`): NUS SMS's 30 phones (their public
text: Chit-Chat, the base's), the Ubuntu IRC population's 100. Four runs from the base (`--init`,
its 3-gram `--ngram`), each resumable in OUT/runs/<population>/<run> (fedkey_bench.common.runs):
FedAvg, FedAdam (Reddi et al. 2021), FedAtt (Ji et al. 2019), all `fedkey simulate` with R rounds
of C of the phones, one local epoch, lr 0.5 decayed 0.95 a round, fp32; and the centralized
fine-tune on the pooled phones' text for ceil(C R) epochs (as many examples seen). Then
fedkey_bench.typing.score scores each row on the same held-out messages (the phones' later
messages, the held-out senders'), each sender's in time order, the personal cache off and on,
every run by its best-validation checkpoint. Results: OUT/results.json, OUT/results.md
(fedkey_bench.typing.report).
"""

from __future__ import annotations

import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from fedkey.cli.errors import UserError
from fedkey_bench.common.checkout import RESULTS
from fedkey_bench.common.runs import read_rows, rounds_done, run_fedkey, what_it_computes
from fedkey_bench.typing.report import load, save

if TYPE_CHECKING:
    from fedkey_bench.typing.score import Checkpoint


@dataclass(frozen=True)
class Population:
    """A population of phones, one per sender, and what it is called in the tables."""

    name: str
    label: str
    data: str  # `fedkey simulate --data`
    clients: int
    #: FedAdam's server lr: the paper bench's real suite's best on the population
    #: (experiments/results/README.md: NUS SMS 0.01 over 0.03 and 0.1; Ubuntu IRC 0.03, 0.01
    #: and 0.1 worse), beta1 0.9.
    adam_server_lr: float


POPULATIONS = {
    "nus-sms": Population("nus-sms", "NUS SMS", "nus-sms", 30, 0.01),
    "ubuntu-irc": Population("ubuntu-irc", "Ubuntu IRC", "ubuntu-irc", 100, 0.03),
}
#: Every run's local training: one epoch a round, lr 0.5 decayed 0.95 a round (an epoch for the
#: centralized run), fp32.
LOCAL = ("--lr", "0.5", "--lr-decay", "0.95", "--precision", "fp32")
#: FedAtt's server step (--epsilon).
FEDATT_STEP = 0.4


@dataclass(frozen=True)
class Protocol:
    """What every run of a population shares (the command's options)."""

    init: str = "base"
    ngram: str = "base"
    rounds: int = 10
    fraction: float = 0.3
    workers: int = 2
    max_senders: int | None = None  # score only each held-out set's first N senders


@dataclass(frozen=True)
class RunSpec:
    """One run of a population: its folder name, its row label, its command without --out."""

    name: str
    label: str
    kind: str  # "federated" or "central"
    argv: tuple[str, ...]
    rounds: int  # its last round (epoch)


def run_specs(pop: Population, p: Protocol) -> list[RunSpec]:
    """FedAvg, FedAdam, FedAtt and the centralized fine-tune of `pop` under `p`."""
    shared = ("--init", p.init, "--data", pop.data, "--partition", "user", "--clients",
              str(pop.clients))  # fmt: skip
    simulate = ("fedkey", "simulate", *shared, "--ngram", p.ngram, "--fraction", f"{p.fraction:g}",
                "--rounds", str(p.rounds), "--local-epochs", "1", *LOCAL, "--workers",
                str(p.workers))  # fmt: skip
    epochs = math.ceil(p.fraction * p.rounds - 1e-9)  # as many examples as the rounds' phones saw
    adam = ("--strategy", "fedavg", "--server-opt", "adam", "--server-momentum", "0.9",
            "--server-lr", f"{pop.adam_server_lr:g}")  # fmt: skip
    return [
        RunSpec("fedavg", "FedAvg", "federated", (*simulate, "--strategy", "fedavg"), p.rounds),
        RunSpec("fedadam", "FedAdam", "federated", (*simulate, *adam), p.rounds),
        RunSpec("fedatt", "FedAtt", "federated",
                (*simulate, "--strategy", "fedatt", "--epsilon", f"{FEDATT_STEP:g}"), p.rounds),
        RunSpec("central", "centralized", "central",
                ("fedkey", "train-central", *shared, "--epochs", str(epochs), *LOCAL,
                 "--workers", str(p.workers)), epochs),
    ]  # fmt: skip


def command_line(spec: RunSpec, run_dir: Path) -> list[str]:
    return [*spec.argv, "--out", str(run_dir)]


def is_done(spec: RunSpec, run_dir: Path, recorded: dict[str, Any] | None) -> bool:
    """Whether the run is recorded with the same command and its folder holds its last round."""
    if recorded is None or "command" not in recorded:
        return False
    same = what_it_computes(recorded["command"]) == what_it_computes(
        shlex.join(command_line(spec, run_dir))
    )
    return same and rounds_done(run_dir) >= spec.rounds


def best_checkpoint(spec: RunSpec, run_dir: Path) -> tuple[Path, int] | None:
    """The run's best-validation checkpoint (its last metrics row's best_round) and round; None
    before its first row or when that checkpoint is not on disk."""
    rows = read_rows(run_dir)
    if not rows or rows[-1].get("best_round") is None:
        return None
    best = int(rows[-1]["best_round"])
    path = run_dir / "checkpoints" / f"round_{best:04d}.safetensors"
    return (path, best) if path.is_file() else None


def train(pop: Population, p: Protocol, out: Path) -> None:
    """Run each of the population's runs not done yet (resuming an interrupted one); each
    recorded in OUT/results.json as it ends."""
    for spec in run_specs(pop, p):
        run_dir = out / "runs" / pop.name / spec.name
        results = load(out)
        entry = results["populations"].setdefault(pop.name, {})
        recorded = entry.setdefault("runs", {}).get(spec.name)
        if is_done(spec, run_dir, recorded):
            print(f"  {pop.name}/{spec.name}: done", flush=True)
            continue
        print(f"  {pop.name}/{spec.name}: running", flush=True)
        cmd = command_line(spec, run_dir)
        _, provenance = run_fedkey(f"{pop.name}/{spec.name}", cmd, run_dir, resumable=True)
        results = load(out)  # again: the run took a while
        runs = results["populations"].setdefault(pop.name, {}).setdefault("runs", {})
        runs[spec.name] = {"label": spec.label, "kind": spec.kind, "rounds": spec.rounds,
                           **provenance}  # fmt: skip
        save(out, results)


def checkpoints(pop: Population, p: Protocol, out: Path) -> tuple[list[Checkpoint], dict]:
    """The runs' best checkpoints to score, and what is known of each run (rounds done, best
    round, best validation perplexity; `missing` for a run with nothing to score)."""
    from fedkey_bench.typing.score import Checkpoint

    found, status = [], {}
    for spec in run_specs(pop, p):
        run_dir = out / "runs" / pop.name / spec.name
        best = best_checkpoint(spec, run_dir)
        rows = read_rows(run_dir)
        status[spec.name] = {
            "label": spec.label, "kind": spec.kind, "rounds": spec.rounds,
            "rounds_done": rounds_done(run_dir), "best_round": best and best[1],
            "best_val_ppl": rows[-1].get("best_val_ppl") if rows else None,
            "missing": best is None,
        }  # fmt: skip
        if best is not None:
            found.append(Checkpoint(spec.name, spec.label, spec.kind, best[0], best[1]))
    return found, status


def score(pop: Population, p: Protocol, out: Path, bench_command: str) -> dict[str, Any]:
    """Score every row of `pop` (fedkey_bench.typing.score) and keep them in OUT/results.json;
    -> the population's entry."""
    import torch

    from fedkey_bench.common.provenance import git, machine_line
    from fedkey_bench.typing import score as scoring

    torch.set_num_threads(1)
    start = time.perf_counter()
    held = scoring.load_held_out(pop.data, pop.clients, p.max_senders)
    base = scoring.load_base(p.init)
    public = scoring.load_public_ngram(p.ngram, base[1])
    found, status = checkpoints(pop, p, out)

    def progress(row: dict[str, Any]) -> None:
        print(
            f"  {pop.name} {row['id']} on {row['set']}{' + cache' if row['cache'] else ''}: "
            f"top-1 {row['all_top1']}, ksr {row['ksr']} ({row['seconds']} s)",
            flush=True,
        )

    rows = scoring.score_keyboards(scoring.keyboards(held, base, public, found), held, progress)
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!experiments/results")
    results = load(out)
    entry = results["populations"].setdefault(pop.name, {})
    for name, known in status.items():
        entry.setdefault("runs", {}).setdefault(name, {}).update(known)
    entry.update({
        "label": pop.label, "data": pop.data, "clients": pop.clients,
        "validation": {"messages": len(held.valid),
                       "words": sum(len(m.split()) for m in held.valid)},
        "held_out": {k: {"senders": len(v), "messages": sum(len(m) for m in v.values()),
                         "words": sum(len(x.split()) for m in v.values() for x in m)}
                     for k, v in held.sets.items()},
        "rows": rows,
        "settings": asdict(p),
        "command": bench_command,
        "scoring_seconds": round(time.perf_counter() - start, 1),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty),
    })  # fmt: skip
    save(out, results)
    return dict(entry)


def run_typing(populations: Sequence[str], p: Protocol, out: Path, bench_command: str,
               score_only: bool = False) -> Path:  # fmt: skip
    """Train (unless `score_only`) and score each population; -> OUT/results.md."""
    for name in populations:
        pop = POPULATIONS[name]
        if not score_only:
            train(pop, p, out)
        score(pop, p, out, bench_command)
    return out / "results.md"


def command(
    population: list[str] = typer.Option(
        ["nus-sms"], "--population", help=f"{' or '.join(POPULATIONS)} (repeatable)."
    ),
    init: str = typer.Option("base", "--init", help="The base every run starts from ('base': the shipped one)."),
    ngram: str = typer.Option("base", "--ngram", help="The public 3-gram ('base': the shipped base's)."),
    rounds: int = typer.Option(10, "--rounds", "-R", min=1, help="Federated rounds."),
    fraction: float = typer.Option(0.3, "--fraction", "-C", min=0.0, max=1.0,
                                   help="Share of the phones a round."),
    workers: int = typer.Option(2, "--workers", min=0, help="Training processes of each run."),
    max_senders: int | None = typer.Option(
        None, "--max-senders", min=1,
        help="Score only the first N senders of each held-out set (a quick look)."),
    score_only: bool = typer.Option(False, "--score-only", help="Train nothing: score the runs there are."),
    out: Path = typer.Option(RESULTS / "typing", "--out", help="results.json, results.md and runs/."),
) -> None:  # fmt: skip
    """The real-typing table: FedAvg, FedAdam, FedAtt and the centralized fine-tune from the
    base, each population's phones one per sender, against the Kneser-Ney 3-gram of the phones'
    own text (row a), the public 3-gram and the base, alone and mixed with the 3-gram (its weight
    chosen on validation text), the personal cache off and on: top-1 over every word, keystroke
    savings, perplexity on the phones' later messages and on senders who never trained. A run
    already recorded with the same command is not run again; an interrupted one resumes."""
    unknown = sorted(set(population) - set(POPULATIONS))
    if unknown:
        raise UserError(f"--population {', '.join(unknown)}: choose from {', '.join(POPULATIONS)}")
    # A path as the runs (started in the checkout) and the scoring (here) both read it.
    init, ngram = (v if v == "base" else str(Path(v).expanduser().resolve()) for v in (init, ngram))
    p = Protocol(init, ngram, rounds, fraction, workers, max_senders)
    try:
        page = run_typing(list(dict.fromkeys(population)), p, out.resolve(),
                          shlex.join(["fedkey-bench", *sys.argv[1:]]), score_only)  # fmt: skip
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        lines = str(e).splitlines() or [type(e).__name__]
        if len(lines) > 1:  # a failed run: the end of its log
            print("\n".join(lines[1:]), file=sys.stderr)
        raise UserError(lines[0]) from None
    print(page)
