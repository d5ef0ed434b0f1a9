"""`fedkey-bench canary`: its options and errors; the audit itself is fedkey_bench.canary.irc, imported
when the command runs (so `--help` loads no torch)."""

from __future__ import annotations

import datetime as dt
import shlex
import sys
from pathlib import Path

import typer

from fedkey_bench.common.checkout import RESULTS


def command(
    workload: str = typer.Option(
        "irc", "--workload", help="The privacy table's workload (one phone per sender: irc)."
    ),
    clip: float | None = typer.Option(
        None, "--clip", min=1e-6, help="The clip S (default: the privacy table's probe)."
    ),
    until: str | None = typer.Option(
        None, "--until", help="Start no arm after this UTC time, HH:MM (run again to resume)."
    ),
    out: Path = typer.Option(
        RESULTS / "canary-irc", "--out", help="Where results.json and results.md are written."
    ),
    runs_dir: Path = typer.Option(
        Path("runs/bench/canary-irc"), "--runs-dir", help="Each arm's run folder."
    ),
) -> None:
    """The canary audit on the privacy table's population at its target epsilons (FedAvg without
    DP, then DP-FedAvg under gaussian and blt at epsilon 8, 2, 4, 1, then tree), each DP arm
    also with nothing planted; resumable."""
    from fedkey.cli.errors import UserError
    from fedkey_bench.canary.irc import run
    from fedkey_bench.privacy.runner import WORKLOADS

    senders = [name for name, p in WORKLOADS.items() if p.partition == "user"]
    if workload not in senders:
        raise UserError(f"--workload {workload}: the audit needs one phone per sender: "
                        f"choose {' or '.join(senders)}")  # fmt: skip
    stop = None
    if until is not None:
        try:
            at = dt.datetime.strptime(until, "%H:%M").time()
        except ValueError:
            raise UserError(f"--until {until}: give a UTC time as HH:MM, e.g. 17:05") from None
        stop = dt.datetime.combine(dt.datetime.now(dt.UTC).date(), at, tzinfo=dt.UTC)
    privacy_out = RESULTS / ("privacy" if workload == "ptb" else f"privacy-{workload}")
    try:
        run(out, runs_dir, privacy_out, clip, stop,
            shlex.join(["fedkey-bench", *sys.argv[1:]]), workload)  # fmt: skip
    except (ValueError, RuntimeError) as e:
        raise UserError(str(e)) from None
    typer.echo(f"report: {out / 'results.md'}")
