"""What is done with a trained model: export a checkpoint to ONNX, serve the web keyboard from
an export, show what a checkpoint holds, score it on held-out text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from fedkey.cli.errors import UserError, check_can_listen
from fedkey.cli.options import PHONES, check_url, settings_group, tls_pair, with_options

if TYPE_CHECKING:
    from fedkey.runners.rescore import Rescored


def not_a_checkpoint(path: Path, e: Exception) -> UserError:
    return UserError(f"{path} is not a .safetensors checkpoint ({e})")


def export(
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", exists=True, dir_okay=False, help="A .safetensors checkpoint."
    ),
    out: Path = typer.Option(
        Path("model.onnx"), "--out", help="The ONNX file; its metadata JSON is written beside it."
    ),
    int8: bool = typer.Option(
        False,
        "--int8",
        help="Also quantize the embedding and output matrices to int8 (onnxruntime dynamic).",
    ),
    data: str = typer.Option(
        "demo",
        "--data",
        help="Held-out text: its test split for the int8 perplexity change, its validation "
        "split for the n-gram's weight.",
    ),
    eval_sentences: int = typer.Option(
        500, "--eval-sentences", min=1, help="Held-out sentences for the int8 report."
    ),
    ngram: Path | None = typer.Option(
        None,
        "--ngram",
        dir_okay=False,
        help="An n-gram on the model's vocabulary (ngram.safetensors) for the keyboard to mix in; "
        "copied beside the model.",
    ),
    ngram_weight: float | None = typer.Option(
        None,
        "--ngram-weight",
        min=0.0,
        max=1.0,
        help="The model's share of the mixture (default: the checkpoint's ngram_weight, else "
        "the best on --data's validation split).",
    ),
) -> None:
    """Export a checkpoint to ONNX (recurrent state in and out); fails loudly if ONNX Runtime and PyTorch disagree."""
    from safetensors import SafetensorError

    from fedkey.corpora.loaders import load_corpus
    from fedkey.export.onnx_export import ExportParityError, export_checkpoint

    corpus = load_corpus(data) if int8 or ngram is not None else None
    held_out = corpus.test[:eval_sentences] if corpus is not None and int8 else None
    valid = corpus.valid[:eval_sentences] if corpus is not None and ngram is not None else None
    try:
        report = export_checkpoint(
            checkpoint, out, int8=int8, parity_text=held_out, ngram=ngram,
            ngram_weight=ngram_weight, weight_text=valid,
        )  # fmt: skip
    except ExportParityError as e:
        typer.echo(f"export failed the parity check: {e}", err=True)
        raise typer.Exit(1) from None
    except SafetensorError as e:
        raise not_a_checkpoint(checkpoint, e) from None
    except ValueError as e:  # an n-gram that is not one, or of another vocabulary
        raise UserError(str(e)) from None
    typer.echo(
        json.dumps(
            {k: (str(v) if isinstance(v, Path) else v) for k, v in report.__dict__.items()},
            indent=2,
        )
    )


def keyboard(
    model: Path | None = typer.Option(
        None, "--model", help="The exported model.onnx (default: DIR/model.onnx with --watch)."
    ),
    watch: Path | None = typer.Option(
        None, "--watch", help="Follow new exports written to this directory (no restart)."
    ),
    events: str | None = typer.Option(
        None,
        "--events",
        callback=check_url,
        help="The federation server's URL, for the live perplexity chart.",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    tls_cert: Path | None = typer.Option(
        None, "--tls-cert", help="Serve HTTPS with this certificate (PEM)."
    ),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="The certificate's private key."),
    operator_token: str | None = typer.Option(
        None,
        "--operator-token",
        envvar="FEDKEY_OPERATOR_TOKEN",
        show_default=False,
        help="With --events: the federation server's operator token, when it was started with "
        "one (better set in the environment, FEDKEY_OPERATOR_TOKEN, than on the command line).",
    ),
) -> None:
    """Serve the web keyboard: next-word suggestions from an ONNX model (onnxruntime, no torch)."""
    from fedkey.keyboard_web.app import serve as serve_keyboard

    if model is None and watch is None:
        raise typer.BadParameter("give --model or --watch", param_hint="--model")
    tls = tls_pair(tls_cert, tls_key)
    check_can_listen(host, port)
    typer.echo(f"keyboard on {'https' if tls else 'http'}://{host}:{port}/")
    serve_keyboard(
        model,
        host=host,
        port=port,
        watch_dir=watch,
        events_url=events,
        events_token=operator_token,
        tls=tls,
    )


def info(
    checkpoint: Path = typer.Argument(
        ..., exists=True, dir_okay=False, help="A .safetensors checkpoint."
    ),
) -> None:
    """Print what a checkpoint holds: model config, tokenizer, round, strategy, parameters."""
    from safetensors import SafetensorError

    from fedkey.models.checkpoint import load_checkpoint
    from fedkey.models.model import num_parameters

    try:
        model, tok, meta = load_checkpoint(checkpoint)
    except SafetensorError as e:
        raise not_a_checkpoint(checkpoint, e) from None
    summary = {k: v for k, v in meta.items() if k not in ("tokenizer", "server")}
    summary["tokenizer"] = {"kind": tok.kind, "vocab_size": tok.vocab_size}
    summary["parameters"] = num_parameters(model)
    typer.echo(json.dumps(summary, indent=2))


@with_options(
    settings_group(
        "data", "paper_protocol", "max_eval_sentences", "seed", "ksr_sentences", "precision"
    ),
    {"device": PHONES["device"], "partition": PHONES["partition"]},
)
def evaluate(
    checkpoint: Path = typer.Argument(
        ..., exists=True, dir_okay=False, help="A .safetensors checkpoint (a run's round_N)."
    ),
    clients: int = typer.Option(
        100,
        "--clients",
        "-K",
        min=1,
        help="The run's phones: with --partition user, the validation and test messages are "
        "those of these phones' senders, as the run scored them.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the scores as one JSON object."),
    **opts,
) -> None:
    """Score a checkpoint on held-out text as every round of a run does: validation and test perplexity, top-1/top-3, keystroke savings (and on the senders who never trained, for NUS SMS and Ubuntu IRC); set beside what the run recorded for it."""
    from rich.console import Console
    from safetensors import SafetensorError

    from fedkey.runners.rescore import rescore

    keys = ("data", "paper_protocol", "max_eval_sentences", "seed", "ksr_sentences", "device",
            "precision", "partition")  # fmt: skip
    try:
        with Console(stderr=True).status(f"scoring {checkpoint.name} on {opts['data']}"):
            r = rescore(checkpoint, clients=clients, **{k: opts[k] for k in keys})
    except SafetensorError as e:
        raise not_a_checkpoint(checkpoint, e) from None
    if as_json:
        typer.echo(json.dumps({**r.scores, "recorded": r.recorded or None, "agrees": r.agrees,
                               "precision": r.precision, "device": r.device}))  # fmt: skip
        return
    _print_scores(checkpoint, r)
    if r.agrees is None:
        return
    typer.echo(f"the same as the run recorded at round {r.round}" if r.agrees else
               f"not what the run recorded at round {r.round}: score the run's own held-out "
               "text (its --data, --paper-protocol, --max-eval-sentences, --ksr-sentences, "
               "--partition and --clients; a "
               f"bench run's are in its command.txt) at its precision ({r.recorded_precision})")  # fmt: skip


def _print_scores(checkpoint: Path, r: Rescored) -> None:
    from rich.console import Console
    from rich.table import Table

    from fedkey.runners.rescore import SCORES

    table = Table(title=f"{checkpoint.name} (round {r.round}, {r.strategy}): {r.sentences[0]} "
                  f"validation and {r.sentences[1]} test sentences, {r.precision}")  # fmt: skip
    for col in ("measure", "now", *(["recorded"] if r.recorded else [])):
        table.add_column(col, justify="left" if col == "measure" else "right")
    for key, name in SCORES.items():
        if key not in r.scores and key not in r.recorded:  # no held-out senders in this corpus
            continue
        digits = ".2f" if key.endswith("ppl") else ".3f"
        cells = [r.scores.get(key), *([r.recorded.get(key)] if r.recorded else [])]
        table.add_row(name, *("-" if v is None else format(v, digits) for v in cells))
    Console().print(table)
