"""fedkey: one command line for the federated keyboard.

    fedkey simulate       federated rounds in-process (phones in local worker processes)
    fedkey server         the federation server (FastAPI) for real devices over HTTP
    fedkey devices        a fleet of simulated phones that train against a server
    fedkey run            a server and a fleet on loopback: `simulate`, over real HTTP
    fedkey export         a checkpoint to ONNX (parity-checked; --int8)
    fedkey keyboard       the web keyboard: suggestions from an ONNX model
    fedkey demo           all of it on the demo corpus (what `make demo` runs)
    fedkey train-central  the same model trained on all the data at once: the quality ceiling
    fedkey info           what a checkpoint holds

Every subcommand has --help. The federation's options are defined once, from server.settings
(their defaults are the Settings defaults); every one can also be set by an environment variable
FEDKEY_<NAME> (for example FEDKEY_ROUNDS=20), flags winning.
"""

from __future__ import annotations

import inspect
import json
import os
import secrets
import subprocess
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from runners.processes import free_port, wait_healthy
from server.settings import Settings

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


class ServerOpt(StrEnum):
    none = "none"
    momentum = "momentum"
    adam = "adam"


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


class Batching(StrEnum):
    sentences = "sentences"
    columns = "columns"


class Attack(StrEnum):
    scale = "scale"
    nan = "nan"
    shape = "shape"


def _opt(name: str, *flags: str, default: Any = ..., **kw) -> Any:
    """An option whose default is the Settings default and whose env variable is FEDKEY_<NAME>."""
    if default is ...:
        default = Settings.model_fields[name].default
    return typer.Option(default, *flags, envvar=f"FEDKEY_{name.upper()}", **kw)


# name -> (type, typer.Option). Groups of options shared by several commands.
DATA = {
    "data": (
        str,
        _opt(
            "data",
            "--data",
            help="'demo' (the embedded corpus) or a directory: train/valid/test.txt (PTB, WikiText-2), one .txt per user, a .jsonl of {user, text}, or a StackExchange Posts.xml.",
        ),
    ),
    "paper_protocol": (
        bool,
        _opt(
            "paper_protocol",
            "--paper-protocol",
            help="The seeds' preprocessing: lowercase, split lines on ' . ', vocabulary from all splits.",
        ),
    ),
    "tokenizer": (
        TokenizerKind,
        _opt(
            "tokenizer",
            "--tokenizer",
            default=TokenizerKind.word,
            help="Word vocabulary or SentencePiece.",
        ),
    ),
    "vocab_size": (
        int,
        _opt("vocab_size", "--vocab-size", help="Maximum vocabulary size (specials included)."),
    ),
    "tokenizer_text": (
        str | None,
        _opt(
            "tokenizer_text",
            "--tokenizer-text",
            help="SentencePiece: public text the server trains it on (.txt or a corpus dir); never the phones' data. The demo has its own.",
        ),
    ),
    "max_train_tokens": (
        int | None,
        _opt(
            "max_train_tokens",
            "--max-train-tokens",
            help="Keep only the first N training words (reduced CPU runs).",
        ),
    ),
    "max_eval_sentences": (
        int | None,
        _opt(
            "max_eval_sentences",
            "--max-eval-sentences",
            help="Keep only the first N validation and test sentences.",
        ),
    ),
    "seed": (
        int,
        _opt(
            "seed",
            "--seed",
            help="Seeds partitioning, initialization, selection, training and noise.",
        ),
    ),
}
MODEL = {
    "model": (
        Preset,
        _opt(
            "model",
            "--model",
            default=Preset.small,
            help="Size preset: small 300, medium 650, large 1500 (embedding = hidden).",
        ),
    ),
    "cell": (Cell, _opt("cell", "--cell", default=Cell.gru, help="Recurrent cell.")),
    "layers": (int, _opt("layers", "--layers", min=1, max=4, help="Recurrent layers.")),
    "tied": (bool, _opt("tied", "--tied/--untied", help="Share input and output embeddings.")),
    "dropout": (
        float,
        _opt("dropout", "--dropout", min=0.0, max=0.9, help="Dropout on embeddings and outputs."),
    ),
}
TRAIN = {
    "local_epochs": (
        int,
        _opt("local_epochs", "--local-epochs", "-E", min=1, help="Local epochs per round."),
    ),
    "batch_size": (
        int,
        _opt("batch_size", "--batch-size", "-B", min=1, help="Sentences per batch."),
    ),
    "lr": (
        float,
        _opt(
            "lr",
            "--lr",
            help="Local SGD learning rate (the seeds use 0.01, which learns far slower).",
        ),
    ),
    "momentum": (float, _opt("momentum", "--momentum", help="Local SGD momentum.")),
    "clip": (
        float,
        _opt("clip", "--clip", help="Gradient-norm clipping in local training (0: off)."),
    ),
    "batching": (
        Batching,
        _opt(
            "batching",
            "--batching",
            default=Batching.sentences,
            help="sentences: language modelling. columns: the batches the seeds' published code trained on (token j of each sentence in a batch, cut to the shortest), to reproduce their numbers; adds their column perplexity to the metrics.",
        ),
    ),
}
FEDERATION = {
    "strategy": (
        Strategy,
        _opt("strategy", "--strategy", default=Strategy.fedavg, help="Aggregation method."),
    ),
    "fraction": (
        float,
        _opt(
            "fraction",
            "--fraction",
            "-C",
            min=0.0,
            max=1.0,
            help="Share of phones selected per round (fedsgd uses all).",
        ),
    ),
    "rounds": (int, _opt("rounds", "--rounds", "-R", min=1, help="Federated rounds.")),
    "epsilon": (
        float | None,
        _opt("epsilon", "--epsilon", help="Server step size of fedatt / fedattopt (default 1.2)."),
    ),
    "norm": (str, _opt("norm", "--norm", help="fedatt distance: l2 (flattened) or spectral.")),
    "eta": (float, _opt("eta", "--eta", help="fedmed step size (1 = weighted average).")),
    "epsilon_med": (
        float,
        _opt(
            "epsilon_med",
            "--epsilon-med",
            help="fedmed mediation threshold on the change of mean loss.",
        ),
    ),
    "topk_beta": (
        float,
        _opt(
            "topk_beta",
            "--topk-beta",
            help="fedmed topK: share of trained phones that upload (1 = off; paper best 0.8).",
        ),
    ),
    "adafl": (
        bool,
        _opt(
            "adafl",
            "--adafl",
            help="AdaFL attention-based client selection with a dynamic fraction (0.1 -> 0.5).",
        ),
    ),
    "server_opt": (
        ServerOpt,
        _opt(
            "server_opt",
            "--server-opt",
            default=ServerOpt.none,
            help="Server optimizer on the aggregate's pseudo-gradient: momentum (FedAvgM) or adam (FedAdam).",
        ),
    ),
    "server_lr": (float, _opt("server_lr", "--server-lr", help="Server optimizer step size.")),
    "server_momentum": (
        float,
        _opt("server_momentum", "--server-momentum", help="FedAvgM momentum / FedAdam beta1."),
    ),
    "lr_decay": (
        float,
        _opt(
            "lr_decay",
            "--lr-decay",
            help="Local lr schedule: round r trains with lr * decay^(r-1) (1 = constant).",
        ),
    ),
    "ksr_sentences": (
        int,
        _opt(
            "ksr_sentences",
            "--ksr-sentences",
            min=0,
            help="Keystroke savings are measured on the first N test sentences (0: off).",
        ),
    ),
    "dp_beta": (
        float,
        _opt(
            "dp_beta",
            "--dp-beta",
            help="Seeds' randomization: each phone adds beta * N(0, 1) to its weights (no formal guarantee).",
        ),
    ),
    "dp_clip": (
        float | None,
        _opt(
            "dp_clip",
            "--dp-clip",
            help="DP-FedAvg: clip each update to this L2 norm (turns DP-FedAvg on).",
        ),
    ),
    "dp_noise_multiplier": (
        float,
        _opt(
            "dp_noise_multiplier",
            "--dp-noise-multiplier",
            help="DP-FedAvg noise multiplier z: N(0, (z S)^2) on the sum.",
        ),
    ),
    "dp_delta": (
        float,
        _opt("dp_delta", "--dp-delta", help="DP-FedAvg delta for the reported epsilon."),
    ),
    "dp_target_epsilon": (
        float | None,
        _opt(
            "dp_target_epsilon",
            "--dp-target-epsilon",
            help="DP-FedAvg: stop before epsilon would pass this budget.",
        ),
    ),
}
PHONES = {
    "partition": (
        Partition,
        typer.Option(
            Partition.iid,
            "--partition",
            help="iid: the seeds' equal shards; user: one phone per user; dirichlet: non-IID.",
        ),
    ),
    "alpha": (
        float,
        typer.Option(0.5, "--alpha", help="Dirichlet concentration (with --partition dirichlet)."),
    ),
    "device": (
        str,
        typer.Option("auto", "--device", help="auto (CUDA when available), cpu or cuda."),
    ),
    "workers": (
        int | None,
        typer.Option(
            None,
            "--workers",
            help="Training processes, one torch thread each (default: one per core; 0: in this process).",
        ),
    ),
}
ROUNDS = {
    "quorum": (
        int | None,
        _opt(
            "quorum",
            "--quorum",
            help="Updates needed to aggregate at the deadline (default: half of those asked).",
        ),
    ),
    "round_deadline": (
        float,
        _opt("round_deadline", "--round-deadline", help="Seconds a round stays open."),
    ),
}
SETTINGS_GROUPS = (DATA, MODEL, TRAIN, FEDERATION)


def with_options(*groups: dict):
    """Give a command the shared options of `groups`; they arrive in its **opts."""

    def decorate(fn):
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
            for group in groups
            for name, (kind, option) in group.items()
        ]
        fn.__signature__ = sig.replace(parameters=own + extra)
        fn.__annotations__ = {**fn.__annotations__, **{p.name: p.annotation for p in extra}}
        return fn

    return decorate


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, StrEnum) else value


def build_settings(opts: dict, **overrides) -> Settings:
    """Settings from the options a command received (only the names Settings knows)."""
    values = {k: _plain(v) for k, v in opts.items() if k in Settings.model_fields}
    try:
        return Settings(**{**values, **overrides})
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def phone_data(settings: Settings, opts: dict, clients: int):
    """The DataConfig of the phones: the server's data settings plus how shards are cut."""
    from dataclasses import replace

    return replace(
        settings.data_config(),
        clients=clients,
        partition=_plain(opts["partition"]),
        alpha=opts["alpha"],
    )


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


def _report(rows: list[dict], out: Path) -> None:
    _print_table(rows)
    typer.echo(
        f"metrics: {out / 'metrics.jsonl'}  plot: {out / 'perplexity.png'}  checkpoints: {out / 'checkpoints'}"
    )


# -- commands ---------------------------------------------------------------------------------------


@app.command()
@with_options(*SETTINGS_GROUPS, PHONES)
def simulate(
    clients: int = typer.Option(100, "--clients", "-K", min=1, help="Number of simulated phones."),
    out: Path = typer.Option(
        Path("runs/simulate"),
        "--out",
        help="Run directory: checkpoints/, metrics.jsonl, perplexity.png.",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --out after its last checkpoint (same settings).",
    ),
    **opts,
) -> None:
    """Run federated rounds in-process and print perplexity per round."""
    from runners.simulate import simulate as run_simulation

    settings = build_settings(opts, storage=out)
    rows = run_simulation(
        phone_data(settings, opts, clients),
        settings.federation_config(),
        settings.build_model_config,
        str(out),
        opts["workers"],
        opts["device"],
        resume=resume,
    )
    _report(rows, out)


@app.command()
@with_options(*SETTINGS_GROUPS, ROUNDS)
def server(
    storage: Path = _opt(
        "storage",
        "--storage",
        help="Run directory: database, checkpoints/, metrics.jsonl, uploads.",
    ),
    host: str = _opt("host", "--host", help="Interface to listen on."),
    port: int = _opt("port", "--port", help="Port to listen on (0: any free port)."),
    enrollment_secret: str | None = typer.Option(
        None,
        "--enrollment-secret",
        envvar="FEDKEY_ENROLLMENT_SECRET",
        help="Devices must present it to enroll (default: a random one, printed).",
    ),
    wait_devices: int = _opt(
        "wait_devices",
        "--wait-devices",
        min=1,
        help="Round 1 opens once this many devices have enrolled.",
    ),
    database_url: str | None = _opt(
        "database_url", "--database-url", help="SQLAlchemy URL (default: SQLite in --storage)."
    ),
    exit_when_done: bool = _opt(
        "exit_when_done", "--exit-when-done", help="Exit once the last round is recorded."
    ),
    export_dir: Path | None = _opt(
        "export_dir",
        "--export-dir",
        help="Export every new global model to DIR/model.onnx (+ model.json) for the keyboard.",
    ),
    **opts,
) -> None:
    """Run the federation server: devices enroll, train and upload over HTTP (see README)."""
    from server.main import serve

    settings = build_settings(
        opts,
        storage=storage,
        host=host,
        port=port,
        enrollment_secret=enrollment_secret,
        wait_devices=wait_devices,
        database_url=database_url,
        exit_when_done=exit_when_done,
        export_dir=export_dir,
    )
    serve(settings)


FLEET = {
    "dropout_rate": (
        float,
        typer.Option(
            0.0,
            "--dropout-rate",
            min=0.0,
            max=1.0,
            help="Chance that a selected phone vanishes for the round (never uploads).",
        ),
    ),
    "slow_rate": (
        float,
        typer.Option(
            0.0,
            "--slow-rate",
            min=0.0,
            max=1.0,
            help="Chance that a selected phone is slow (waits --slow-seconds before uploading).",
        ),
    ),
    "slow_seconds": (
        float,
        typer.Option(5.0, "--slow-seconds", help="How long a slow phone waits."),
    ),
    "malicious": (int, typer.Option(0, "--malicious", min=0, help="The last N phones attack.")),
    "attack": (
        Attack,
        typer.Option(
            Attack.scale,
            "--attack",
            help="scale: a 100x update; nan: a NaN tensor; shape: wrong tensors.",
        ),
    ),
}


def fleet_config(url: str, count: int, secret: str, opts: dict):
    from device_sim.fleet import FleetConfig

    return FleetConfig(
        server=url,
        count=count,
        data=opts["data"],
        partition=_plain(opts["partition"]),
        alpha=opts["alpha"],
        max_train_tokens=opts["max_train_tokens"],
        paper_protocol=opts["paper_protocol"],
        seed=opts["seed"],
        device=opts["device"],
        workers=opts["workers"],
        enrollment_secret=secret,
        dropout_rate=opts["dropout_rate"],
        slow_rate=opts["slow_rate"],
        slow_seconds=opts["slow_seconds"],
        malicious=opts["malicious"],
        attack=_plain(opts["attack"]),
        name_prefix=opts.get("name_prefix", ""),
    )


@app.command()
@with_options(
    {k: DATA[k] for k in ("data", "paper_protocol", "max_train_tokens", "seed")}, PHONES, FLEET
)
def devices(
    server_url: str = typer.Option(
        "http://127.0.0.1:8000", "--server", help="The federation server's URL."
    ),
    count: int = typer.Option(
        10,
        "--count",
        "-N",
        min=1,
        help="Number of phones (shards are cut as `simulate --clients N`).",
    ),
    name_prefix: str = typer.Option(
        "",
        "--name-prefix",
        help="Name the phones <prefix>-00.. (default device-00.., as in simulate).",
    ),
    enrollment_secret: str = typer.Option(
        ...,
        "--enrollment-secret",
        envvar="FEDKEY_ENROLLMENT_SECRET",
        help="The server's enrollment secret.",
    ),
    **opts,
) -> None:
    """Run N simulated phones, each with its own private shard, against a server until it finishes."""
    from device_sim.fleet import FleetError, run_fleet

    try:
        summary = run_fleet(
            fleet_config(server_url, count, enrollment_secret, {**opts, "name_prefix": name_prefix})
        )
    except FleetError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({k: v for k, v in summary.items() if k != "per_device"}, indent=2))
    if summary.get("interrupted"):
        raise typer.Exit(130)


@app.command()
@with_options(*SETTINGS_GROUPS, PHONES, ROUNDS, FLEET)
def run(
    devices_count: int = typer.Option(
        10,
        "--devices",
        "--clients",
        "-N",
        "-K",
        min=1,
        help="Number of phones (--clients as in simulate).",
    ),
    out: Path = typer.Option(
        Path("runs/run"),
        "--out",
        help="Run directory: checkpoints/, metrics.jsonl, perplexity.png, server.log.",
    ),
    **opts,
) -> None:
    """Start a server and a fleet of phones on loopback, run the rounds over real HTTP, stop both."""
    from device_sim.fleet import fleet_pool, run_fleet
    from server.storage import RunStorage

    out.mkdir(parents=True, exist_ok=True)
    # A fresh run, as `fedkey simulate` without --resume: these phones are new (a new secret), so
    # an earlier run's devices, rounds and checkpoints here would only refuse or confuse them.
    RunStorage(out).reset()
    for stale in ("fedkey.db", "fedkey.db-wal", "fedkey.db-shm"):
        (out / stale).unlink(missing_ok=True)
    port, secret = free_port(), secrets.token_urlsafe(16)
    url = f"http://127.0.0.1:{port}"
    settings = build_settings(
        opts,
        storage=out,
        port=port,
        wait_devices=devices_count,
        exit_when_done=True,
        enrollment_secret=secret,
    )
    env = {
        **os.environ,
        **{f"FEDKEY_{k.upper()}": _env(v) for k, v in settings_env(settings).items()},
    }
    log = (out / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.main"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    fleet = fleet_config(url, devices_count, secret, opts)
    pool = fleet_pool(fleet)  # its processes start while the server does
    try:
        wait_healthy(url, proc)
        typer.echo(f"server {url} (log: {out / 'server.log'}); {devices_count} phones training")
        summary = run_fleet(fleet, pool=pool)
        # The phones heard "finished", so metrics.jsonl is complete: report while the server exits.
        storage = RunStorage(out)
        storage.plot(f"{settings.strategy} over HTTP on {settings.data}")
        _report(storage.read_metrics(), out)
        proc.wait(timeout=120)
    finally:
        pool.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        log.close()
    if summary.get("rejections"):
        typer.echo(f"rejected uploads: {summary['rejections']}")
    if summary.get("interrupted"):
        raise typer.Exit(130)


def settings_env(settings: Settings) -> dict[str, Any]:
    """The settings that differ from their defaults, to hand to a server process."""
    return {
        name: getattr(settings, name)
        for name, field in Settings.model_fields.items()
        if getattr(settings, name) != field.default
    }


def _env(value: Any) -> str:
    if hasattr(value, "get_secret_value"):
        return value.get_secret_value()
    return str(value).lower() if isinstance(value, bool) else str(value)


@app.command("train-central")
@with_options(
    DATA,
    MODEL,
    {k: TRAIN[k] for k in ("batch_size", "lr", "momentum", "clip")},
    {"ksr_sentences": FEDERATION["ksr_sentences"]},
    PHONES,
)
def train_central_cmd(
    epochs: int = typer.Option(
        5, "--epochs", min=1, help="Passes over the union of the phones' data."
    ),
    clients: int = typer.Option(
        100, "--clients", "-K", min=1, help="Phones whose data is pooled (as in simulate)."
    ),
    out: Path = typer.Option(
        Path("runs/central"), "--out", help="Run directory, same layout as simulate."
    ),
    **opts,
) -> None:
    """Train the same model centrally on the union of the phones' data: the ceiling for federated quality."""
    from runners.simulate import train_central

    settings = build_settings(opts, storage=out)
    rows = train_central(
        phone_data(settings, opts, clients),
        settings.train_config(),
        settings.build_model_config,
        str(out),
        epochs,
        settings.seed,
        opts["device"],
        ksr_sentences=settings.ksr_sentences,
    )
    _report(rows, out)


@app.command()
@with_options(
    DATA,
    {"ksr_sentences": FEDERATION["ksr_sentences"]},
    {k: PHONES[k] for k in ("partition", "alpha")},
)
def ngram(
    order: int = typer.Option(3, "--order", min=2, max=5, help="n of the n-gram."),
    positional: bool = typer.Option(
        False,
        "--positional",
        help="A unigram by position in the sentence instead of Kneser-Ney: the best score on the seeds' column batches (adds their column perplexity).",
    ),
    clients: int = typer.Option(
        100, "--clients", "-K", min=1, help="Phones whose data is pooled (as in simulate)."
    ),
    out: Path = typer.Option(
        Path("runs/ngram"), "--out", help="Run directory: metrics.jsonl with one row."
    ),
    **opts,
) -> None:
    """The baseline a keyboard would otherwise ship: a Kneser-Ney n-gram on the union of the phones' data."""
    from runners.simulate import train_ngram

    settings = build_settings(opts, storage=out)
    data = phone_data(settings, opts, clients)
    rows = train_ngram(data, order, str(out), settings.ksr_sentences, positional)
    _print_table(rows)
    typer.echo(f"metrics: {out / 'metrics.jsonl'}")


@app.command()
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
        help="Held-out text for the int8 perplexity change (the corpus' test split).",
    ),
    eval_sentences: int = typer.Option(
        500, "--eval-sentences", min=1, help="Held-out sentences for the int8 report."
    ),
) -> None:
    """Export a checkpoint to ONNX (recurrent state in and out); fails loudly if ONNX Runtime and PyTorch disagree."""
    from corpora.loaders import load_corpus
    from export.onnx_export import ExportParityError, export_checkpoint

    held_out = load_corpus(data).test[:eval_sentences] if int8 else None
    try:
        report = export_checkpoint(checkpoint, out, int8=int8, parity_text=held_out)
    except ExportParityError as e:
        typer.echo(f"export failed the parity check: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        json.dumps(
            {k: (str(v) if isinstance(v, Path) else v) for k, v in report.__dict__.items()},
            indent=2,
        )
    )


@app.command()
def keyboard(
    model: Path | None = typer.Option(
        None, "--model", help="The exported model.onnx (default: DIR/model.onnx with --watch)."
    ),
    watch: Path | None = typer.Option(
        None, "--watch", help="Follow new exports written to this directory (no restart)."
    ),
    events: str | None = typer.Option(
        None, "--events", help="The federation server's URL, for the live perplexity chart."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
) -> None:
    """Serve the web keyboard: next-word suggestions from an ONNX model (onnxruntime, no torch)."""
    from keyboard_web.app import serve as serve_keyboard

    if model is None and watch is None:
        raise typer.BadParameter("give --model or --watch", param_hint="--model")
    typer.echo(f"keyboard on http://{host}:{port}/")
    serve_keyboard(model, host=host, port=port, watch_dir=watch, events_url=events)


@app.command()
def demo(
    out: Path = typer.Option(
        Path("runs/demo"), "--out", help="Run directory (server storage, exports, logs)."
    ),
    phones: int = typer.Option(
        20, "--phones", min=2, help="Simulated phones, one per owner of the demo corpus."
    ),
    rounds: int = typer.Option(30, "--rounds", min=1, help="Federated rounds."),
    port: int = typer.Option(8080, "--port", help="The keyboard's port."),
    workers: int = typer.Option(2, "--workers", min=0, help="Training processes for the phones."),
) -> None:
    """The whole system on the demo corpus: a server, a fleet of phones, an ONNX export after every
    round, and the web keyboard following them. Ctrl-C stops every process."""
    out.mkdir(parents=True, exist_ok=True)
    export_dir = out / "export"
    server_port, secret = free_port(), secrets.token_urlsafe(16)
    url = f"http://127.0.0.1:{server_port}"
    fedkey = [sys.executable, "-m", "cli"]
    common = ["--data", "demo"]
    procs: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> subprocess.Popen:
        log = (out / f"{name}.log").open("w")
        env = {**os.environ, "FEDKEY_ENROLLMENT_SECRET": secret}
        procs.append(
            subprocess.Popen([*fedkey, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        )
        return procs[-1]

    try:
        server_proc = start(
            "server",
            [
                "server",
                *common,
                "--storage",
                str(out / "server"),
                "--port",
                str(server_port),
                "--export-dir",
                str(export_dir),
                "--rounds",
                str(rounds),
                "--fraction",
                "0.5",
                "--wait-devices",
                str(phones),
                "--local-epochs",
                "2",
                "--round-deadline",
                "120",
            ],
        )
        wait_healthy(url, server_proc)
        typer.echo(f"federation server {url} (logs in {out}/)")
        start(
            "devices",
            [
                "devices",
                *common,
                "--server",
                url,
                "--count",
                str(phones),
                "--partition",
                "user",
                "--workers",
                str(workers),
            ],
        )
        deadline = time.monotonic() + 180
        while not (export_dir / "model.json").exists():
            if time.monotonic() > deadline or server_proc.poll() is not None:
                raise RuntimeError(
                    f"no ONNX export appeared in {export_dir}; see {out / 'server.log'}"
                )
            time.sleep(0.5)
        keyboard_proc = start(
            "keyboard",
            ["keyboard", "--watch", str(export_dir), "--events", url, "--port", str(port)],
        )
        wait_healthy(f"http://127.0.0.1:{port}", keyboard_proc, path="/")
        typer.secho(
            f"\n  keyboard: http://127.0.0.1:{port}/   (type, tap a suggestion; Ctrl-C stops everything)\n",
            bold=True,
        )
        while all(
            p.poll() is None for p in procs if p is not procs[1]
        ):  # the fleet exits when the run is done
            time.sleep(1.0)
        raise RuntimeError(f"a demo process stopped; see the logs in {out}/")
    except KeyboardInterrupt:
        typer.echo("stopping the demo")
    except RuntimeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


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
    summary = {k: v for k, v in meta.items() if k not in ("tokenizer", "server")}
    summary["tokenizer"] = {"kind": tok.kind, "vocab_size": tok.vocab_size}
    summary["parameters"] = num_parameters(model)
    typer.echo(json.dumps(summary, indent=2))


# -- fedkey bench ------------------------------------------------------------------------------------

bench_app = typer.Typer(
    help="Benchmarks: the figures, with their targets, in a report.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")


class BenchStep(StrEnum):  # bench.report.STEPS (kept light: no torch at import)
    trainer = "trainer"
    http = "http"
    memory = "memory"
    keyboard = "keyboard"
    export = "export"
    transport = "transport"


@bench_app.command("perf")
def bench_perf(
    quick: bool = typer.Option(
        False, "--quick", help="Shrink every step (fewer repeats, keystrokes, updates): ~3 minutes."
    ),
    out: Path = typer.Option(
        Path("bench/results"), "--out", help="Where perf.json and perf.md are written."
    ),
    skip: list[BenchStep] = typer.Option(
        [], "--skip", help="Leave a step out (repeat the option for several)."
    ),
) -> None:
    """Performance benchmark: trainer vs a bare PyTorch loop, HTTP vs in-process, aggregation
    memory, keyboard latency (WebSocket and in-browser wasm), int8 export; writes OUT/perf.json
    and OUT/perf.md with each figure beside its target. Exits 1 if a step failed."""
    import shlex

    from bench.perf import run_perf

    result = run_perf(
        quick=quick,
        out=out,
        skip=[_plain(s) for s in skip],
        command=shlex.join(["fedkey", *sys.argv[1:]]),
    )
    if any("error" in s for s in result["steps"].values()):
        raise typer.Exit(1)


class PaperPreset(StrEnum):  # bench.paper.PRESETS
    cpu = "cpu"
    gpu = "gpu"
    smoke = "smoke"


class PaperSuite(StrEnum):  # bench.paper.SUITES
    paper = "paper"
    privacy = "privacy"
    beyond = "beyond"
    lr = "lr"
    full = "full"
    code = "code"


@bench_app.command("paper")
def bench_paper(
    preset: PaperPreset = typer.Option(
        PaperPreset.cpu,
        "--preset",
        help="gpu: the seeds' full protocol over HTTP; cpu: cut to ~1 hour on 2 cores (how is in the report); smoke: minutes, for a first look.",
    ),
    suite: list[PaperSuite] = typer.Option(
        [PaperSuite.paper],
        "--suite",
        help="paper: the seeds' table; privacy: randomization and DP-FedAvg; beyond: improvements, ceiling, n-gram baseline; lr: the seeds' lr 0.01 against ours, centrally on all of PTB; full: FedAvg and FedAtt on all the training data at the preset's rounds; code: FedAvg and FedAtt as the seeds' published code ran them (column batches and column perplexity, their whole protocol) (repeat the option for several).",
    ),
    data_root: Path = typer.Option(
        Path("../shared/data"),
        "--data-root",
        help="The folder that holds ptb/ and wikitext-2/ (train/valid/test.txt).",
    ),
    out: Path = typer.Option(
        Path("bench/results"),
        "--out",
        help="Results go to OUT/<preset>/: results.json, results.md, curves_*.png.",
    ),
    runs_dir: Path = typer.Option(
        Path("runs/bench"), "--runs-dir", help="Each run's own folder (checkpoints, metrics, log)."
    ),
    only: list[str] = typer.Option(
        [], "--only", help="Run only the runs whose id matches this glob (repeatable)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands; run nothing."),
    jobs: int = typer.Option(
        1, "--jobs", min=1, help="Runs at once (2 keeps both cores of a 2-core machine busy)."
    ),
) -> None:
    """The seeds' experiments through fedkey's own commands; a run already in results.json with
    the same command is not run again, so an interrupted bench resumes where it stopped."""
    import shlex

    from bench.paper import run_bench

    try:
        run_bench(
            _plain(preset),
            [_plain(s) for s in suite],
            data_root,
            out,
            runs_dir,
            only=only or None,
            dry_run=dry_run,
            bench_command=shlex.join(["fedkey", *sys.argv[1:]]),
            jobs=jobs,
        )
    except (FileNotFoundError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
