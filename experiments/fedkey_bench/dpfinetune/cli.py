"""The `fedkey-bench dpfinetune` command: its options, a Protocol from them, the run."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from fedkey.cli.errors import UserError
from fedkey_bench.common.checkout import RESULTS
from fedkey_bench.dpfinetune.cells import EPSILONS, POPULATIONS, STRATEGIES, Protocol

DEFAULT = Protocol()
EPSILONS_TEXT = ", ".join(f"{e:g}" for e in EPSILONS)


def _check(population: list[str], strategy: list[str], epsilon: list[float]) -> None:
    unknown = sorted(set(population) - set(POPULATIONS))
    if unknown:
        raise UserError(f"--population {', '.join(unknown)}: choose from {', '.join(POPULATIONS)}")
    bad = sorted(set(strategy) - set(STRATEGIES))
    if bad:
        raise UserError(f"--strategy {', '.join(bad)}: choose from {', '.join(STRATEGIES)}")
    if any(not e > 0 for e in epsilon):
        raise UserError("--epsilon: a target epsilon must be > 0")
    for name in population:
        _check_data(POPULATIONS[name].data)


def _check_data(data: str) -> None:
    """A corpus of the data directory that is not there: fedkey's own one line, before any run."""
    from fedkey.corpora.datadir import MissingCorpus, corpus_path
    from fedkey.corpora.loaders import NAMED_CORPORA

    if data in NAMED_CORPORA:
        try:
            corpus_path(data)
        except MissingCorpus as e:
            raise UserError(str(e)) from None


def command(
    population: list[str] = typer.Option(
        ["ubuntu-irc"], "--population", help=f"{' or '.join(POPULATIONS)} (repeatable)."),
    init: str = typer.Option("base", "--init", help="The base every run starts from ('base': the shipped one)."),
    ngram: str = typer.Option("base", "--ngram", help="The public 3-gram ('base': the shipped base's)."),
    clients: int | None = typer.Option(
        None, "--clients", "-K", min=2,
        help="Phones: the most active senders (default: the population's; Ubuntu IRC all 15,853)."),
    fraction: float | None = typer.Option(
        None, "--fraction", "-C", min=0.0, max=1.0,
        help="Share of the phones a round (default: the population's; Ubuntu IRC 0.0631: cohorts of 1,000)."),
    rounds: int = typer.Option(DEFAULT.rounds, "--rounds", "-R", min=1, help="Rounds of every run."),
    workers: int = typer.Option(DEFAULT.workers, "--workers", min=0, help="Training processes of each run."),
    max_eval_sentences: int = typer.Option(
        DEFAULT.max_eval_sentences, "--max-eval-sentences", min=1,
        help="Validation and test messages scored each round (the first N)."),
    epsilon: list[float] = typer.Option(
        [], "--epsilon", help=f"A target epsilon of the DP cells (repeatable; default {EPSILONS_TEXT})."),
    strategy: list[str] = typer.Option(
        [], "--strategy", help=f"A strategy of the DP cells: {' or '.join(STRATEGIES)} (repeatable; default both)."),
    clip: float | None = typer.Option(
        None, "--clip", min=0.0,
        help="The DP cells' first clip S0 (default: the non-private FedAvg run's first median update norm)."),
    only: list[str] = typer.Option(
        [], "--only", help="Run only the cells whose id matches this glob, e.g. 'fedavg-*' (repeatable)."),
    out: Path = typer.Option(RESULTS / "dpfinetune", "--out", help="results.json, results.md and runs/."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands; run nothing."),
) -> None:  # fmt: skip
    """Private fine-tuning from the public base: the base alone (round 0), the non-private
    fine-tune (FedAvg, FedAtt) and DP-FTRL with BLT noise and adaptive clipping at each target
    epsilon, each population's phones one per sender: the best-validation round's test
    perplexity, top-1 over every word and keystroke savings, alone and with the public 3-gram,
    epsilon, delta, z and the cohort, as multiples of the non-private fine-tune and of the base.
    A run already recorded with the same command is not run again; an interrupted one resumes."""
    from fedkey_bench.dpfinetune import runner

    _check(population, strategy, epsilon)
    if clip is not None and not clip > 0:
        raise UserError("--clip: S0 must be > 0")
    # A path as the runs (started in the checkout) read it.
    init, ngram = (v if v == "base" else str(Path(v).expanduser().resolve()) for v in (init, ngram))
    p = Protocol(init=init, ngram=ngram, clients=clients, fraction=fraction, rounds=rounds,
                 workers=workers, max_eval_sentences=max_eval_sentences,
                 epsilons=tuple(dict.fromkeys(epsilon)) or EPSILONS,
                 strategies=tuple(dict.fromkeys(strategy)) or DEFAULT.strategies, clip=clip)  # fmt: skip
    bench = shlex.join(["fedkey-bench", *sys.argv[1:]])
    refused: dict[str, str] = {}
    try:
        for name in dict.fromkeys(population):
            if dry_run:
                runner.dry_run(POPULATIONS[name], p, out.resolve(), only or None)
                continue
            refused |= runner.run_population(
                POPULATIONS[name], p, out.resolve(), only or None, bench
            )
    except (ValueError, RuntimeError) as e:
        raise UserError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if dry_run:
        return
    print(out / "results.md")
    if refused:
        raise UserError("\n".join(f"{k}: {v}" for k, v in refused.items()))
