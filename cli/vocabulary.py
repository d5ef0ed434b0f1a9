"""`fedkey vocabulary`: the base vocabulary and what joins it. `fedkey vocabulary discover`: the
words many phones type that the base lacks, released by a differentially private federated count
and added to a new base (fedkey.runners.vocabulary)."""

from __future__ import annotations

from pathlib import Path

import typer

from fedkey.cli.errors import UserError
from fedkey.cli.options import PHONES
from fedkey.common.config import DataConfig, Scheme

vocabulary_app = typer.Typer(
    help="The base model's vocabulary: words the phones type, added under differential privacy.",
    no_args_is_help=True,
)

#: The words of the release shown per line of the listing.
_PER_LINE = 6


@vocabulary_app.command("discover")
def vocabulary_discover(
    init: str | None = typer.Option(
        None,
        "--init",
        help="The base model whose vocabulary to extend: a checkpoint of fedkey pretrain with a "
        "word vocabulary, or 'base' (the shipped one). Required.",
    ),
    data: str = typer.Option(
        "nus-sms",
        "--data",
        help="The phones' text: 'nus-sms' (one phone per sender with --partition user), "
        "'ubuntu-irc', 'demo' or a corpus directory.",
    ),
    partition: Scheme = typer.Option(
        "user", "--partition", help="How the text is cut into phones (user: one per sender)."
    ),
    clients: int = typer.Option(
        ...,
        "--clients",
        "-K",
        min=1,
        help="Phones (with --partition user: the K senders with the most training messages).",
    ),
    alpha: float = PHONES["alpha"][1],
    epsilon: float = typer.Option(
        ..., "--epsilon", help="The privacy budget the release spends, for each phone (> 0)."
    ),
    delta: float | None = typer.Option(
        None, "--delta", help="The release's delta (default: 1 / phones^1.1)."
    ),
    max_words_per_phone: int | None = typer.Option(
        None,
        "--max-words-per-phone",
        "-k",
        min=1,
        help="Out-of-vocabulary words a phone votes for at most, those it typed most "
        "(default: 10, chosen on NUS SMS's validation text).",
    ),
    max_train_tokens: int | None = typer.Option(
        None, "--max-train-tokens", min=1, help="Read only the first N training words."
    ),
    max_eval_sentences: int | None = typer.Option(
        None,
        "--max-eval-sentences",
        min=1,
        help="Measure the out-of-vocabulary rate on at most N held-out sentences a split.",
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds the corpus's splits and the partition."),
    out: Path = typer.Option(
        ..., "--out", help="The extended base to write (a new file; --init it like any base)."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="A bar over the phones."),
) -> None:
    """Find the words many phones type that the base vocabulary lacks, by a differentially
    private federated count: each phone votes for at most k out-of-vocabulary words it typed,
    the server adds Gaussian noise to the counts and releases the words above a threshold
    (DP set union), then writes the base extended with them. Prints the words, the release's
    (epsilon, delta) and the out-of-vocabulary rate of the held-out text before and after."""
    from fedkey.runners.vocabulary import DEFAULT_MAX_WORDS, DiscoverConfig, check
    from fedkey.runners.vocabulary import discover_vocabulary as run

    config = DiscoverConfig(
        DataConfig(
            data=data,
            clients=clients,
            partition=partition,
            alpha=alpha,
            max_train_tokens=max_train_tokens,
            max_eval_sentences=max_eval_sentences,
            seed=seed,
            init=init,
        ),
        epsilon=epsilon,
        out=out,
        max_words=max_words_per_phone or DEFAULT_MAX_WORDS,
        delta=delta,
        progress=progress,
    )
    try:
        check(config)
    except ValueError as e:
        raise UserError(str(e)) from None
    print_discovery(run(config))


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def print_discovery(result) -> None:
    """The release and its effect as one table, then the released words with their noisy
    counts (the release itself: DP, so it may be shown)."""
    from rich.console import Console
    from rich.table import Table

    p = result.release.plan
    table = Table(title="vocabulary discovered by a DP federated count")
    table.add_column("", no_wrap=True)
    table.add_column("value", justify="right")
    table.add_row("phones", str(p.phones))
    table.add_row("words a phone votes for, at most", str(p.max_words))
    table.add_row("epsilon", f"{p.epsilon:.3g}")
    table.add_row("delta", f"{p.delta:.3g}")
    table.add_row("noise std / threshold (phones)", f"{p.sigma:.2f} / {p.threshold:.2f}")
    released, size = result.release.words, result.size_before
    table.add_row("words released", str(len(released)))
    table.add_row("vocabulary", f"{size} -> {size + len(released)}")
    labels = {"valid": "validation", "test": "test", "unseen": "senders never in the federation"}
    for split, (before, after) in result.oov.items():
        name = f"out of vocabulary, {labels[split]} ({result.sentences[split]} sentences)"
        table.add_row(name, f"{_rate(before)} -> {_rate(after)}")
    console = Console()
    Console(width=max(console.width, 100)).print(table)
    words = [f"{w} ({c:.1f})" for w, c in released]
    typer.echo("released (noisy phone counts):" if words else "released: no word")
    for i in range(0, len(words), _PER_LINE):
        typer.echo("  " + ", ".join(words[i : i + _PER_LINE]))
    typer.echo(f"extended base: {result.out}  (start a federation from it: --init {result.out})")
