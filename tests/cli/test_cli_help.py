"""`fedkey --help` and the --help of every command and sub-command answer without importing
torch (it takes seconds): the command line imports only torch-free config modules until a
command runs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: the test process has torch loaded already (tests/conftest.py).
HELP_EVERYWHERE = """
import sys

import typer
from typer.testing import CliRunner

from fedkey.cli import app

group = typer.main.get_command(app)
paths = [[]]
for name, command in group.commands.items():
    paths.append([name])
    paths += [[name, sub] for sub in getattr(command, "commands", {})]
runner = CliRunner()
for path in paths:
    result = runner.invoke(app, [*path, "--help"])
    assert result.exit_code == 0, (path, result.output)
    assert "Usage" in result.output, (path, result.output)
loaded = sorted(m for m in ("torch", "onnxruntime") if m in sys.modules)
assert not loaded, loaded
print(len(paths))
"""


def test_help_of_every_command_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", HELP_EVERYWHERE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # the app, its 12 commands, the audit group and its 1, the data group and its 2 (fetch,
    # where), the vocabulary group and its 1 (discover); the benchmarks are fedkey-bench's
    assert int(out.stdout.split()[-1]) == 22  # fedkey, its 17 commands, their 4 subcommands


def test_python_dash_m_cli_is_the_fedkey_command():
    out = subprocess.run(
        [sys.executable, "-m", "fedkey", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    for command in ("simulate", "server", "devices", "run", "demo", "audit"):
        assert command in out.stdout
    assert "bench" not in out.stdout  # the research harness is experiments/' fedkey-bench
