"""The federation's options are declared once, as fields of fedkey.server.settings.Settings: every
command's option read from a FEDKEY_<NAME> variable of a Settings field is that field's flag, with
its default, its description as help and its inclusive bounds as typer's min/max."""

from typing import Any

import typer

from fedkey.cli import app
from fedkey.cli.options import EXTRAS
from fedkey.server.settings import Settings

#: Options of their own that read a Settings field's variable, with their own help: the phones'
#: copy of the server's secret (required), the keyboard's token for the server's events.
OWN = {("devices", "enrollment_secret"), ("keyboard", "operator_token")}


def settings_options() -> list[tuple[str, str, Any]]:
    """(command, field name, click option) of every option derived from a Settings field."""
    found = []
    for name, command in getattr(typer.main.get_command(app), "commands", {}).items():
        for sub_name, sub in getattr(command, "commands", {name: command}).items():
            path = name if sub is command else f"{name} {sub_name}"
            for p in sub.params:
                field = p.name if p.name in Settings.model_fields else None
                if field and p.envvar == f"FEDKEY_{field.upper()}" and (path, field) not in OWN:
                    found.append((path, field, p))
    return found


def test_the_federations_commands_take_their_options_from_settings():
    commands = {command for command, _, _ in settings_options()}
    assert {"simulate", "server", "run", "train-central", "ngram", "evaluate"} <= commands
    names = {name for _, name, _ in settings_options()}
    assert {"rounds", "dp_clip", "strategy", "storage", "quorum", "canary"} <= names


def test_every_settings_option_is_its_field():
    problems = []
    for command, name, option in settings_options():
        field = Settings.model_fields[name]
        bounds = {type(m).__name__: m for m in field.metadata}
        flag = EXTRAS.get(name, {}).get("flag", f"--{name.replace('_', '-')}").split("/")[0]
        expected = {
            "help": field.description,
            "default": field.default,
            "flag": flag,
            "min": bounds["Ge"].ge if "Ge" in bounds else None,
            "max": bounds["Le"].le if "Le" in bounds else None,
        }
        got = dict(
            help=option.help, default=option.default, flag=option.opts[0], min=option.min,
            max=option.max,
        )  # fmt: skip
        problems += [f"{command} {flag}: {k}" for k in expected if got[k] != expected[k]]
    assert not problems
