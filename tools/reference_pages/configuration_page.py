"""reference/configuration.md: fedkey.server.settings.Settings: every field, its FEDKEY_* variable, its
flag, type (with its bounds), default and meaning: the field's description, the one text the
flags' help is made of too (fedkey.cli.options)."""

from __future__ import annotations

import re
from typing import Any

from tools.reference_pages.cli_page import cli_commands
from tools.reference_pages.markup import GENERATED_NOTE, cell, code

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _flags() -> dict[str, str]:
    """FEDKEY_* variable -> the flag of the first command that has an option read from it."""
    flags: dict[str, str] = {}
    for _, command in cli_commands():
        for p in getattr(command, "params", []):
            envvar = getattr(p, "envvar", None)
            if isinstance(envvar, str) and envvar not in flags:
                flags[envvar] = p.opts[0]
    return flags


def _type_name(annotation: Any) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"typing\.Literal\[(.*?)\]", lambda m: m.group(1).replace(", ", " | "), text)
    text = text.replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")
    return text.replace("NoneType", "None").replace("'", "")


def _kind(field: Any) -> str:
    """The field's type and its bounds: `int (>= 1)`."""
    limits = [
        f"{op} {getattr(m, attr)}"
        for m in field.metadata
        for attr, op in _BOUNDS
        if getattr(m, attr, None) is not None
    ]
    return _type_name(field.annotation) + (f" ({', '.join(limits)})" if limits else "")


def _default(field: Any) -> str:
    if field.default is None:
        return ""
    return "(secret)" if type(field.default).__name__ == "SecretStr" else code(field.default)


def settings_fields() -> dict[str, Any]:
    """fedkey.server.settings.Settings's fields, name -> pydantic FieldInfo."""
    from fedkey.server.settings import Settings

    return dict(Settings.model_fields)


def configuration_reference() -> str:
    """reference/configuration.md: every Settings field."""
    from fedkey.server.settings import Settings

    prefix = str(Settings.model_config.get("env_prefix", "FEDKEY_"))
    flags = _flags()
    lines = [
        GENERATED_NOTE,
        "# Configuration",
        "",
        "`fedkey server` (and `python -m fedkey.server.main`, which `fedkey run` starts) is configured by "
        "one pydantic-settings class, `server/settings.py`. Every field is an environment "
        f"variable `{prefix}<NAME>`; the federation's options are also flags of `simulate`, "
        "`server` and `run`, with the same defaults, bounds and help (a flag wins over the "
        "variable). The flag column names the flag where there is one.",
        "",
        "| variable | flag | type | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, field in settings_fields().items():
        envvar = f"{prefix}{name.upper()}"
        flag = code(flags[envvar]) if envvar in flags else ""
        meaning = cell(field.description or "")
        lines.append(
            f"| {code(envvar)} | {flag} | {cell(_kind(field))} | {_default(field)} | {meaning} |"
        )
    lines.append("")
    return "\n".join(lines)
