"""How the command line fails: one line on stderr, `error: <what was wrong>`, and a non-zero exit.

`user_errors` turns the mistakes a person can make (a bad flag or value, a missing file, a
setting that contradicts another, a server that cannot be reached, a child process that would not
start, Ctrl-C) into that line. `FedkeyGroup`, the click group of `fedkey`, applies it around the
parsing and the running of every command, so `fedkey ...`, `python -m fedkey ...` and typer's
CliRunner all fail the same way. Anything else (a bug) still ends in its traceback, and
FEDKEY_TRACEBACK=1 shows the traceback of the one-line errors too (a ValueError may be a bug).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from fedkey.runners.processes import ProcessError, listen_problem

#: Exit status of a command stopped by Ctrl-C (128 + SIGINT), as a shell reports it.
INTERRUPTED = 130


class UserError(Exception):
    """A mistake in what was asked for; each line of the message is printed as `error: <line>`."""


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: <line>` for each line of `message` on stderr; the Exit to raise with it."""
    for line in message.splitlines() or [""]:
        typer.echo(f"error: {line}", err=True)
    return typer.Exit(code)


def validation_problems(e: ValidationError, flags: Collection[str] = ()) -> str:
    """One line per problem of a pydantic ValidationError, without pydantic's URLs and types.

    A field the command took as an option is named by its flag (`--vocab-size 2: ...`), one
    set in the environment by its variable (`FEDKEY_DP_SIGMA=-1: ...`); a check across fields
    (a model validator) is its own message."""
    lines = []
    for err in e.errors(include_url=False):
        ctx_error = (err.get("ctx") or {}).get("error")
        msg = str(ctx_error) if err["type"] == "value_error" and ctx_error else err["msg"]
        if not err["loc"]:
            lines.append(msg)
            continue
        name = str(err["loc"][0])
        value = err.get("input")
        if name in flags:
            label = f"--{name.replace('_', '-')} {value}"
        elif f"FEDKEY_{name.upper()}" in os.environ:
            label = f"FEDKEY_{name.upper()}={value}"
        else:
            label = f"{name} {value}"
        lines.append(f"{label}: {msg[:1].lower()}{msg[1:]}")
    return "\n".join(lines)


def _one_line(e: BaseException | str) -> str:
    """The message on one line (the lines of a multi-line one joined with '; ')."""
    text = str(e).strip() or type(e).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def check_can_listen(host: str, port: int) -> None:
    """A UserError, before anything starts, if a server could not listen on host:port."""
    problem = listen_problem(host, port)
    if problem is not None:
        raise UserError(
            f"cannot listen on {host}:{port}: {problem}; choose another --port (or --host)"
        )


def _os_message(e: OSError) -> str:
    """'<file>: <reason>' for a file the system refused, else the message (no '[Errno N]')."""
    if e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    return e.strerror if e.strerror and len(e.args) == 2 else _one_line(e)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can cause into `error: ...` on stderr and an exit status:
    usage errors 2 (as click), Ctrl-C 130, the others 1."""
    try:
        yield
    except typer.TyperException as e:  # click's usage errors: a bad flag or value, a missing option
        if type(e).__name__ == "NoArgsIsHelpError":  # `fedkey audit`: the help, as typer shows it
            raise
        message = _one_line(e.format_message()).replace("Value error, ", "").rstrip(".")
        ctx = getattr(e, "ctx", None)
        hint = f"; see '{ctx.command_path} --help'" if ctx is not None else ""
        raise fail(message + hint, e.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None
    except UserError as e:
        raise fail(str(e)) from None
    except ValidationError as e:
        raise fail(validation_problems(e)) from None
    except BrokenPipeError:  # `fedkey ... | head`: typer exits quietly
        raise
    except (OSError, ValueError, ProcessError) as e:
        if os.environ.get("FEDKEY_TRACEBACK"):
            raise
        if isinstance(e, OSError):  # a missing file or directory, a refused connection
            raise fail(_os_message(e)) from None
        # ValueError: a value the loaders or configs refuse (a corpus, a checkpoint, --clients
        # larger than the corpus); ProcessError: a child process (a server, the keyboard) that
        # exited or never answered.
        raise fail(_one_line(e)) from None


class FedkeyGroup(TyperGroup):
    """The `fedkey` group: parses and runs every command inside `user_errors`."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra):
        with user_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with user_errors():
            return super().invoke(ctx)
