"""Every failure of the command line a user can cause is one line on stderr, `error: ...`, and a
non-zero exit status; never a traceback, never pydantic's validation dump."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.cli.errors import user_errors, validation_problems
from fedkey.runners.processes import free_port
from fedkey.server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def one_error_line(result) -> str:
    """The only line the failed command wrote to stderr (asserting there is only one)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.output
    return lines[0]


def test_a_missing_corpus_is_one_line(tmp_path):
    result = runner.invoke(app, ["simulate", "--data", "/nonexistent", "--out", str(tmp_path)])
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "'/nonexistent' not found" in line and "accepted corpus specs" in line


def test_a_server_is_not_started_on_a_missing_corpus(tmp_path):
    """Its loader would fail inside the server's startup, a traceback in its log."""
    for command in (["server", "--storage"], ["run", "--out"]):
        result = runner.invoke(app, [*command, str(tmp_path), "--data", "/nonexistent"])
        assert result.exit_code == 1
        assert one_error_line(result).startswith("error: --data: corpus '/nonexistent' not found")


def test_a_setting_that_contradicts_another_is_its_own_message(tmp_path):
    args = ["simulate", "--strategy", "fedatt", "--dp-clip", "1", "--adafl", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert one_error_line(result) == (
        "error: AdaFL selection scores phones by their private updates without noise, so its "
        "choices are not covered by the DP analysis: use uniform selection (drop --adafl)"
    )


def test_a_value_settings_refuses_names_its_flag(tmp_path):
    """A strict bound (lr > 0) typer cannot check: Settings refuses the value."""
    result = runner.invoke(app, ["simulate", "--lr", "0", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert one_error_line(result) == "error: --lr 0.0: input should be greater than 0"


def test_a_bound_of_a_settings_field_is_checked_by_its_flag(tmp_path):
    """An inclusive bound (vocab_size >= 4) becomes the option's min: typer refuses the value."""
    result = runner.invoke(app, ["simulate", "--vocab-size", "2", "--out", str(tmp_path)])
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "'--vocab-size'" in line and "greater than or equal to 4" in line


def test_validation_problems_one_line_each_without_pydantic_noise(monkeypatch):
    monkeypatch.setenv("FEDKEY_DP_SIGMA", "-1")
    with pytest.raises(ValidationError) as e:
        Settings(rounds=0, strategy="fedatt", dp_clip=1.0)
    lines = validation_problems(e.value, flags={"rounds"}).splitlines()
    assert lines == [
        "--rounds 0: input should be greater than or equal to 1",
        "FEDKEY_DP_SIGMA=-1: input should be greater than or equal to 0",
    ]  # the cross-field check runs only once the fields are valid
    assert "pydantic.dev" not in str(lines)


@pytest.mark.parametrize(
    "name,value,problem",
    [
        ("MAX_SENDING", "0", "greater than or equal to 1"),
        ("MAX_SENDING", "-3", "greater than or equal to 1"),
        ("SEND_TIMEOUT", "0", "greater than 0"),
        ("SEND_TIMEOUT", "-1", "greater than 0"),
        ("SEND_TIMEOUT", "inf", "a finite number"),
    ],
)
def test_the_download_limits_refuse_what_is_not_a_limit(monkeypatch, name, value, problem):
    """FEDKEY_MAX_SENDING (download bodies at once) and FEDKEY_SEND_TIMEOUT (seconds a download
    may wait for its reader): one line naming the variable."""
    monkeypatch.setenv(f"FEDKEY_{name}", value)
    with pytest.raises(ValidationError) as e:
        Settings()
    lines = validation_problems(e.value).splitlines()
    assert lines == [f"FEDKEY_{name}={value}: input should be {problem}"]


def test_an_unknown_choice_is_one_usage_line(tmp_path):
    result = runner.invoke(app, ["simulate", "--strategy", "fedfoo", "--out", str(tmp_path)])
    assert result.exit_code == 2
    line = one_error_line(result)
    assert "'fedfoo' is not one of 'fedsgd', 'fedavg', 'fedatt', 'fedattopt', 'fedmed'" in line
    assert line.endswith("see 'root simulate --help'")


def test_a_device_torch_cannot_use_is_refused_before_anything_runs(tmp_path):
    result = runner.invoke(app, ["simulate", "--device", "gpu0", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "'gpu0' is not a device" in one_error_line(result)


@pytest.mark.parametrize("command", ["simulate", "run", "server"])
def test_an_evaluation_device_torch_cannot_use_is_refused(tmp_path, command, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on the CI machine
    out = ["--storage" if command == "server" else "--out", str(tmp_path / "run")]
    result = runner.invoke(app, [command, "--eval-device", "cuda", *out])
    assert result.exit_code == 2
    assert "torch sees no CUDA GPU here" in one_error_line(result)
    assert not (tmp_path / "run").exists()  # refused before anything ran
    result = runner.invoke(app, [command, "--eval-device", "mps", *out])
    assert "mps is not an evaluation device" in one_error_line(result)


def test_a_server_url_without_its_scheme_is_refused():
    result = runner.invoke(
        app, ["devices", "--server", "127.0.0.1:8000", "--enrollment-secret", "x"]
    )
    assert result.exit_code == 2
    assert "'127.0.0.1:8000' is not a server URL: give http://HOST:PORT" in one_error_line(result)


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        result = runner.invoke(app, ["server", "--port", port, "--storage", str(tmp_path)])
        assert result.exit_code == 1
        line = one_error_line(result)
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line
        result = runner.invoke(app, ["keyboard", "--watch", str(tmp_path), "--port", port])
        assert result.exit_code == 1 and "Address already in use" in one_error_line(result)


def test_a_file_that_is_no_checkpoint_is_one_line(tmp_path):
    bogus = tmp_path / "model.safetensors"
    bogus.write_text("not a checkpoint")
    for args in (["info", str(bogus)], ["export", "--checkpoint", str(bogus)]):
        result = runner.invoke(app, [*args])
        assert result.exit_code == 1
        assert f"error: {bogus} is not a .safetensors checkpoint" in one_error_line(result)


def test_phones_without_a_server_end_with_one_line():
    """`fedkey devices` against a port nobody listens on: it says at once that it retries, then,
    once --retry-seconds are spent, fails with one line (it printed a traceback)."""
    url = f"http://127.0.0.1:{free_port()}"
    args = ["devices", "--server", url, "--enrollment-secret", "x", "--retry-seconds", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "fedkey", *args, "--count", "2", "--workers", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert any("retrying for up to 1 s" in line for line in lines[:-1])  # said at once
    assert lines[-1].startswith("error: GET /v1/model: the server stayed unavailable for 1 s")
    assert lines[-1].endswith(f"is a fedkey server running at {url} (--server)?")


def test_user_errors_turns_ctrl_c_into_130_and_leaves_bugs_alone(monkeypatch, capsys):
    with pytest.raises(typer.Exit) as e, user_errors():
        raise KeyboardInterrupt
    assert e.value.exit_code == 130
    with pytest.raises(KeyError), user_errors():  # a bug keeps its traceback
        raise KeyError("bug")
    with pytest.raises(typer.Exit) as e, user_errors():
        raise ValueError("alpha must be > 0\n(got -1)")
    assert e.value.exit_code == 1
    assert capsys.readouterr().err == "error: alpha must be > 0; (got -1)\n"
    monkeypatch.setenv("FEDKEY_TRACEBACK", "1")  # the traceback of a one-line error, on demand
    with pytest.raises(ValueError), user_errors():
        raise ValueError("alpha must be > 0")
