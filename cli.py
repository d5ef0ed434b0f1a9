"""fedkey: one command line for the federated keyboard.

    fedkey simulate       federated rounds in-process (phones in local worker processes)
    fedkey train-central  the same model trained on all the data at once: the quality ceiling
    fedkey info           what a checkpoint holds

Every subcommand has --help.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

import typer

app = typer.Typer(
    help="fedkey: a federated next-word keyboard. Train by federated learning, compare aggregation methods.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Strategy(StrEnum):
    fedsgd = "fedsgd"
    fedavg = "fedavg"
    fedatt = "fedatt"
    fedattopt = "fedattopt"
    fedmed = "fedmed"


class Cell(StrEnum):
    gru = "gru"
    lstm = "lstm"


class Preset(StrEnum):
    small = "small"
    medium = "medium"
    large = "large"


class TokenizerKind(StrEnum):
    word = "word"
    sentencepiece = "sentencepiece"


class Partition(StrEnum):
    iid = "iid"
    user = "user"
    dirichlet = "dirichlet"


DATA_HELP = "'demo' (the embedded corpus) or a directory: train/valid/test.txt (PTB, WikiText-2), one .txt per user, a .jsonl of {user, text}, or a StackExchange Posts.xml."

# Options shared by simulate and train-central.
DataOpt = typer.Option("demo", "--data", help=DATA_HELP)
PaperOpt = typer.Option(
    False,
    "--paper-protocol",
    help="The seeds' preprocessing: lowercase, split lines on ' . ', vocabulary from all splits.",
)
TokOpt = typer.Option(
    TokenizerKind.word,
    "--tokenizer",
    help="Word vocabulary or SentencePiece (trained on the server's text).",
)
VocabOpt = typer.Option(10_000, "--vocab-size", help="Maximum vocabulary size (specials included).")
TokTextOpt = typer.Option(
    None,
    "--tokenizer-text",
    help="SentencePiece: public text the server trains it on (.txt or a corpus dir); never the phones' data. The demo has its own.",
)
ModelOpt = typer.Option(
    Preset.small,
    "--model",
    help="Size preset: small 300, medium 650, large 1500 (embedding = hidden).",
)
CellOpt = typer.Option(Cell.gru, "--cell", help="Recurrent cell.")
LayersOpt = typer.Option(1, "--layers", min=1, max=4, help="Recurrent layers.")
UntiedOpt = typer.Option(
    False, "--untied", help="Separate input and output embeddings (default: tied)."
)
DropoutOpt = typer.Option(
    0.0, "--dropout", min=0.0, max=0.9, help="Dropout on embeddings and outputs."
)
ClientsOpt = typer.Option(100, "--clients", "-K", min=1, help="Number of simulated phones.")
PartOpt = typer.Option(
    Partition.iid,
    "--partition",
    help="iid: the seeds' equal shards; user: one phone per user; dirichlet: non-IID.",
)
AlphaOpt = typer.Option(
    0.5, "--alpha", help="Dirichlet concentration (with --partition dirichlet)."
)
EpochsOpt = typer.Option(5, "--local-epochs", "-E", min=1, help="Local epochs per round.")
BatchOpt = typer.Option(10, "--batch-size", "-B", min=1, help="Sentences per batch.")
LrOpt = typer.Option(
    1.0, "--lr", help="Local SGD learning rate (the seeds use 0.01, which learns far slower)."
)
MomOpt = typer.Option(0.5, "--momentum", help="Local SGD momentum.")
ClipOpt = typer.Option(5.0, "--clip", help="Gradient-norm clipping in local training (0: off).")
MaxTokOpt = typer.Option(
    None, "--max-train-tokens", help="Keep only the first N training words (reduced CPU runs)."
)
MaxEvalOpt = typer.Option(
    None, "--max-eval-sentences", help="Keep only the first N validation and test sentences."
)
SeedOpt = typer.Option(
    0, "--seed", help="Seeds partitioning, initialization, selection, training and noise."
)
DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when available), cpu or cuda.")


def _model_config_for(model: Preset, cell: Cell, layers: int, untied: bool, dropout: float):
    from models.model import ModelConfig

    def make(vocab_size: int) -> ModelConfig:
        return ModelConfig.preset(
            model.value,
            vocab_size,
            cell=cell.value,
            num_layers=layers,
            tied=not untied,
            dropout=dropout,
        )

    return make


def _print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="perplexity per round")
    for col in (
        "round",
        "aggregated",
        "val_ppl",
        "test_ppl",
        "top1",
        "top3",
        "ksr",
        "epsilon",
        "seconds",
    ):
        table.add_column(col, justify="right")

    def fmt(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    for r in rows:
        table.add_row(
            str(r["round"]),
            str(len(r["aggregated"])),
            fmt(r["val_ppl"]),
            fmt(r["test_ppl"]),
            fmt(r["top1"], ".3f"),
            fmt(r["top3"], ".3f"),
            fmt(r["ksr"], ".3f"),
            fmt(r["epsilon"]),
            fmt(r["seconds"], ".1f"),
        )
    Console().print(table)


@app.command()
def simulate(
    data: str = DataOpt,
    strategy: Strategy = typer.Option(Strategy.fedavg, "--strategy", help="Aggregation method."),
    clients: int = ClientsOpt,
    fraction: float = typer.Option(
        0.1,
        "--fraction",
        "-C",
        min=0.0,
        max=1.0,
        help="Share of phones selected per round (fedsgd uses all).",
    ),
    rounds: int = typer.Option(10, "--rounds", "-R", min=1, help="Federated rounds."),
    local_epochs: int = EpochsOpt,
    batch_size: int = BatchOpt,
    lr: float = LrOpt,
    momentum: float = MomOpt,
    clip: float = ClipOpt,
    max_train_tokens: int | None = MaxTokOpt,
    max_eval_sentences: int | None = MaxEvalOpt,
    seed: int = SeedOpt,
    out: Path = typer.Option(
        Path("runs/simulate"),
        "--out",
        help="Run directory: checkpoints/, metrics.jsonl, perplexity.png.",
    ),
    partition: Partition = PartOpt,
    alpha: float = AlphaOpt,
    paper_protocol: bool = PaperOpt,
    tokenizer: TokenizerKind = TokOpt,
    vocab_size: int = VocabOpt,
    tokenizer_text: str | None = TokTextOpt,
    model: Preset = ModelOpt,
    cell: Cell = CellOpt,
    layers: int = LayersOpt,
    untied: bool = UntiedOpt,
    dropout: float = DropoutOpt,
    epsilon: float | None = typer.Option(
        None, "--epsilon", help="Server step size of fedatt / fedattopt (default 1.2)."
    ),
    norm: str = typer.Option("l2", "--norm", help="fedatt distance: l2 (flattened) or spectral."),
    eta: float = typer.Option(1.0, "--eta", help="fedmed step size (1 = weighted average)."),
    epsilon_med: float = typer.Option(
        0.1, "--epsilon-med", help="fedmed mediation threshold on the change of mean loss."
    ),
    beta_topk: float = typer.Option(
        1.0,
        "--topk-beta",
        help="fedmed topK: share of trained phones that upload (1 = off; paper best 0.8).",
    ),
    adafl: bool = typer.Option(
        False,
        "--adafl",
        help="AdaFL attention-based client selection with a dynamic fraction (0.1 -> 0.5).",
    ),
    dp_beta: float = typer.Option(
        0.0,
        "--dp-beta",
        help="Seeds' randomization: each phone adds beta * N(0, 1) to its weights (no formal guarantee).",
    ),
    dp_clip: float | None = typer.Option(
        None, "--dp-clip", help="DP-FedAvg: clip each update to this L2 norm (turns DP-FedAvg on)."
    ),
    dp_noise: float = typer.Option(
        1.0, "--dp-noise-multiplier", help="DP-FedAvg noise multiplier z: N(0, (z S)^2) on the sum."
    ),
    dp_delta: float = typer.Option(
        1e-5, "--dp-delta", help="DP-FedAvg delta for the reported epsilon."
    ),
    dp_budget: float | None = typer.Option(
        None, "--dp-target-epsilon", help="DP-FedAvg: stop once epsilon exceeds this."
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        help="Training processes (default: one per core; 0 trains in this process).",
    ),
    device: str = DeviceOpt,
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --out after its last checkpoint (same settings).",
    ),
) -> None:
    """Run federated rounds in-process and print perplexity per round."""
    from device_sim.dataset import DataConfig
    from device_sim.simulate import simulate as run
    from device_sim.trainer import TrainConfig
    from server.engine import FederationConfig, PrivacyConfig

    params: dict = {}
    if strategy in (Strategy.fedatt, Strategy.fedattopt) and epsilon is not None:
        params["epsilon"] = epsilon
    if strategy == Strategy.fedatt:
        params["norm"] = norm
    if strategy == Strategy.fedmed:
        params.update(eta=eta, epsilon_med=epsilon_med, beta=beta_topk)
    if adafl:
        params["selector"] = "adafl"
    if dp_clip is not None and (strategy != Strategy.fedavg or adafl):
        # The guarantee holds for a plain average of clipped updates over uniformly sampled phones.
        raise typer.BadParameter(
            "DP-FedAvg (--dp-clip) runs with --strategy fedavg and uniform selection",
            param_hint="--dp-clip",
        )
    fed = FederationConfig(
        strategy=strategy.value,
        strategy_params=params,
        fraction=fraction,
        rounds=rounds,
        seed=seed,
        train=TrainConfig(
            epochs=local_epochs, batch_size=batch_size, lr=lr, momentum=momentum, clip=clip
        ),
        privacy=PrivacyConfig(
            beta=dp_beta,
            clip_norm=dp_clip,
            noise_multiplier=dp_noise,
            delta=dp_delta,
            target_epsilon=dp_budget,
        ),
    )
    data_cfg = DataConfig(
        data=data,
        paper_protocol=paper_protocol,
        tokenizer=tokenizer.value,
        vocab_size=vocab_size,
        tokenizer_text=tokenizer_text,
        clients=clients,
        partition=partition.value,
        alpha=alpha,
        max_train_tokens=max_train_tokens,
        max_eval_sentences=max_eval_sentences,
        seed=seed,
    )
    rows = run(
        data_cfg,
        fed,
        _model_config_for(model, cell, layers, untied, dropout),
        str(out),
        workers,
        device,
        resume=resume,
    )
    _print_table(rows)
    typer.echo(
        f"metrics: {out / 'metrics.jsonl'}  plot: {out / 'perplexity.png'}  checkpoints: {out / 'checkpoints'}"
    )


@app.command("train-central")
def train_central_cmd(
    data: str = DataOpt,
    epochs: int = typer.Option(
        5, "--epochs", min=1, help="Passes over the union of the phones' data."
    ),
    clients: int = ClientsOpt,
    batch_size: int = BatchOpt,
    lr: float = LrOpt,
    momentum: float = MomOpt,
    clip: float = ClipOpt,
    max_train_tokens: int | None = MaxTokOpt,
    max_eval_sentences: int | None = MaxEvalOpt,
    seed: int = SeedOpt,
    out: Path = typer.Option(
        Path("runs/central"), "--out", help="Run directory, same layout as simulate."
    ),
    partition: Partition = PartOpt,
    paper_protocol: bool = PaperOpt,
    tokenizer: TokenizerKind = TokOpt,
    vocab_size: int = VocabOpt,
    tokenizer_text: str | None = TokTextOpt,
    model: Preset = ModelOpt,
    cell: Cell = CellOpt,
    layers: int = LayersOpt,
    untied: bool = UntiedOpt,
    dropout: float = DropoutOpt,
    device: str = DeviceOpt,
) -> None:
    """Train the same model centrally on the union of the phones' data: the ceiling for federated quality."""
    from device_sim.dataset import DataConfig
    from device_sim.simulate import train_central
    from device_sim.trainer import TrainConfig

    data_cfg = DataConfig(
        data=data,
        paper_protocol=paper_protocol,
        tokenizer=tokenizer.value,
        vocab_size=vocab_size,
        tokenizer_text=tokenizer_text,
        clients=clients,
        partition=partition.value,
        max_train_tokens=max_train_tokens,
        max_eval_sentences=max_eval_sentences,
        seed=seed,
    )
    train = TrainConfig(epochs=1, batch_size=batch_size, lr=lr, momentum=momentum, clip=clip)
    rows = train_central(
        data_cfg,
        train,
        _model_config_for(model, cell, layers, untied, dropout),
        str(out),
        epochs,
        seed,
        device,
    )
    _print_table(rows)
    typer.echo(f"metrics: {out / 'metrics.jsonl'}  plot: {out / 'perplexity.png'}")


@app.command()
def info(
    checkpoint: Path = typer.Argument(
        ..., exists=True, dir_okay=False, help="A .safetensors checkpoint."
    ),
) -> None:
    """Print what a checkpoint holds: model config, tokenizer, round, strategy, parameters."""
    from models.checkpoint import load_checkpoint
    from models.model import num_parameters

    model, tok, meta = load_checkpoint(checkpoint)
    summary = {k: v for k, v in meta.items() if k != "tokenizer"}
    summary["tokenizer"] = {"kind": tok.kind, "vocab_size": tok.vocab_size}
    summary["parameters"] = num_parameters(model)
    typer.echo(json.dumps(summary, indent=2))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
