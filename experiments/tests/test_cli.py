"""`fedkey-bench`: the benchmarks' own command, beside the product's `fedkey` (which no longer lists
them); its --help and every command's answer without importing torch, and it fails as `fedkey`
does (one `error: ...` line)."""

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from fedkey_bench.cli import app

ROOT = Path(__file__).resolve().parents[2]  # the fedkey checkout
COMMANDS = (
    "perf",
    "paper",
    "merge",
    "attacks",
    "privacy",
    "load",
    "peers",
    "cohorts",
    "aggregation",
    "canary",
    "typing",
    "dpfinetune",
)

# A fresh interpreter: the test process has torch loaded already (conftest.py).
HELP_EVERYWHERE = """
import sys

from typer.testing import CliRunner

from fedkey_bench.cli import app

runner = CliRunner()
for path in ([], *[[c] for c in sys.argv[1:]]):
    result = runner.invoke(app, [*path, "--help"])
    assert result.exit_code == 0, (path, result.output)
    assert "Usage" in result.output, (path, result.output)
loaded = sorted(m for m in ("torch", "onnxruntime") if m in sys.modules)
assert not loaded, loaded
"""


def test_fedkey_bench_lists_the_benchmarks_and_fedkey_does_not():
    out = subprocess.run(
        [sys.executable, "-m", "fedkey_bench.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout
    for command in COMMANDS:
        assert command in out.stdout
    product = subprocess.run(
        [sys.executable, "-m", "fedkey", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert product.returncode == 0 and "bench" not in product.stdout


def test_help_of_every_command_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", HELP_EVERYWHERE, *COMMANDS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def test_a_mistake_is_one_error_line():
    result = CliRunner().invoke(app, ["privacy", "--data", "/nonexistent/corpus"])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: --data: no corpus folder /nonexistent/corpus (it needs train/valid/test files)"
    )
