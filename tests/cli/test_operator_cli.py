"""`fedkey enroll-tokens` and `fedkey revoke` against a server under uvicorn, as an operator runs
them: the token from FEDKEY_OPERATOR_TOKEN, the tokens to a file only the operator reads, and one
error line for what goes wrong."""

from __future__ import annotations

import httpx
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.server.app import create_app
from fedkey.testing.http import make_settings
from fedkey.testing.keyboard import ThreadServer

OPERATOR = "operator-token-0123456789"


def test_mint_enroll_and_revoke_from_the_command_line(tmp_path):
    settings = make_settings(
        tmp_path, enrollment="tokens", operator_token=OPERATOR, wait_devices=10
    )
    runner = CliRunner()
    env = {"FEDKEY_OPERATOR_TOKEN": OPERATOR}
    with ThreadServer(create_app(settings)) as server:
        out = tmp_path / "tokens.txt"
        minted = runner.invoke(
            app, ["enroll-tokens", "2", "--server", server.url, "--out", str(out)], env=env
        )
        assert minted.exit_code == 0, minted.output
        tokens = out.read_text().split()
        assert len(tokens) == 2 and out.stat().st_mode & 0o777 == 0o600
        body = {"enrollment_secret": tokens[0], "name": "phone-1"}
        phone = httpx.post(f"{server.url}/v1/devices", json=body).json()["token"]
        auth = {"Authorization": f"Bearer {phone}"}
        assert httpx.get(f"{server.url}/v1/rounds/current", headers=auth).status_code == 200

        revoked = runner.invoke(app, ["revoke", "phone-1", "--server", server.url], env=env)
        assert revoked.exit_code == 0 and "revoked phone-1" in revoked.output
        assert httpx.get(f"{server.url}/v1/rounds/current", headers=auth).status_code == 401

        again = runner.invoke(app, ["revoke", "phone-1", "--server", server.url], env=env)
        assert again.exit_code == 1 and "error: DELETE /v1/devices/phone-1: 404" in again.output
        wrong = runner.invoke(
            app, ["enroll-tokens", "1", "--server", server.url], env={"FEDKEY_OPERATOR_TOKEN": "x"}
        )
        assert wrong.exit_code == 1 and "401" in wrong.output
    unset = runner.invoke(app, ["enroll-tokens", "1"], env={"FEDKEY_OPERATOR_TOKEN": ""})
    assert unset.exit_code == 1 and "error: set FEDKEY_OPERATOR_TOKEN" in unset.output
