"""The federation's commands: simulate, server, devices, run, train-central, ngram."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import typer

from fedkey.cli.attack_options import ATTACKS, backdoor_config
from fedkey.cli.backend_options import BACKEND, ray_options, refuse_stacked
from fedkey.cli.errors import INTERRUPTED, UserError, check_can_listen
from fedkey.cli.options import (
    CANARY,
    DATA,
    FLEET,
    MODEL,
    PHONES,
    ROUNDS,
    SERVICE,
    SETTINGS_GROUPS,
    build_settings,
    canary_probes,
    check_server_data,
    check_url,
    phone_data,
    settings_group,
    tls_pair,
    with_options,
)
from fedkey.device_sim.config import FleetConfig
from fedkey.runners.processes import free_port


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="perplexity per round")
    for col in (
        "round",
        "aggregated",
        "val_ppl",
        "test_ppl",
        "top1",
        "bar_top1",
        "all_top1",
        "top3",
        "ksr",
        "epsilon",
        "seconds",
    ):
        table.add_column(col, justify="right")
    canary = "canary_exposure" in rows[-1]
    if canary:  # --canary: the secret's exposure in bits, of log2 |R| at most
        table.add_column("exposure", justify="right")

    def fmt(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    for r in rows:
        exposure = [fmt(r.get("canary_exposure"))] if canary else []
        table.add_row(
            str(r["round"]),
            str(len(r["aggregated"])),
            fmt(r["val_ppl"]),
            fmt(r["test_ppl"]),
            fmt(r["top1"], ".3f"),
            fmt(r.get("bar_top1"), ".3f"),
            fmt(r.get("all_top1"), ".3f"),
            fmt(r["top3"], ".3f"),
            fmt(r["ksr"], ".3f"),
            fmt(r["epsilon"]),
            fmt(r["seconds"], ".1f"),
            *exposure,
        )
    Console().print(table)


def _report(rows: list[dict], out: Path) -> None:
    print_table(rows)
    last = rows[-1]
    if "eval_precision" in last:  # the task's "auto" is resolved by each phone: None here
        train = last.get("train_precision") or "as each phone resolves it"
        typer.echo(f"precision: training {train}, evaluation {last['eval_precision']}")
    typer.echo(
        f"metrics: {out / 'metrics.jsonl'}  plot: {out / 'perplexity.png'}  checkpoints: {out / 'checkpoints'}"
    )


def _report_attack(rows: list[dict]) -> None:
    """What the attackers of `simulate --malicious` achieved: refused uploads, the backdoor."""
    refused = sum(len(r.get("rejected") or {}) for r in rows)
    reasons = sorted({why for r in rows for why in (r.get("rejected") or {}).values()})
    if refused:
        typer.echo(f"refused uploads: {refused} ({'; '.join(reasons)})")
    if "backdoor_top1" in rows[-1]:
        top1 = ", ".join(f"{r['backdoor_top1']:.2f}" for r in rows)
        typer.echo(
            f"backdoor success per round (top-1): {top1}; final top-3 {rows[-1]['backdoor_top3']:.2f}"
        )


@with_options(*SETTINGS_GROUPS, PHONES, BACKEND, ATTACKS)
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
    """Run federated rounds, the phones trained in local processes, on a Ray cluster (--backend
    ray) or all of a round's at once on a GPU (--backend stacked), and print perplexity per round."""
    from fedkey.device_sim.ray_cluster import RayUnavailable
    from fedkey.runners.simulate import SimulationConfig
    from fedkey.runners.simulate import simulate as run_simulation

    settings = build_settings(opts, storage=out)
    try:
        rows = run_simulation(
            SimulationConfig(
                phone_data(settings, opts, clients),
                settings.federation_config(),
                settings.build_model_config,
                str(out),
                opts["workers"],
                opts["device"],
                resume=resume,
                malicious=opts["malicious"],
                attack=opts["attack"],
                backdoor=backdoor_config(opts),
                probes=canary_probes(settings),
                backend=opts["backend"],
                ray=ray_options(opts),
            )
        )
    except RayUnavailable as e:
        raise UserError(str(e)) from None
    _report(rows, out)
    _report_attack(rows)


@with_options(SERVICE, *SETTINGS_GROUPS, ROUNDS)
def server(**opts) -> None:
    """Run the federation server: devices enroll, train and upload over HTTP (docs/how-to/http-federation.md)."""
    from fedkey.server.main import serve

    tls_pair(opts["tls_cert"], opts["tls_key"])
    settings = build_settings(opts)
    check_server_data(settings)
    check_can_listen(settings.host, settings.port)
    serve(settings)


def fleet_config(url: str, count: int, secret: str, opts: dict, **extra) -> FleetConfig:
    """The FleetConfig of `count` phones against `url`, from a command's options."""
    data = build_settings(opts).data_config()  # --canary: the secret the server draws too
    return FleetConfig(
        server=url,
        count=count,
        data=opts["data"],
        partition=opts["partition"],
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
        attack=opts["attack"],
        backdoor=backdoor_config(opts),
        canary=data.canary,
        canary_repeats=data.canary_repeats,
        **extra,
    )


@with_options(
    settings_group("data", "paper_protocol", "max_train_tokens", "seed"),
    PHONES,
    FLEET,
    ATTACKS,
    CANARY,
    BACKEND,
)
def devices(
    server_url: str = typer.Option(
        "http://127.0.0.1:8000",
        "--server",
        callback=check_url,
        help="The federation server's URL.",
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
    retry_seconds: float = typer.Option(
        FleetConfig.retry_seconds,
        "--retry-seconds",
        min=0.0,
        help="How long a phone keeps retrying a server that does not answer before it gives up.",
    ),
    **opts,
) -> None:
    """Run N simulated phones, each with its own private shard, against a server until it
    finishes. --backend ray spreads them over a Ray cluster: asyncio phones in actors on every
    node, their training on the cluster's trainer actors."""
    from fedkey.device_sim.client.http import FedkeyError, ServerUnavailable
    from fedkey.device_sim.fleets.thread_fleet import run_fleet
    from fedkey.device_sim.ray_cluster import RayUnavailable

    fleet = fleet_config(
        server_url,
        count,
        enrollment_secret,
        opts,
        name_prefix=name_prefix,
        retry_seconds=retry_seconds,
    )
    refuse_stacked(opts, "devices")
    ray = ray_options(opts)
    try:
        if ray is None:
            summary = run_fleet(fleet)
        else:
            from fedkey.device_sim.fleets.ray_fleet import fleet_on_ray

            summary = fleet_on_ray(fleet, ray)
    except RayUnavailable as e:
        raise UserError(str(e)) from None
    except ServerUnavailable as e:
        raise UserError(f"{e}; is a fedkey server running at {server_url} (--server)?") from None
    except FedkeyError as e:  # FleetError (every phone failed the same way), a refused request
        raise UserError(str(e)) from None
    typer.echo(json.dumps({k: v for k, v in summary.items() if k != "per_device"}, indent=2))
    if summary.get("interrupted"):
        raise typer.Exit(INTERRUPTED)


@with_options(*SETTINGS_GROUPS, PHONES, ROUNDS, FLEET, ATTACKS)
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
    from fedkey.runners.loopback import fresh_run_dir, run_loopback

    port, secret = free_port(), secrets.token_urlsafe(16)
    settings = build_settings(
        opts,
        storage=out,
        port=port,
        wait_devices=devices_count,
        exit_when_done=True,
        enrollment_secret=secret,
    )
    fleet = fleet_config(f"http://127.0.0.1:{port}", devices_count, secret, opts)
    check_server_data(settings)
    fresh_run_dir(out)  # only once the options are known to be valid
    summary = run_loopback(
        settings,
        fleet,
        on_ready=lambda url: typer.echo(
            f"server {url} (log: {out / 'server.log'}); {devices_count} phones training"
        ),
        on_metrics=lambda rows: _report(rows, out),
    )
    if summary.get("rejections"):
        typer.echo(f"rejected uploads: {summary['rejections']}")
    if summary.get("interrupted"):
        raise typer.Exit(INTERRUPTED)


@with_options(
    DATA,
    MODEL,
    settings_group(
        "batch_size", "lr", "momentum", "clip", "precision", "ksr_sentences", "lr_decay"
    ),
    PHONES,
    BACKEND,
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
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --out after its last epoch's checkpoint (same settings).",
    ),
    **opts,
) -> None:
    """Train the same model centrally on the union of the phones' data: the ceiling for federated
    quality. With --backend ray each epoch trains on one actor of the cluster (a GPU node with
    --ray-gpus-per-worker 1)."""
    from fedkey.device_sim.ray_cluster import RayUnavailable
    from fedkey.runners.baselines import train_central

    refuse_stacked(opts, "train-central")
    settings = build_settings(opts, storage=out)
    try:
        rows = train_central(
            phone_data(settings, opts, clients),
            settings.train_config(),
            settings.build_model_config,
            str(out),
            epochs,
            settings.seed,
            opts["device"],
            ksr_sentences=settings.ksr_sentences,
            backend=opts["backend"],
            ray=ray_options(opts),
            resume=resume,
            lr_decay=settings.lr_decay,
        )
    except RayUnavailable as e:
        raise UserError(str(e)) from None
    _report(rows, out)


@with_options(
    DATA,
    settings_group("ksr_sentences"),
    {k: PHONES[k] for k in ("partition", "alpha")},
)
def ngram(
    order: int = typer.Option(3, "--order", min=2, max=5, help="n of the n-gram."),
    positional: bool = typer.Option(
        False,
        "--positional",
        help="A unigram by position in the sentence instead of Kneser-Ney: the best score on the seed papers' column batches (adds their column perplexity).",
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
    from fedkey.runners.baselines import train_ngram

    settings = build_settings(opts, storage=out)
    data = phone_data(settings, opts, clients)
    rows = train_ngram(data, order, str(out), settings.ksr_sentences, positional)
    print_table(rows)
    typer.echo(f"metrics: {out / 'metrics.jsonl'}")
