"""The options of `simulate --malicious`, `devices` and `run`: malicious phones
(fedkey.device_sim.attacks) and the backdoor they plant, and the BackdoorConfig built from them."""

from __future__ import annotations

import typer

from fedkey.cli.errors import UserError
from fedkey.device_sim.config import Attack, BackdoorConfig, FleetConfig

#: Malicious phones (fedkey.device_sim.attacks), for simulate, devices and run.
_BACKDOOR, _FLEET = BackdoorConfig(), FleetConfig()
ATTACKS = {
    "malicious": (
        int,
        typer.Option(
            _FLEET.malicious, "--malicious", min=0, help="The last N phones (by name) attack."
        ),
    ),
    "attack": (
        Attack,
        typer.Option(
            _FLEET.attack,
            "--attack",
            help="scale: the update x100; signflip: x-10; backdoor: trained to suggest --backdoor-target after --backdoor-trigger, boosted by model replacement (Bagdasaryan et al. 2020); nan: a NaN tensor; shape: wrong tensors (the server refuses nan and shape). With backdoor, simulate reports the backdoor's success every round, also with --malicious 0.",
        ),
    ),
    "backdoor_trigger": (
        str,
        typer.Option(
            _BACKDOOR.trigger,
            "--backdoor-trigger",
            help="The backdoor's trigger phrase (words of the server's vocabulary).",
        ),
    ),
    "backdoor_target": (
        str,
        typer.Option(
            _BACKDOOR.target,
            "--backdoor-target",
            help="The word the backdoor makes the keyboard suggest after the trigger.",
        ),
    ),
    "backdoor_poison": (
        float,
        typer.Option(
            _BACKDOOR.poison,
            "--backdoor-poison",
            min=0.0,
            help="Poisoned sentences an attacker adds per sentence of its shard.",
        ),
    ),
    "backdoor_boost": (
        float | None,
        typer.Option(
            None,
            "--backdoor-boost",
            help="Model replacement's factor gamma (default: the cohort size over the attackers in it; in devices/run: phones over malicious phones).",
        ),
    ),
    "backdoor_epochs": (
        int | None,
        typer.Option(
            None,
            "--backdoor-epochs",
            min=1,
            help="An attacker's local epochs (default: the round's).",
        ),
    ),
}


def backdoor_config(opts: dict) -> BackdoorConfig:
    """The backdoor of the --backdoor-* options; a value it refuses is a UserError."""
    try:
        return BackdoorConfig(
            trigger=opts["backdoor_trigger"],
            target=opts["backdoor_target"],
            poison=opts["backdoor_poison"],
            boost=opts["backdoor_boost"],
            epochs=opts["backdoor_epochs"],
        )
    except ValueError as e:
        raise UserError(str(e)) from None
