"""reference/cli.md: the `fedkey` command tree (the Typer app, cli.app, walked as click commands):
every command, its help, its arguments and options."""

from __future__ import annotations

import re
from typing import Any

from tools.reference_pages.markup import GENERATED_NOTE, cell, code, paragraphs


def cli_commands() -> list[tuple[str, Any]]:
    """Every command of the `fedkey` app as (full name, click command), groups included, in the
    order `fedkey --help` lists them."""
    import typer.main

    from fedkey.cli import app

    root = typer.main.get_command(app)
    found: list[tuple[str, Any]] = []

    def walk(name: str, command: Any) -> None:
        found.append((name, command))
        for sub_name, sub in getattr(command, "commands", {}).items():
            if not getattr(sub, "hidden", False):
                walk(f"{name} {sub_name}", sub)

    walk("fedkey", root)
    return found


def _type_of(param: Any, ctx: Any) -> str:
    try:
        shown = str(param.display_type(ctx))  # typer's own rendering: <fedavg|fedatt>, <int range>
    except (AttributeError, TypeError):
        shown = getattr(getattr(param, "type", None), "name", "")
    return shown.strip("<>")


def _default_of(param: Any) -> str:
    if getattr(param, "required", False):
        return "required"
    default = param.default
    if callable(default) or default is None or default is False or default == "":
        return ""
    if isinstance(default, bool) and getattr(param, "secondary_opts", None):
        return code(param.opts[0] if default else param.secondary_opts[0])
    if isinstance(default, (list, tuple)):
        return code(", ".join(map(str, default))) if default else ""
    return code(default)


def _range_of(param: Any) -> str:
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    if low is None and high is None:
        return ""
    if low is not None and high is not None:
        return f" ({low} to {high})"
    return f" (at least {low})" if low is not None else f" (at most {high})"


def cli_reference() -> str:
    """reference/cli.md: every `fedkey` command with its help and its parameters."""
    from typer._click import Context

    lines = [
        GENERATED_NOTE,
        "# Command line",
        "",
        "Every command of `fedkey` (`python -m fedkey` is the same program), as `fedkey <command> "
        "--help` prints it. Options marked with a `FEDKEY_*` variable can also be set by that "
        "environment variable; a flag wins over the variable.",
        "",
    ]
    for name, command in cli_commands():
        ctx = Context(command, info_name=name)
        lines += [f"## `{name}`", "", paragraphs(command.help), ""]
        subcommands = getattr(command, "commands", {})
        if subcommands:
            lines += ["| command | what it does |", "|---|---|"]
            for sub_name, sub in subcommands.items():
                summary = paragraphs(sub.short_help or sub.help).split("\n\n")[0]
                slug = re.sub(r"[^a-z0-9]+", "-", f"{name} {sub_name}".lower()).strip("-")
                lines.append(f"| [`{name} {sub_name}`](#{slug}) | {cell(summary)} |")
            lines.append("")
        params = [p for p in command.params if not getattr(p, "hidden", False)]
        arguments = [p for p in params if getattr(p, "param_type_name", "") == "argument"]
        options = [p for p in params if getattr(p, "param_type_name", "") == "option"]
        if arguments:
            lines += ["| argument | type | meaning |", "|---|---|---|"]
            for p in arguments:
                meaning = getattr(p, "help", None) or ""
                required = "" if getattr(p, "required", False) else " (optional)"
                lines.append(
                    f"| {code(p.name.upper())} | {cell(_type_of(p, ctx))} | {cell(meaning)}{required} |"
                )
            lines.append("")
        if options:
            lines += ["| option | type | default | meaning |", "|---|---|---|---|"]
            for p in options:
                flags = " / ".join(code(f) for f in [*p.opts, *p.secondary_opts])
                meaning = cell(getattr(p, "help", None) or "")
                if p.envvar:
                    envvars = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar)
                    meaning += " " + " ".join(f"[env: {code(e)}]" for e in envvars)
                kind = "flag" if getattr(p, "is_flag", False) else _type_of(p, ctx)
                lines.append(
                    f"| {flags} | {cell(kind + _range_of(p))} | {_default_of(p)} | {meaning} |"
                )
            lines.append("")
    return "\n".join(lines)
