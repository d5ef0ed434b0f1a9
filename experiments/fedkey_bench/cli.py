"""`fedkey-bench`: the benchmarks (one sub-package of fedkey_bench each: perf, paper, attacks,
privacy, load, peers, cohorts, aggregation, canary, typing, dpfinetune), with their targets, in a
report.

The research harness's own command, beside the product's `fedkey`: it fails as `fedkey` does
(fedkey.cli.errors.FedkeyGroup: one `error: ...` line and an exit status). Results go to
experiments/results/ by default (relative to the current directory: run it from the checkout)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, cast

import typer

from fedkey.cli.errors import FedkeyGroup, UserError
from fedkey.device_sim.training.backends import BACKENDS, Backend
from fedkey_bench.aggregation.runner import command as bench_aggregation
from fedkey_bench.canary.cli import command as bench_canary
from fedkey_bench.cohorts.runner import command as bench_cohorts
from fedkey_bench.common.checkout import RESULTS
from fedkey_bench.dpfinetune.cli import command as bench_dpfinetune
from fedkey_bench.load.runner import DATABASES, FRACTION
from fedkey_bench.paper.presets import PRESETS
from fedkey_bench.paper.suites import SUITES
from fedkey_bench.perf.report import STEPS
from fedkey_bench.typing.runner import command as bench_typing


def choices(name: str, values: Iterable[str]) -> type[StrEnum]:
    """The choice type of an option, built from the names its module defines: typer takes
    Literal[...] for an option of one value but not list[Literal[...]] (a repeatable option)."""
    return cast(type[StrEnum], StrEnum(name, {v: v for v in values}))


if TYPE_CHECKING:  # built at run time; to a type checker, a StrEnum
    BenchStep = StrEnum
    LoadDatabase = StrEnum
    PaperPreset = StrEnum
    PaperSuite = StrEnum
else:
    BenchStep = choices("BenchStep", STEPS)
    LoadDatabase = choices("LoadDatabase", DATABASES)
    PaperPreset = choices("PaperPreset", sorted(PRESETS))
    PaperSuite = choices("PaperSuite", SUITES)

__all__ = ["app", "main"]

app = typer.Typer(
    cls=FedkeyGroup,
    help="fedkey's benchmarks: the figures, with their targets, in a report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command("perf")
def bench_perf(
    quick: bool = typer.Option(
        False, "--quick", help="Shrink every step (fewer repeats, keystrokes, updates): ~3 minutes."
    ),
    out: Path = typer.Option(
        RESULTS / "perf" / "cpu",
        "--out",
        help="This machine's folder (experiments/results/perf/<machine>): OUT/perf.json is "
        "written there and the page of every machine beside it, OUT/../results.md, rebuilt.",
    ),
    skip: list[BenchStep] = typer.Option(
        [],
        "--skip",
        help="Leave a step out (repeat the option for several); its figures in an earlier "
        "OUT/perf.json of the same size (--quick or not) are kept, with their date and commit.",
    ),
    only: list[BenchStep] = typer.Option(
        [], "--only", help="Run just this step (repeat for several); the others as --skip."
    ),
) -> None:
    """Performance benchmark: trainer vs a bare PyTorch loop, HTTP vs in-process, aggregation
    memory, keyboard latency (WebSocket and in-browser wasm), int8 export; writes OUT/perf.json
    and rebuilds OUT/../results.md, every machine's figures beside the targets. Exits 1 if a
    step failed."""
    from fedkey_bench.perf.runner import run_perf

    if skip and only:
        raise UserError("give --skip or --only, not both")
    left_out = [s.value for s in skip] or [s for s in STEPS if only and s not in only]
    result = run_perf(
        quick=quick,
        out=out,
        skip=left_out,
        command=shlex.join(["fedkey-bench", *sys.argv[1:]]),
    )
    if any("error" in s for s in result["steps"].values()):
        raise typer.Exit(1)


@app.command("paper")
def bench_paper(
    preset: PaperPreset = typer.Option(
        PaperPreset("cpu"),
        "--preset",
        help="cpu: the ranking protocol (all the data, 50 rounds, C 0.1, E 1; days in the background, resumable); gpu: the seed papers' protocol (E 5, C 0.1 and 0.5; a round's phones as one stacked model on the GPU, resumable); smoke: minutes, for a first look.",
    ),
    suite: list[PaperSuite] = typer.Option(
        [PaperSuite("sweep"), PaperSuite("rank")],
        "--suite",
        help="real: keyboard quality on text people typed (NUS SMS by sender, 300 phones; the Ubuntu IRC population, 1,000 phones): the 3-gram, the centralized model, FedAvg, FedAtt, FedAvgM, FedAdam, FedMed, FedAttOpt, FedMed topK, AdaFL + FedAvg, IRC FedAvg at 50 and 1,000 phones a round too, FedAvg at other cohorts for as many examples (fewer, larger or more, smaller rounds), some with the lr decayed, and the rows whose rates the sweep chose again one step lower, scored on the phones' later messages and on held-out senders who never trained (preset cpu); sweep: client and server learning rates chosen on the validation set (short runs, Reddi et al. 2021); rank: every method of the papers' table, FedAvgM, FedAdam, the centralized model with as many examples, the Kneser-Ney 3-gram, PTB and WikiText-2 (needs the sweep's choices); noniid: the same methods on WikiText-2 by article and the demo corpus by owner; seeds: PTB's FedAvg, FedAvgM, capped FedAttOpt and centralized rows, and the demo by owner's FedAvg, FedAvgM, FedAdam and centralized rows at C 1, again at seeds 1 and 2 (how far a row moves by chance); decay: PTB's FedAvg, FedAvgM and centralized rows with the lr decayed alike per example seen (the 10% target); dropout: PTB's FedAvg, FedAvgM and centralized rows at C 0.1 with dropout 0.5, at their lr and the next larger (against overfitting at E 5); confirm: the FedAvg, FedAvgM, FedAdam and centralized rows at C 0.1 (PTB, WikiText-2, the demo by owner) again one step of the grid below the lr the sweep chose (does a short run pick what a whole one would?); code: FedAvg and FedAtt as the seed papers' published code ran them (column batches and column perplexity, their whole protocol) (repeat the option for several).",
    ),
    data_root: Path = typer.Option(
        Path("../shared/data"),
        "--data-root",
        help="The folder that holds ptb/ and wikitext-2/ (train/valid/test.txt).",
    ),
    out: Path = typer.Option(
        RESULTS,
        "--out",
        help="Results go to OUT/<preset>/: results.json, results.md, curves_*.png.",
    ),
    runs_dir: Path = typer.Option(
        Path("runs/bench"), "--runs-dir", help="Each run's own folder (checkpoints, metrics, log)."
    ),
    only: list[str] = typer.Option(
        [], "--only", help="Run only the runs whose id matches this glob (repeatable)."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Print the commands, and the run time of those not done at the pace of those done; run nothing.",
    ),
    jobs: int = typer.Option(
        1, "--jobs", min=1, help="Runs at once (2 keeps both cores of a 2-core machine busy)."
    ),
    hours: float | None = typer.Option(
        None,
        "--hours",
        min=0.01,
        help="The time this bench may take (a job's walltime): start only the runs that the pace of those done says will end in it, stop any run still going at the end, and list the rest. A run with nothing to judge it by starts.",
    ),
    advance: bool = typer.Option(
        True,
        "--advance/--no-advance",
        help="With --hours: when no run left fits in the time left, start the runs that resume (simulate, train-central) anyway; stopped at the end with their checkpoints, the next bench continues them.",
    ),
    backend: Backend | None = typer.Option(
        None,
        "--backend",
        help=f"Where the simulate runs' phones train, in place of the preset's ({', '.join(BACKENDS)}): stacked takes a round's phones at once as one stacked model, so a GPU can take a cpu preset's costliest runs (FedSGD, AdaFL). Where a run ran is not what it computes: a run done one way is done for the other, and records its device.",
    ),
) -> None:
    """The seed papers' experiments through fedkey's own commands; a run already in results.json
    with the same command is not run again, so an interrupted bench resumes where it stopped."""
    import signal

    from fedkey_bench.paper.runner import run_bench

    # A kill (SIGTERM) stops the bench as Ctrl-C does, so its runs are stopped with it.
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run_bench(
            preset.value,
            [s.value for s in suite],
            data_root,
            out,
            runs_dir,
            only=only or None,
            dry_run=dry_run,
            bench_command=shlex.join(["fedkey-bench", *sys.argv[1:]]),
            jobs=jobs,
            hours=hours,
            advance=advance,
            backend=backend,
        )
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        raise UserError(str(e)) from None
    finally:
        signal.signal(signal.SIGTERM, before)


@app.command("merge")
def bench_merge(
    other: Path = typer.Argument(
        ...,
        help="results.json of the same bench run on another machine (a GPU lent for a session).",
    ),
    into: Path = typer.Option(
        RESULTS / "cpu",
        "--into",
        help="The results folder to take it into (its results.json; results.md rebuilt).",
    ),
    theirs: list[str] = typer.Option(
        [],
        "--theirs",
        help="PRESET/ID of a run whose record there replaces this one's (one the other machine "
        "ran again at settings the suite plans now); repeatable.",
    ),
) -> None:
    """Take another machine's `fedkey-bench paper` results into this one's: the runs this one
    lacks, the bench command lines, the notes of runs begun there; results.md is rebuilt. A begun
    run goes on where its folder is (copy runs/bench/<preset>/<id> along to go on here)."""
    from fedkey_bench.paper.results import Bench
    from fedkey_bench.paper.runner import write_fresh

    if not other.is_file():
        raise UserError(f"{other}: no such file; give the other machine's results.json")
    try:
        taken, kept = Bench(into).merge(other, theirs)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(
        f"took {len(taken)} runs into {into / 'results.json'}"
        + (f": {', '.join(taken)}" if taken else "")
    )
    if kept:
        print(f"kept {len(kept)} runs as they are here, which it records otherwise: "
              f"{', '.join(kept)} (--theirs PRESET/ID takes its record)")  # fmt: skip
    unwritten = write_fresh(into)
    if unwritten:
        raise UserError(unwritten)
    print(into / "results.md")


@app.command("attacks")
def bench_attacks(
    out: Path = typer.Option(
        RESULTS / "attacks",
        "--out",
        help="Where results.json, results.md and attacks.png are written.",
    ),
    runs_dir: Path = typer.Option(
        Path("runs/bench/attacks"),
        "--runs-dir",
        help="Each cell's own folder (checkpoints, metrics, log).",
    ),
    rounds: int = typer.Option(5, "--rounds", min=1, help="Federated rounds of every cell."),
    local_epochs: int = typer.Option(1, "--local-epochs", min=1, help="Local epochs per round."),
    backdoor_flag: list[str] = typer.Option(
        [],
        "--backdoor-flag",
        help="A flag passed to the backdoor cells' `fedkey simulate`, e.g. '--backdoor-epochs 2' (repeatable).",
    ),
    workers: int | None = typer.Option(
        None, "--workers", help="Training processes per run (default: one per core)."
    ),
    only: list[str] = typer.Option(
        [],
        "--only",
        help="Run only the cells whose id matches this glob, e.g. 'fedavg-off-*' (repeatable).",
    ),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Cells at once."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands; run nothing."),
) -> None:
    """Malicious phones (scale x100, signflip x-10, a word-prediction backdoor, NaN and
    wrong-shape uploads) against FedAvg and FedAtt, with the server's defences (the defaults) and
    without (--bound off), 1 attacker of 10 phones and 3 of 30, on the demo corpus: test
    perplexity against the clean run and the backdoor's success per round. A cell already in
    results.json with the same command is not run again, so an interrupted bench resumes."""
    from fedkey_bench.attacks.matrix import Protocol
    from fedkey_bench.attacks.runner import run_attacks

    flags = tuple(part for f in backdoor_flag for part in shlex.split(f))
    protocol = Protocol(rounds=rounds, local_epochs=local_epochs, workers=workers, backdoor=flags)
    try:
        run_attacks(
            out,
            runs_dir,
            protocol,
            only=only or None,
            jobs=jobs,
            dry_run=dry_run,
            bench_command=shlex.join(["fedkey-bench", *sys.argv[1:]]),
        )
    except (ValueError, RuntimeError) as e:
        raise UserError(str(e)) from None


@app.command("privacy")
def bench_privacy(
    workload: str = typer.Option(
        "ptb",
        "--workload",
        help="ptb: PTB over IID phones, gaussian noise. irc: the real Ubuntu IRC "
        "population, one phone per sender, the gaussian, tree and blt mechanisms and rows with "
        "a simulated deployment cohort's noise. The options below override its "
        "settings.",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Where results.json, results.md and privacy.png are written (default: "
        "experiments/results/privacy, or privacy-irc for --workload irc).",
    ),
    runs_dir: Path | None = typer.Option(
        None,
        "--runs-dir",
        help="Each cell's own folder (default: runs/bench/privacy[-irc]).",
    ),
    data: Path | None = typer.Option(
        None,
        "--data",
        help="The corpus folder (default: ../shared/data/ptb or ubuntu-irc).",
    ),
    clients: int | None = typer.Option(
        None, "--clients", "-K", min=2, help="Phones (PTB: IID shards; irc: the top senders)."
    ),
    fraction: float | None = typer.Option(
        None, "--fraction", "-C", min=0.0, max=1.0, help="Share of phones in each cohort."
    ),
    rounds: int | None = typer.Option(None, "--rounds", "-R", min=1, help="Rounds of every cell."),
    batch_size: int | None = typer.Option(
        None, "--batch-size", "-B", min=1, help="Sentences per local step (one local epoch)."
    ),
    max_train_tokens: int | None = typer.Option(
        None, "--max-train-tokens", min=1, help="Keep only the first N training words."
    ),
    max_eval_sentences: int | None = typer.Option(
        None, "--max-eval-sentences", min=1, help="Validation and test sentences scored each round."
    ),
    hidden_size: int | None = typer.Option(
        None, "--hidden-size", min=1, help="GRU units (= embedding)."
    ),
    vocab_size: int | None = typer.Option(None, "--vocab-size", min=2, help="Vocabulary."),
    epsilon: list[float] = typer.Option(
        [], "--epsilon", help="Target epsilons at --delta (repeatable)."
    ),
    delta: float | None = typer.Option(
        None, "--delta", help="DP delta (PTB: 1e-5; irc: the server's 1/N^1.1)."
    ),
    mechanism: list[str] = typer.Option(
        [], "--mechanism", help="DP mechanisms of the cells: gaussian, tree, blt (repeatable)."
    ),
    noise_cohort: list[int] = typer.Option(
        [],
        "--noise-cohort",
        help="Add rows with the noise of a deployment whose cohorts are M phones (simulated; "
        "repeatable).",
    ),
    clip: float | None = typer.Option(
        None,
        "--clip-norm",
        help="The clip S of every cell (default: the median update norm of a short no-DP run).",
    ),
    workers: int | None = typer.Option(
        None, "--workers", help="Training processes (default: one per core)."
    ),
    only: list[str] = typer.Option(
        [], "--only", help="Run only the cells whose id matches this glob, e.g. 'fedatt-*'."
    ),
) -> None:
    """Privacy-utility table: DP-FedAvg and DP-FedAtt at target epsilons (same clip, rounds and
    noise multiplier z, calibrated on the server's accountant), and both without noise; test
    perplexity (and top-1 for irc), epsilon reached, noise per round. A cell already in
    results.json with the same settings is not run again, so an interrupted bench resumes."""
    from dataclasses import replace

    from fedkey_bench.privacy.runner import MECHANISMS, WORKLOADS, Protocol, run_privacy

    if workload not in WORKLOADS:
        raise UserError(f"--workload {workload}: choose one of {', '.join(WORKLOADS)}")
    bad = [m for m in mechanism if m not in MECHANISMS]
    if bad:
        raise UserError(f"--mechanism {bad[0]}: choose among {', '.join(MECHANISMS)}")
    base = WORKLOADS[workload]
    if data is not None and not data.is_dir():
        raise UserError(f"--data: no corpus folder {data} (it needs train/valid/test files)")
    given: dict[str, object] = dict(
        data=None if data is None else str(data.resolve()), clients=clients, fraction=fraction,
        rounds=rounds, batch_size=batch_size, max_train_tokens=max_train_tokens,
        max_eval_sentences=max_eval_sentences, hidden_size=hidden_size, vocab_size=vocab_size,
        epsilons=tuple(sorted(set(epsilon))) or None, delta=delta, clip=clip, workers=workers,
        mechanisms=tuple(mechanism) or None, noise_cohorts=tuple(noise_cohort) or None,
    )  # fmt: skip
    protocol: Protocol = replace(base, **{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
    suffix = "" if workload == "ptb" else f"-{workload}"
    try:
        run_privacy(
            out or RESULTS / f"privacy{suffix}",
            runs_dir or Path(f"runs/bench/privacy{suffix}"),
            protocol,
            only=only or None,
            bench_command=shlex.join(["fedkey-bench", *sys.argv[1:]]),
        )
    except (ValueError, RuntimeError) as e:
        raise UserError(str(e)) from None


@app.command("load")
def bench_load(
    phones: str = typer.Option(
        "200,1000",
        "--phones",
        help="Fleet sizes, comma-separated: one cell each (--fraction of them upload each round).",
    ),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Federated rounds of every cell."),
    label: str = typer.Option(
        "run", "--label", help="Names the cells (e.g. baseline); another label is another cell."
    ),
    out: Path = typer.Option(
        RESULTS / "load",
        "--out",
        help="Where results.json and results.md are written.",
    ),
    drivers: int | None = typer.Option(
        None, "--drivers", min=1, help="Processes driving the phones (default: one per 5,000)."
    ),
    server_tree: Path | None = typer.Option(
        None,
        "--server-tree",
        help="Run the server from this checkout (e.g. a `git worktree` of another commit).",
    ),
    port: int = typer.Option(0, "--port", min=0, help="The server's port (0: a free one)."),
    database: LoadDatabase = typer.Option(
        "sqlite",
        "--database",
        help="The server's database: SQLite in its storage (its default) or a throwaway "
        "PostgreSQL cluster started for each cell (Debian's postgresql package).",
    ),
    phones_nice: int = typer.Option(
        0,
        "--phones-nice",
        min=0,
        max=19,
        help="Run the phones' driver processes this much nicer than the server (in a deployment "
        "the phones are other machines; here they share its CPUs).",
    ),
    fraction: float = typer.Option(
        FRACTION,
        "--fraction",
        help="Share of the phones selected, each of which uploads, every round (e.g. 0.01 to "
        "compare 100 and 1,000 uploads a round on the same 10,000 phones).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands; run nothing."),
) -> None:
    """The federation server under N fake phones (the real HTTP contract, no training): seconds
    per round, uploads per round, /healthz latency, the server's peak RSS and every error by
    kind. A cell already in results.json with the same command is not run again."""
    from fedkey_bench.load.runner import LoadError, Options, run_load

    try:
        sizes = [int(p) for p in phones.split(",") if p.strip()]
    except ValueError:
        raise UserError(f"--phones {phones}: give sizes like 200,1000") from None
    if not sizes or min(sizes) < 1:
        raise UserError(f"--phones {phones}: give sizes like 200,1000")
    opts = Options(drivers=drivers, port=port, server_tree=server_tree)
    try:
        run_load(
            sizes,
            rounds,
            label,
            out,
            opts,
            dry_run=dry_run,
            bench_command=shlex.join(["fedkey-bench", *sys.argv[1:]]),
            database=str(database),
            phones_nice=phones_nice,
            fraction=fraction,
        )
    except LoadError as e:
        raise UserError(str(e)) from None


app.command("aggregation")(bench_aggregation)
app.command("cohorts")(bench_cohorts)
app.command("canary")(bench_canary)
app.command("typing")(bench_typing)
app.command("dpfinetune")(bench_dpfinetune)


@app.command("peers")
def bench_peers(
    framework: list[str] = typer.Option(
        [], "--framework", help="fedkey, flower or pfl (repeatable; default: all three)."
    ),
    workloads: list[str] = typer.Option(
        [],
        "--preset",
        help="ptb (PTB IID over 100 phones, 10 a round), irc (Ubuntu IRC, one phone per "
        "speaker: the 500 most active, 25 a round) or irc5k (its 5,000 most active, 1,000 a "
        "round, 3 rounds); repeatable: each in turn (default: ptb); the options below change "
        "each.",
    ),
    name: str | None = typer.Option(
        None,
        "--workload",
        help="The rows' workload name (default: from the sizes, e.g. ptb100k-h64-lr1-r10).",
    ),
    data: Path | None = typer.Option(
        None, "--data", help="The corpus folder (default: the preset's, under ../shared/data)."
    ),
    max_train_tokens: int | None = typer.Option(
        None, "--max-train-tokens", min=1, help="Keep only the first N training words (ptb: 100k)."
    ),
    max_eval_sentences: int | None = typer.Option(
        None, "--max-eval-sentences", min=1, help="Held-out sentences scored each round (500)."
    ),
    clients: int | None = typer.Option(None, "--clients", min=1, help="Phones (ptb 100, irc 500)."),
    fraction: float | None = typer.Option(
        None, "--fraction", min=0.0, max=1.0, help="C: the share of phones a round (ptb 0.1)."
    ),
    hidden_size: int | None = typer.Option(None, "--hidden-size", min=1, help="GRU units (64)."),
    rounds: int | None = typer.Option(
        None, "--rounds", "-R", min=1, help="Federated rounds (ptb, irc 10; irc5k 3)."
    ),
    batch_size: int | None = typer.Option(
        None, "--batch-size", "-B", min=1, help="Sentences a step."
    ),
    lr: float | None = typer.Option(
        None, "--lr", help="Local SGD learning rate (the presets 0.5)."
    ),
    precision: str = typer.Option(
        "fp32",
        "--precision",
        help="fp32, or bf16: fedkey's --precision bf16, the peers' model under torch.autocast "
        "bf16 (slow and unmeasured where the CPU has no native bf16).",
    ),
    workers: int = typer.Option(
        2, "--workers", min=1, help="Training processes / Ray actors / torchrun workers."
    ),
    repeats: int = typer.Option(
        3,
        "--repeats",
        min=1,
        help="Run the frameworks this many times, interleaved; a row: the repeats' medians and "
        "spread.",
    ),
    timeout: float = typer.Option(
        3600, "--timeout", min=1, help="Seconds one framework's run may take before it is killed."
    ),
    out: Path = typer.Option(
        RESULTS / "peers", "--out", help="Where results.json and results.md are written."
    ),
    work: Path = typer.Option(
        Path("runs/bench/peers"), "--work", help="The shared shards (.npz) and fedkey's run folder."
    ),
    fedkey_tree: Path = typer.Option(
        Path("."),
        "--fedkey-tree",
        help="Run `fedkey simulate` from this checkout (e.g. a clean export of a commit).",
    ),
) -> None:
    """The same federated workload (a --preset: PTB IID over 100 phones, or the Ubuntu IRC
    population one phone per speaker; a GRU with tied embeddings, C, E 1, FedAvg) in fedkey, in
    Flower's Simulation Engine and in pfl-research, each peer in its own venv under .venv-peers/
    (made from experiments/peers/<name>/requirements.txt the first time), every round the same
    cohort (fedkey's selection) in all three: seconds and CPU seconds per round (the median of
    --repeats and its spread), final test perplexity (void past 5% from fedkey's), peak RSS of
    the process tree. Rows replace those of the same framework and workload in
    OUT/results.json."""
    from fedkey_bench.peers.report import FRAMEWORKS
    from fedkey_bench.peers.runner import preset, run_peers

    unknown = sorted(set(framework) - set(FRAMEWORKS))
    if unknown:
        raise UserError(f"--framework {', '.join(unknown)}: choose from {', '.join(FRAMEWORKS)}")
    if data is not None and not data.is_dir():
        raise UserError(f"--data: no corpus folder {data}")
    keys = workloads or ["ptb"]
    if name is not None and len(keys) > 1:
        raise UserError("--workload names one workload: give one --preset with it")
    try:
        runs = [preset(key, name=name, data=data and str(data.resolve()),
                       max_train_tokens=max_train_tokens, max_eval_sentences=max_eval_sentences,
                       clients=clients, fraction=fraction, hidden_size=hidden_size,
                       rounds=rounds, batch_size=batch_size, lr=lr, workers=workers,
                       precision=precision) for key in keys]  # fmt: skip
    except ValueError as e:
        raise UserError(str(e)) from None
    for w in runs:
        if not Path(w.data).is_dir():
            raise UserError(
                f"--data: no corpus folder {w.data} (fedkey data fetch, or pass --data)"
            )
    for w in runs:
        run_peers(w, [f for f in FRAMEWORKS if not framework or f in framework], out,
                  work.resolve(), fedkey_tree.resolve(),
                  shlex.join(["fedkey-bench", *sys.argv[1:]]), repeats, timeout)  # fmt: skip


def main() -> None:
    """The `fedkey-bench` script (experiments/pyproject.toml); `python -m fedkey_bench.cli` too."""
    app()


if __name__ == "__main__":
    main()
