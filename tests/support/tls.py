"""A self-signed certificate for 127.0.0.1 and localhost, made with the openssl command (the tests
that need one are skipped where it is missing)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) in `directory`, valid a day for 127.0.0.1 and localhost."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not on this machine")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key
