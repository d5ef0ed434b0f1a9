"""HTTPS: `fedkey server --tls-cert --tls-key` serves TLS, and the phones check its certificate:
against the machine's trusted ones (a self-signed certificate is refused), or against
SSL_CERT_FILE, with which a fleet runs its round."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fedkey.device_sim.fleets.thread_fleet import FleetConfig, run_fleet
from fedkey.runners.processes import free_port, wait_healthy
from fedkey.testing.tls import self_signed

ROOT = Path(__file__).resolve().parents[2]
SECRET = "tls-secret"

pytestmark = pytest.mark.slow


def test_a_fleet_trains_over_https_and_checks_the_certificate(tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path)
    port = free_port()
    cmd = [
        sys.executable, "-m", "fedkey", "server", "--storage", str(tmp_path / "run"),
        "--port", str(port), "--tls-cert", str(cert), "--tls-key", str(key),
        "--enrollment-secret", SECRET, "--data", "demo", "--max-train-tokens", "3000",
        "--max-eval-sentences", "20", "--ksr-sentences", "5", "--rounds", "1",
        "--fraction", "1.0", "--wait-devices", "2", "--local-epochs", "1",
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("a")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # what a phone of this deployment trusts
        wait_healthy(url, proc, timeout=60)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/healthz", trust_env=False)  # only the public authorities
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz")  # no plain HTTP beside it
        fleet = FleetConfig(
            server=url, count=2, data="demo", max_train_tokens=3000, device="cpu", workers=0,
            enrollment_secret=SECRET,
        )  # fmt: skip
        summary = run_fleet(fleet, progress=False)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert summary["uploads"] == 2 and not summary["errors"], summary
