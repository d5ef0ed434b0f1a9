"""Supervising the processes fedkey starts: a free loopback port, waiting for a server to answer,
and a group of child processes that stops together. Used by `fedkey run`, `fedkey demo`, the
benchmarks and the tests, so there is one way to do each."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

__all__ = [
    "ProcessError",
    "ProcessGroup",
    "free_port",
    "listen_problem",
    "server_env",
    "wait_for",
    "wait_healthy",
]

#: The environment a federation server process starts with unless this one sets it: glibc's
#: malloc keeps at most 2 arenas (it reads MALLOC_ARENA_MAX at process start, so it is set for
#: the child, as the Dockerfile sets it), which keeps a long-lived server's memory from creeping
#: up with fragmented per-thread arenas.
SERVER_ENV = {"MALLOC_ARENA_MAX": "2"}

#: Signals that stop a group as Ctrl-C does, while a `with ProcessGroup(...)` block runs in the
#: main thread: `kill` (SIGTERM) or a closed terminal (SIGHUP) otherwise ended this process at
#: once and left its children running (`fedkey demo`'s server and keyboard went on serving).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

T = TypeVar("T")


class ProcessError(RuntimeError):
    """A child process exited, or did not get ready, when it was needed."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (e.g. "Address already in use"), or None."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def server_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` plus SERVER_ENV's variables that neither `env` nor this process's environment set."""
    extra = {k: v for k, v in SERVER_ENV.items() if k not in os.environ}
    return {**extra, **(env or {})}


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout: float = 120.0,
    path: str = "/healthz",
    name: str = "the server",
) -> None:
    """Wait until GET url+path answers 200; ProcessError if `proc` exits first or time runs out."""
    import httpx

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}{path}", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    if wait_for(healthy, timeout, proc=proc, interval=0.2):
        return
    if proc is not None and proc.poll() is not None:
        raise ProcessError(f"{name} exited with code {proc.returncode} before it was ready")
    raise ProcessError(f"{name} at {url} was not healthy after {timeout:.0f} s")


def wait_for(
    condition: Callable[[], T],
    timeout: float,
    proc: subprocess.Popen | None = None,
    interval: float = 0.5,
) -> T | None:
    """Poll `condition` until it returns something truthy, and return that; None once `timeout`
    seconds pass or `proc` exits. The one polling loop: wait_healthy and the tests' wait_for use it."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            return None
        time.sleep(interval)
    return value


class ProcessGroup:
    """Child processes that stop together.

    `start(name, argv)` runs a command with its stdout and stderr in `log_dir/<name>.log` and
    `env` added to this process's environment. `stop()`, also run on leaving a `with` block
    (an exception or Ctrl-C included), terminates every child still running, waits up to `grace`
    seconds for each, then kills those left. Inside the block (in the main thread) SIGTERM and
    SIGHUP raise KeyboardInterrupt, as Ctrl-C does, and are ignored while the group stops."""

    def __init__(
        self, log_dir: Path, env: Mapping[str, str] | None = None, grace: float = 20.0
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.grace = grace
        self.procs: list[subprocess.Popen] = []
        self._logs: list[IO[str]] = []
        self._handlers: dict[int, object] = {}  # the signal handlers the block replaced

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        """Start `argv`, with `env` (for this child only) over the group's over this process's."""
        log = self.log(name).open("w")
        self._logs.append(log)
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env, **(env or {})},
        )
        self.procs.append(proc)
        return proc

    def first_exit(
        self, ignore: Iterable[subprocess.Popen] = (), interval: float = 1.0
    ) -> subprocess.Popen:
        """Block until a child (other than those in `ignore`) exits; return it."""
        skip = {id(p) for p in ignore}
        watched = [p for p in self.procs if id(p) not in skip]
        while True:
            for p in watched:
                if p.poll() is not None:
                    return p
            time.sleep(interval)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self._logs:
            log.close()

    def __enter__(self) -> ProcessGroup:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._handlers[sig] = signal.signal(sig, _interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in self._handlers:  # a second signal must not cut the stopping short
            signal.signal(sig, signal.SIG_IGN)
        try:
            self.stop()
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            self._handlers = {}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")
