"""`fedkey demo`: the whole system on the demo corpus, each part a `fedkey` command in its own
process (runners.processes.ProcessGroup: logs in --out, all stopped together)."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import typer

from cli.errors import check_can_listen
from runners.processes import (
    ProcessError,
    ProcessGroup,
    free_port,
    server_env,
    wait_for,
    wait_healthy,
)

#: What the demo shows: attentive aggregation (FedAtt), every update bounded, and DP noise
#: calibrated to FedAtt's sensitivity. S = 10 is about the median update norm of a demo phone's two
#: local epochs at lr 1.0. Twenty phones cannot buy a small epsilon: at z = 0.005 the model learns
#: as without noise (test perplexity 96.1 after 4 rounds of `fedkey simulate --data demo --clients
#: 20 --partition user --fraction 0.5 --local-epochs 2 --strategy fedatt --dp-clip 10
#: --dp-noise-multiplier 0.005`) and epsilon grows by about 4e4 a round, which the keyboard's panel
#: says as it is; noise that buys a meaningful epsilon needs thousands of phones per round
#: (experiments/results/privacy).
MISSION = ["--strategy", "fedatt", "--dp-clip", "10", "--dp-noise-multiplier", "0.005"]


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
    """The whole system on the demo corpus: a server running FedAtt with bounded updates and DP
    noise, a fleet of phones, an ONNX export after every round, and the web keyboard following
    them (its panel shows the strategy and epsilon so far). Ctrl-C stops every process."""
    check_can_listen("127.0.0.1", port)  # the keyboard's, before minutes of training
    out.mkdir(parents=True, exist_ok=True)
    export_dir = out / "export"
    server_port, secret = free_port(), secrets.token_urlsafe(16)
    url = f"http://127.0.0.1:{server_port}"
    fedkey = [sys.executable, "-m", "cli"]
    common = ["--data", "demo"]

    with ProcessGroup(out, env={"FEDKEY_ENROLLMENT_SECRET": secret}) as procs:
        try:
            server_proc = procs.start(
                "server",
                [
                    *fedkey,
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
                    *MISSION,
                ],
                env=server_env(),
            )
            wait_healthy(url, server_proc)
            typer.echo(f"federation server {url} (logs in {out}/)")
            fleet_proc = procs.start(
                "devices",
                [
                    *fedkey,
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
            if not wait_for((export_dir / "model.json").exists, 180, proc=server_proc):
                raise ProcessError(
                    f"no ONNX export appeared in {export_dir}; see {procs.log('server')}"
                )
            keyboard_proc = procs.start(
                "keyboard",
                [
                    *fedkey,
                    "keyboard",
                    "--watch",
                    str(export_dir),
                    "--events",
                    url,
                    "--port",
                    str(port),
                ],
            )
            wait_healthy(f"http://127.0.0.1:{port}", keyboard_proc, path="/", name="the keyboard")
            typer.secho(
                f"\n  keyboard: http://127.0.0.1:{port}/   (type, tap a suggestion; Ctrl-C stops everything)\n",
                bold=True,
            )
            procs.first_exit(ignore=[fleet_proc])  # the fleet exits when the run is done
            raise ProcessError(f"a demo process stopped; see the logs in {out}/")
        except KeyboardInterrupt:
            typer.echo("stopping the demo")
        except ProcessError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
