"""`fedkey demo`: the whole system on real text messages (NUS SMS, one phone per sender) when they
are in the data directory or can be fetched, else on the Chit-Chat senders held out of the base's
pretraining: a federation fine-tuning the shipped base model (`--init base`); each part a `fedkey`
command in its own process (fedkey.runners.processes.ProcessGroup: logs in --out, all stopped
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

DemoData = Literal["auto", "nus-sms", "chitchat"]

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

#: The phones: one per sender with at least NUS_MIN_MESSAGES training messages (NUS SMS: 30;
#: the Chit-Chat senders held out of pretraining: 21), about a third of them a round.
NUS_MIN_MESSAGES = 300

#: The model: the base that ships with fedkey (pretrained on public chat; its vocabulary encodes
#: the phones' text) and its Kneser-Ney 3-gram, which the keyboard mixes in. Round 0 is the base
#: itself, so the keyboard suggests sensibly before any phone has trained. Fine-tuning settings
#: chosen by measurement (docs/explanation/demo.md): test perplexity improves or holds round after
#: round, never more than 2% above its best so far. fp32: faster than bf16 on a CPU without bf16
#: units.
FINE_TUNE = [
    "--init", "base", "--ngram", "base", "--fraction", "0.3", "--local-epochs", "1",
    "--lr", "0.5", "--lr-decay", "0.95", "--epsilon", "0.4", "--precision", "fp32",
]  # fmt: skip

#: The corpus the demo federates over, by what `--data` asks: NUS SMS, else (offline) the
#: Chit-Chat senders held out of pretraining.
CORPUS = {"nus-sms": "nus-sms", "chitchat": "chitchat-heldout"}


def demo_corpus(data: str, echo: Callable[[str], None]) -> str:
    """The corpus the demo trains on: "nus-sms" when it is in the data directory or can be
    fetched now (2.4 MB, once), else "chitchat-heldout" (the Chit-Chat senders held out of the
    base's pretraining, installed with fedkey), said in one line; `data` "nus-sms" or "chitchat"
    asks for one (an NUS SMS that cannot be had is then an error)."""
    if data == "chitchat":
        return CORPUS["chitchat"]
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
            f"NUS SMS is not in {root} and could not be fetched ({e}): the demo federates over "
            "the Chit-Chat senders held out of the base's pretraining instead"
        )
        return CORPUS["chitchat"]
    return "nus-sms"


def senders_with(corpus: str, min_messages: int) -> int:
    """How many senders of `corpus` have at least `min_messages` training messages: the demo's
    phones (`fedkey devices --partition user --count K` takes the K senders with the most)."""
    from fedkey.corpora.loaders import load_corpus

    counts = Counter(load_corpus(corpus).train_users or [])
    return sum(n >= min_messages for n in counts.values())


def demo(
    out: Path = typer.Option(
        Path("runs/demo"), "--out", help="Run directory (server storage, exports, logs)."
    ),
    data: DemoData = typer.Option(
        "auto",
        "--data",
        help="auto: NUS SMS when it is in the data directory or can be fetched, else the "
        "Chit-Chat senders held out of the base's pretraining; nus-sms or chitchat: that one.",
    ),
    phones: int | None = typer.Option(
        None,
        "--phones",
        min=2,
        help="Simulated phones, one per sender (default: the senders with at least "
        f"{NUS_MIN_MESSAGES} training messages).",
    ),
    rounds: int = typer.Option(30, "--rounds", min=1, help="Federated rounds."),
    port: int = typer.Option(8080, "--port", help="The keyboard's port."),
    workers: int = typer.Option(2, "--workers", min=0, help="Training processes for the phones."),
) -> None:
    """The whole system on real text messages (NUS SMS, one phone per sender; fetched once, else
    the Chit-Chat senders held out of the base's pretraining): the shipped base model of public
    chat fine-tuned by a server running FedAtt with bounded updates and DP noise, a fleet
    of phones, an ONNX export whenever a round is the best so far on validation, and the web
    keyboard serving it (its panel shows the round, the corpus, the strategy and epsilon so far).
    Ctrl-C stops every process."""
    check_can_listen("127.0.0.1", port)  # the keyboard's, before minutes of training
    corpus = demo_corpus(data, typer.echo)
    phones = phones or senders_with(corpus, NUS_MIN_MESSAGES)
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
                    *FINE_TUNE,
                    *MISSION,
                ],
                env=server_env(),
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
