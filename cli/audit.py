"""`fedkey audit`: what the federation leaks. `fedkey audit canary`: a planted secret's exposure
with FedAvg and FedAtt, without and with DP (fedkey.runners.canary_audit)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from fedkey.cli.errors import UserError
from fedkey.common.config import DPMechanism
from fedkey.models.canary import CanaryFormat
from fedkey.runners.canary_audit import AuditConfig, arms

audit_app = typer.Typer(
    help="Audits of what the trained model gives away about the phones' data.",
    no_args_is_help=True,
)
_DEFAULT = AuditConfig()


def print_table(runs: list[dict]) -> None:
    """Each arm's exposure per round (an arm a row), with its last test perplexity."""
    from rich.console import Console
    from rich.table import Table

    from fedkey.runners.canary_audit import per_round_table

    header, rows = per_round_table(runs)  # a row per round, an arm a column
    phone = runs[0]["canary_phone"]
    table = Table(title=f"canary exposure per round, bits (* = {phone}'s update aggregated)")
    table.add_column("arm", no_wrap=True)
    for row in rows:
        table.add_column(f"round {row[0]}", justify="right")
    table.add_column("test ppl", justify="right")
    ppl = {r["label"]: r["test_ppl"] for r in runs}
    for i, label in enumerate(header[1:], start=1):
        cells = [row[i].replace(" *", "*") for row in rows]
        table.add_row(label, *cells, f"{ppl[label]:.3g}")
    console = Console()
    Console(width=max(console.width, 150)).print(table)  # a log file is not 80 columns


@audit_app.command(
    "canary", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def audit_canary(
    ctx: typer.Context,
    rounds: int = typer.Option(_DEFAULT.rounds, "--rounds", "-R", min=1, help="Rounds per arm."),
    repeats: int = typer.Option(
        _DEFAULT.repeats,
        "--repeats",
        "-k",
        min=1,
        help="Copies of the secret in the first phone's shard.",
    ),
    local_epochs: int = typer.Option(
        _DEFAULT.local_epochs, "--local-epochs", "-E", min=1, help="Local epochs per round."
    ),
    clients: int = typer.Option(
        _DEFAULT.clients,
        "--clients",
        "-K",
        min=1,
        help="Phones (the demo has 20 owners: one phone each).",
    ),
    fraction: float = typer.Option(
        _DEFAULT.fraction, "--fraction", "-C", min=0.0, max=1.0, help="Share selected per round."
    ),
    dp_clip: float = typer.Option(
        _DEFAULT.dp_clip, "--dp-clip", min=1e-6, help="The DP arms' clip norm S."
    ),
    dp_noise_multiplier: list[float] = typer.Option(
        list(_DEFAULT.dp_noise_multipliers),
        "--dp-noise-multiplier",
        min=0.0,
        help="The DP arms' noise multiplier z (repeatable: a DP-FedAvg and a DP-FedAtt arm each).",
    ),
    dp_mechanism: DPMechanism = typer.Option(
        _DEFAULT.dp_mechanism,
        "--dp-mechanism",
        help="How the DP arms add noise: gaussian (DP-FedAvg), tree or blt (DP-FTRL), as for simulate.",
    ),
    bound_norm: float | None = typer.Option(
        _DEFAULT.bound_norm,
        "--bound-norm",
        min=1e-6,
        help="Clip the no-DP arms' updates to this norm too (--bound fixed), as a privacy table's no-DP cells do; default: no bound (--bound off).",
    ),
    canary_format: str = typer.Option(
        _DEFAULT.canary_format,
        "--canary-format",
        help="The secret's template, '_' per slot (FEDKEY_CANARY_FORMAT of every arm); its words must be in the corpus's vocabulary.",
    ),
    canary_alphabet: str = typer.Option(
        _DEFAULT.canary_alphabet,
        "--canary-alphabet",
        help="The words each slot takes, space-separated (FEDKEY_CANARY_ALPHABET), e.g. '0 1 2 3 4 5 6 7 8 9'.",
    ),
    data: str = typer.Option(
        _DEFAULT.data,
        "--data",
        help="The corpus ('demo' or a directory, as for simulate); the secret's words must be in its vocabulary.",
    ),
    seed: int = typer.Option(_DEFAULT.seed, "--seed", help="Draws the secret, seeds the runs."),
    workers: int = typer.Option(
        _DEFAULT.workers, "--workers", min=0, help="Training processes of each run."
    ),
    out: Path = typer.Option(
        Path("runs/audit/canary"),
        "--out",
        help="results.json, results.md and exposure.png go here (beside the arms' folders by default).",
    ),
    runs_dir: Path = typer.Option(
        Path("runs/audit/canary"),
        "--runs-dir",
        help="Each arm's own run folder (checkpoints, metrics, log).",
    ),
    only: list[str] = typer.Option(
        [],
        "--only",
        help=f"Run only this arm (repeatable): {', '.join(a.id for a in arms(_DEFAULT))}.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the commands; run nothing."),
) -> None:
    """Plant a random secret ('my secret is _ _ _ _', 10^4 candidates) k times in one phone's
    shard and measure its exposure every round (Carlini et al. 2019: log2 |R| - log2 rank; 13.3
    bits = ranked first, ~1.4 = chance) for FedAvg and FedAtt, without DP (no bound on updates)
    and with DP. Options after `--` go to every arm's `fedkey simulate` (e.g. `-- --vocab-size
    2000 --lr 3`). An arm already in results.json with the same command is not run again, so an
    interrupted audit resumes."""
    from fedkey.runners.canary_audit import run_audit

    cfg = AuditConfig(
        data=data,
        clients=clients,
        fraction=fraction,
        rounds=rounds,
        local_epochs=local_epochs,
        repeats=repeats,
        dp_clip=dp_clip,
        dp_noise_multipliers=tuple(dp_noise_multiplier),
        seed=seed,
        workers=workers,
        dp_mechanism=dp_mechanism,
        bound_norm=bound_norm,
        canary_format=" ".join(canary_format.split()),
        canary_alphabet=" ".join(canary_alphabet.replace(",", " ").split()),
        simulate_args=tuple(ctx.args),
    )
    try:
        CanaryFormat.parse(cfg.canary_format, cfg.canary_alphabet)
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        runs = run_audit(
            cfg,
            out,
            runs_dir,
            only=only or None,
            dry_run=dry_run,
            audit_command=shlex.join(["fedkey", *sys.argv[1:]]),
        )
    except RuntimeError as e:  # a run that failed: its command and the tail of its log
        raise UserError(str(e)) from None
    if not dry_run and runs:
        print_table(runs)
        typer.echo(f"report: {out / 'results.md'}  plot: {out / 'exposure.png'}")
