"""`fedkey pretrain`: a base model of public text, for federations to start from (--init)."""

from __future__ import annotations

from pathlib import Path

import typer

from fedkey.cli.federation import print_table
from fedkey.cli.options import PHONES, build_settings, settings_group, with_options

#: The public text to pretrain on, and its vocabulary.
PUBLIC_DATA = {
    "data": (
        str,
        typer.Option(
            "chitchat",
            "--data",
            help="Public text to pretrain on: 'chitchat' (the Chit-Chat dataset's pretraining "
            "senders, installed with fedkey), 'ubuntu-irc', or a corpus directory. Never the "
            "phones' text: 'nus-sms' and 'chitchat-heldout' are refused.",
        ),
    ),
    **settings_group(
        "paper_protocol", "tokenizer", "vocab_size", "tokenizer_text", "max_train_tokens",
        "max_eval_sentences", "seed",
    ),
}  # fmt: skip


@with_options(
    PUBLIC_DATA,
    settings_group("model", "hidden_size", "cell", "layers", "tied", "dropout"),
    settings_group(
        "batch_size", "lr", "momentum", "clip", "precision", "ksr_sentences", "lr_decay"
    ),
    {"device": PHONES["device"]},
)
def pretrain(
    epochs: int = typer.Option(3, "--epochs", min=1, help="Passes over the public training text."),
    out: Path = typer.Option(
        Path("runs/base"),
        "--out",
        help="Run directory (checkpoints/, metrics.jsonl, perplexity.png, as train-central's); "
        "the base model is OUT/base.safetensors.",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --out after its last epoch's checkpoint (same settings).",
    ),
    **opts,
) -> None:
    """Train the language model centrally on public text only: the base model a federation
    starts from (simulate, run, server or train-central --init OUT/base.safetensors), whose
    vocabulary then encodes the phones' text. Its metadata names its corpora, its vocabulary
    and its recipe (fedkey info shows them)."""
    from fedkey.runners.pretrain import PretrainConfig
    from fedkey.runners.pretrain import pretrain as run_pretrain

    settings = build_settings(opts, storage=out, init=None)  # a base of its own: no FEDKEY_INIT
    rows, base = run_pretrain(
        PretrainConfig(
            settings.data_config(),
            settings.train_config(),
            settings.build_model_config,
            str(out),
            epochs,
            opts["device"],
            resume=resume,
            lr_decay=settings.lr_decay,
            ksr_sentences=settings.ksr_sentences,
        )
    )
    print_table(rows)
    typer.echo(f"base model: {base}  (start a federation from it: --init {base})")
