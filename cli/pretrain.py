"""`fedkey pretrain`: a base model of public text, for federations to start from (--init)."""

from __future__ import annotations

from pathlib import Path

import typer

from fedkey.cli.federation import print_table
from fedkey.cli.options import CONTEXT, PHONES, build_settings, settings_group, with_options

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
    shipped: bool = typer.Option(
        False,
        "--shipped",
        help="Train the base that ships with fedkey (--init base) with its recipe, and write it "
        "(fp16) into the package. Another option changes the recipe: the base then stays in "
        "--out and is not shipped (a reduced check of the recipe).",
    ),
    **opts,
) -> None:
    """Train the language model centrally on public text only: the base model a federation
    starts from (simulate, run, server or train-central --init OUT/base.safetensors), whose
    vocabulary then encodes the phones' text. Its metadata names its corpora, its vocabulary
    and its recipe (fedkey info shows them)."""
    from fedkey.runners.pretrain import PretrainConfig
    from fedkey.runners.pretrain import pretrain as run_pretrain

    recipe, changed = shipped_recipe(opts) if shipped else ({}, [])
    epochs = recipe.pop("epochs", epochs)
    # A base of its own: no FEDKEY_INIT.
    settings = build_settings({**opts, **recipe}, storage=out, init=None)
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
    if shipped:
        ship_base(base, changed)


def shipped_recipe(opts: dict) -> tuple[dict, list[str]]:
    """--shipped: the recipe's value of every option not given (flag or environment), the
    epochs included, and the flags that were given: each of them changes the recipe."""
    from fedkey.runners.pretrain import SHIPPED_EPOCHS, SHIPPED_RECIPE

    ctx = opts[CONTEXT]
    names = [name for name in (*opts, "epochs") if name not in (CONTEXT, "device")]
    given = [name for name in names if ctx.get_parameter_source(name).name != "DEFAULT"]
    recipe = {**SHIPPED_RECIPE, "epochs": SHIPPED_EPOCHS}
    kept = {name: value for name, value in recipe.items() if name not in given}
    return kept, ["--" + name.replace("_", "-") for name in given]


def ship_base(base: Path, changed: list[str]) -> None:
    """Write the base into the package as the shipped one, unless the recipe was changed."""
    from fedkey.models.base import SHIPPED
    from fedkey.runners.pretrain import ship

    if changed:
        typer.echo(f"not shipped: {', '.join(changed)} changed the recipe of the shipped base")
        return
    typer.echo(f"shipped base: {ship(base, SHIPPED)}  (--init base)")
