"""reference/configuration.md: fedkey.server.settings.Settings: every field, its FEDKEY_* variable, its
flag, type, default and meaning (the field's description, the flag's help or its comment)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Any

from tools.reference_pages.cli_page import cli_commands
from tools.reference_pages.markup import GENERATED_NOTE, cell, code


def _comments(source: str) -> dict[str, str]:
    """Settings field name -> the comment that explains it in server/settings.py: the comment on
    its line, else the comment lines directly above it."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Settings")
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        row = node.lineno
        if row in comments and not lines[row - 1].lstrip().startswith("#"):
            found[node.target.id] = comments[row]
            continue
        above: list[str] = []
        row -= 1
        while row in comments and lines[row - 1].lstrip().startswith("#"):
            if comments[row].startswith("--"):  # a section header: "-- model ----"
                break
            above.insert(0, comments[row])
            row -= 1
        found[node.target.id] = " ".join(above)
    return found


def _option_helps() -> dict[str, tuple[str, str]]:
    """FEDKEY_* variable -> (the flag, its help), from every command that has the option."""
    helps: dict[str, tuple[str, str]] = {}
    for _, command in cli_commands():
        for p in getattr(command, "params", []):
            envvar = getattr(p, "envvar", None)
            if isinstance(envvar, str) and getattr(p, "help", None) and envvar not in helps:
                helps[envvar] = (p.opts[0], p.help)
    return helps


def _type_name(annotation: Any) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"typing\.Literal\[(.*?)\]", lambda m: m.group(1).replace(", ", " | "), text)
    text = text.replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")
    return text.replace("NoneType", "None").replace("'", "")


def settings_fields() -> dict[str, Any]:
    """fedkey.server.settings.Settings's fields, name -> pydantic FieldInfo."""
    from fedkey.server.settings import Settings

    return dict(Settings.model_fields)


def configuration_reference() -> str:
    """reference/configuration.md: every Settings field."""
    import fedkey.server.settings
    from fedkey.server.settings import Settings

    prefix = str(Settings.model_config.get("env_prefix", "FEDKEY_"))
    comments = _comments(Path(fedkey.server.settings.__file__).read_text())
    helps = _option_helps()
    lines = [
        GENERATED_NOTE,
        "# Configuration",
        "",
        "`fedkey server` (and `python -m fedkey.server.main`, which `fedkey run` starts) is configured by "
        "one pydantic-settings class, `server/settings.py`. Every field is an environment "
        f"variable `{prefix}<NAME>`; the federation's options are also flags of `simulate`, "
        "`server` and `run`, with the same defaults (a flag wins over the variable). The flag "
        "column names the flag where there is one.",
        "",
        "| variable | flag | type | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, field in settings_fields().items():
        envvar = f"{prefix}{name.upper()}"
        flag, help_text = helps.get(envvar, ("", ""))
        meaning = field.description or help_text or comments.get(name, "")
        default = field.default
        if type(default).__name__ == "SecretStr" or default is None:
            shown = "" if default is None else "(secret)"
        else:
            shown = code(default)
        limits = [
            f"{op} {getattr(m, attr)}"
            for m in field.metadata
            for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if getattr(m, attr, None) is not None
        ]
        kind = _type_name(field.annotation) + (f" ({', '.join(limits)})" if limits else "")
        lines.append(
            f"| {code(envvar)} | {code(flag) if flag else ''} | {cell(kind)} | {shown} | {cell(meaning)} |"
        )
    lines.append("")
    return "\n".join(lines)
