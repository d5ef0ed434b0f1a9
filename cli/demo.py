"""`fedkey demo`: the whole system on real text messages (NUS SMS, one phone per sender) when they
are in the data directory or can be fetched, else on the embedded generated corpus; each part a
`fedkey` command in its own process (fedkey.runners.processes.ProcessGroup: logs in --out, all stopped
together)."""

from __future__ import annotations

import secrets
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import typer

from fedkey.cli.errors import UserError, check_can_listen
from fedkey.runners.processes import (
    ProcessError,
    ProcessGroup,
    free_port,
    server_env,
    wait_for,
    wait_healthy,
)

DemoData = Literal["auto", "nus-sms", "demo"]

#: What the demo shows: attentive aggregation (FedAtt), every update bounded, and DP noise
#: calibrated to FedAtt's sensitivity. Twenty or thirty phones cannot buy a small epsilon: at
#: z = 0.005 the model learns as without noise and epsilon grows by about 4e4 a round, which the
#: keyboard's panel says as it is; noise that buys a meaningful epsilon needs thousands of phones
#: per round (experiments/results/privacy). Its perplexities on the phones' held-out text are
#: published all the same (--dp-publish-scores), for the panel's chart and the best round's export.
MISSION = [
    "--strategy", "fedatt", "--dp-clip", "10", "--dp-noise-multiplier", "0.005",
    "--dp-publish-scores",
]  # fmt: skip

#: The generated demo corpus (the offline fallback): 20 phones, one per owner. S = 10 is about the
#: median update norm of a demo phone's two local epochs at lr 1.0 (test perplexity 96.1 after 4
#: rounds of `fedkey simulate --data demo --clients 20 --partition user --fraction 0.5
#: --local-epochs 2 --strategy fedatt --dp-clip 10 --dp-noise-multiplier 0.005`).
DEMO_PHONES = 20
DEMO = ["--fraction", "0.5", "--local-epochs", "2"]

#: NUS SMS: a phone for every sender with at least NUS_MIN_MESSAGES training messages (30), 9 a
#: round, and the settings chosen by measurement so that test perplexity improves or holds round
#: after round over 30 rounds, never more than 2% above its best so far
#: (docs/explanation/demo.md): a vocabulary of 2,000 words, a GRU of 96 units, two local
#: epochs at lr 1.0 decaying by 0.93 a round, and a FedAtt server step of 0.4 (best test
#: perplexity 125.6; one local epoch at lr 0.7 decaying by 0.9 stays near 170, and at step 0.5 a
#: round rose 2.4% above its best). fp32: faster than bf16 on a CPU without bf16 units.
NUS_MIN_MESSAGES = 300
NUS_SMS = [
    "--vocab-size",
    "2000",
    "--fraction",
    "0.3",
    "--local-epochs",
    "2",
    "--lr",
    "1.0",
    "--lr-decay",
    "0.93",
    "--epsilon",
    "0.4",
    "--precision",
    "fp32",
]
NUS_SMS_ENV = {"FEDKEY_HIDDEN_SIZE": "96"}  # no flag: emb = hidden = 96 (the small preset's 300)


def demo_corpus(data: str, echo: Callable[[str], None]) -> str:
    """The corpus the demo trains on: "nus-sms" when it is in the data directory or can be
    fetched now (2.4 MB, once), else "demo", said in one line; `data` "demo" or "nus-sms" asks
    for one (an NUS SMS that cannot be had is then an error)."""
    if data == "demo":
        return "demo"
    from fedkey.corpora.datadir import data_dir, fetch, is_present

    root = data_dir()
    if is_present("nus-sms", root):
        return "nus-sms"
    echo(f"fetching NUS SMS (2.4 MB) into {root}")
    try:
        fetch("nus-sms", root)
    except (OSError, ValueError) as e:  # offline, refused, a checksum mismatch, a folder in the way
        if data == "nus-sms":
            raise UserError(f"NUS SMS could not be fetched: {e}") from None
        echo(
            f"NUS SMS is not in {root} and could not be fetched ({e}): the demo trains on the "
            "generated demo corpus instead"
        )
        return "demo"
    return "nus-sms"


def senders_with(min_messages: int) -> int:
    """How many NUS SMS senders have at least `min_messages` training messages: the demo's
    phones (`fedkey devices --partition user --count K` takes the K senders with the most)."""
    from fedkey.corpora.loaders import load_corpus

    corpus = load_corpus("nus-sms")
    counts = Counter(corpus.train_users or [])
    return sum(n >= min_messages for n in counts.values())


def demo(
    out: Path = typer.Option(
        Path("runs/demo"), "--out", help="Run directory (server storage, exports, logs)."
    ),
    data: DemoData = typer.Option(
        "auto",
        "--data",
        help="auto: NUS SMS when it is in the data directory or can be fetched, else the "
        "generated demo corpus; nus-sms or demo: that one.",
    ),
    phones: int | None = typer.Option(
        None,
        "--phones",
        min=2,
        help="Simulated phones, one per sender (default: NUS SMS's senders with at least "
        f"{NUS_MIN_MESSAGES} training messages; {DEMO_PHONES} on the demo corpus).",
    ),
    rounds: int = typer.Option(30, "--rounds", min=1, help="Federated rounds."),
    port: int = typer.Option(8080, "--port", help="The keyboard's port."),
    workers: int = typer.Option(2, "--workers", min=0, help="Training processes for the phones."),
) -> None:
    """The whole system on real text messages (NUS SMS, one phone per sender; fetched once, else
    the generated demo corpus): a server running FedAtt with bounded updates and DP noise, a fleet
    of phones, an ONNX export whenever a round is the best so far on validation, and the web
    keyboard serving it (its panel shows the round, the corpus, the strategy and epsilon so far).
    Ctrl-C stops every process."""
    check_can_listen("127.0.0.1", port)  # the keyboard's, before minutes of training
    corpus = demo_corpus(data, typer.echo)
    if corpus == "nus-sms":
        phones = phones or senders_with(NUS_MIN_MESSAGES)
        settings, env = NUS_SMS, NUS_SMS_ENV
    else:
        phones = phones or DEMO_PHONES
        settings, env = DEMO, {}
    from fedkey.runners.loopback import fresh_run_dir

    fresh_run_dir(out / "server")  # a new demo: new phones (a new secret), new rounds
    export_dir = out / "export"
    for stale in (
        "model.json",
        "model.onnx",
    ):  # an earlier demo's: the keyboard waits for this one's
        (export_dir / stale).unlink(missing_ok=True)
    server_port, secret = free_port(), secrets.token_urlsafe(16)
    url = f"http://127.0.0.1:{server_port}"
    fedkey = [sys.executable, "-m", "fedkey"]
    common = ["--data", corpus]

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
                    "--wait-devices",
                    str(phones),
                    "--round-deadline",
                    "120",
                    *settings,
                    *MISSION,
                ],
                env=server_env(env),
            )
            wait_healthy(url, server_proc)
            typer.echo(f"federation server {url}: {corpus}, {phones} phones (logs in {out}/)")
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
