"""fedkey: one command line for the federated keyboard.

    fedkey simulate       federated rounds in-process (phones in local worker processes)
    fedkey server         the federation server (FastAPI) for real devices over HTTP
    fedkey devices        a fleet of simulated phones that train against a server
    fedkey run            a server and a fleet on loopback: `simulate`, over real HTTP
    fedkey export         a checkpoint to ONNX (parity-checked; --int8)
    fedkey keyboard       the web keyboard: suggestions from an ONNX model
    fedkey demo           all of it on NUS SMS, else the demo corpus (what `make demo` runs)
    fedkey train-central  the same model trained on all the data at once: the quality ceiling
    fedkey pretrain       a base model of public text (chitchat) for a federation's --init
    fedkey info           what a checkpoint holds
    fedkey evaluate       a checkpoint scored on held-out text, beside what its run recorded
    fedkey audit canary   a planted secret's exposure, without and with DP (memorization)
    fedkey data fetch     a real corpus (nus-sms, ubuntu-irc) downloaded and checked
    fedkey vocabulary discover  words many phones type, added to a base by a DP federated count

The benchmarks are not part of the product: `fedkey-bench` (experiments/, installed beside it).

Every subcommand has --help. The federation's options are declared once, as the fields of
fedkey.server.settings.Settings: each flag's default, bounds and help are its field's; every one can
also be set by an environment variable FEDKEY_<NAME> (for example FEDKEY_ROUNDS=20), flags winning.

The package: options.py (the shared options, derived from Settings; those of malicious phones in
attack_options.py, of the training backend in backend_options.py), errors.py (every failure as one
line), federation.py (simulate, server, devices, run, train-central, ngram), pretrain.py, checkpoints.py (export,
keyboard, info, evaluate), operator.py (enroll-tokens, revoke: against a running server), demo.py,
audit.py, data.py. Nothing here imports torch until a command runs, so --help is quick.
"""

from __future__ import annotations

import typer

from fedkey.cli import audit, checkpoints, data, demo, federation, operator, pretrain, vocabulary
from fedkey.cli.errors import FedkeyGroup

__all__ = ["app", "main"]

app = typer.Typer(
    cls=FedkeyGroup,
    help="fedkey: a federated next-word keyboard. Train by federated learning, compare aggregation methods.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command()(federation.simulate)
app.command()(federation.server)
app.command()(federation.devices)
app.command("enroll-tokens")(operator.enroll_tokens)
app.command()(operator.revoke)
app.command()(federation.run)
app.command("train-central")(federation.train_central_cmd)
app.command()(federation.ngram)
app.command()(pretrain.pretrain)
app.command()(checkpoints.export)
app.command()(checkpoints.keyboard)
app.command()(demo.demo)
app.command()(checkpoints.info)
app.command()(checkpoints.evaluate)
app.add_typer(audit.audit_app, name="audit")
app.add_typer(data.data_app, name="data")
app.add_typer(vocabulary.vocabulary_app, name="vocabulary")


def main() -> None:
    """The `fedkey` script. FedkeyGroup (fedkey.cli.errors.user_errors) turns the errors a user can cause
    into one `error: ...` line on stderr and an exit status (1; 2 for usage; 130 for Ctrl-C)."""
    app()
