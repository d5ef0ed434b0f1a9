"""Supervising the processes fedkey starts: a free loopback port, waiting for a server to answer,
and a group of child processes that stops together. Used by `fedkey run`, `fedkey demo`, the
benchmarks and the tests, so there is one way to do each."""

from __future__ import annotations

import socket
import subprocess
import time

__all__ = ["free_port", "wait_healthy"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout: float = 120.0,
    path: str = "/healthz",
) -> None:
    """Wait until GET url+path answers 200; RuntimeError if `proc` exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} was not healthy after {timeout:.0f} s")
