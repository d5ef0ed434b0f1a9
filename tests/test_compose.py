"""docker-compose.yml: valid for the Compose tool, and every fedkey command in it parses.

There is no Docker engine on these machines: the file is validated here, not run."""

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer

from fedkey.cli import app

ROOT = Path(__file__).resolve().parents[1]


def compose_tool() -> list[str] | None:
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def resolved_config() -> str:
    tool = compose_tool()
    if tool is None:
        pytest.skip("no Docker Compose client on this machine (CI installs docker-compose)")
    out = subprocess.run(
        [*tool, "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        env={"FEDKEY_ENROLLMENT_SECRET": "test", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_compose_file_is_valid():
    config = resolved_config()
    for key in (
        "server:",
        "devices:",
        "keyboard:",
        "healthcheck:",
        "fedkey-data:",
        "service_healthy",
    ):
        assert key in config


def fedkey_commands() -> list[list[str]]:
    """The `fedkey ...` command lines written in docker-compose.yml."""
    text = (ROOT / "docker-compose.yml").read_text()
    commands, current = [], None
    for line in text.splitlines():
        stripped = line.strip()
        stripped = (
            stripped[2:].strip() if stripped.startswith("- ") else stripped
        )  # a YAML list item
        if stripped.startswith("fedkey "):
            current = [stripped]
            commands.append(current)
        elif current is not None and stripped.startswith("--"):
            current.append(stripped)
        else:
            current = None
    return [shlex.split(" ".join(c).replace("$$HOSTNAME", "host")) for c in commands]


@pytest.mark.parametrize("argv", fedkey_commands(), ids=lambda a: a[1])
def test_every_compose_command_parses(argv, monkeypatch):
    monkeypatch.setenv("FEDKEY_ENROLLMENT_SECRET", "test")  # compose passes it in the environment
    command = typer.main.get_command(app)
    ctx = command.make_context("fedkey", argv[1:2], resilient_parsing=False)
    sub = command.get_command(ctx, argv[1])
    assert sub is not None, f"unknown command {argv[1]}"
    sub.make_context(argv[1], argv[2:])  # raises on an unknown option or a bad value
