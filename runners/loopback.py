"""`fedkey run`: a federation server in its own process and a fleet of phones in this one, on
loopback, over real HTTP; `fedkey simulate` through the whole network stack.

The server process is `python -m fedkey.server.main`, configured by FEDKEY_* environment variables built
from a Settings (only those that differ from the defaults); its output goes to a log file, and it
is stopped (terminate, then kill) however the run ends.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

from fedkey.device_sim.config import FleetConfig
from fedkey.federation.storage import RunStorage
from fedkey.runners.processes import ProcessError, ProcessGroup, server_env, wait_healthy
from fedkey.server.settings import Settings

__all__ = ["ServerProcess", "fresh_run_dir", "run_loopback", "settings_env"]


def fresh_run_dir(out: Path) -> None:
    """Make `out` a fresh run directory, as `fedkey simulate` without --resume: the phones of a
    new run are new (a new secret), so an earlier run's devices, rounds and checkpoints there
    would only refuse or confuse them."""
    out.mkdir(parents=True, exist_ok=True)
    RunStorage(out).reset()
    for stale in ("fedkey.db", "fedkey.db-wal", "fedkey.db-shm"):
        (out / stale).unlink(missing_ok=True)


def settings_env(settings: Settings) -> dict[str, Any]:
    """The settings that differ from their defaults, to hand to a server process."""
    return {
        name: getattr(settings, name)
        for name, field in Settings.model_fields.items()
        if getattr(settings, name) != field.default
    }


def _env(value: Any) -> str:
    if hasattr(value, "get_secret_value"):
        return value.get_secret_value()
    return str(value).lower() if isinstance(value, bool) else str(value)


class ServerProcess:
    """`python -m fedkey.server.main` with `settings`, its output in `log_dir/server.log`; a context
    manager that starts it on entry and stops it on exit (a ProcessGroup of one: terminate, wait
    up to `grace` s, then kill)."""

    proc: subprocess.Popen[str]  # started on entering the `with` block

    def __init__(self, settings: Settings, log_dir: Path, grace: float = 30.0) -> None:
        env = {f"FEDKEY_{k.upper()}": _env(v) for k, v in settings_env(settings).items()}
        self.group = ProcessGroup(log_dir, env=server_env(env), grace=grace)
        self.log_path = self.group.log("server")
        self.url = f"http://127.0.0.1:{settings.port}"

    def __enter__(self) -> ServerProcess:
        self.group.__enter__()  # SIGTERM stops the server too (fedkey.runners.processes.STOP_SIGNALS)
        self.proc = self.group.start("server", [sys.executable, "-m", "fedkey.server.main"])
        return self

    def wait_healthy(self) -> None:
        try:
            wait_healthy(self.url, self.proc)
        except ProcessError as e:
            raise ProcessError(f"{e}; see {self.log_path}") from None

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def __exit__(self, *exc: object) -> None:
        self.group.__exit__(*exc)


def run_loopback(
    settings: Settings,
    fleet: FleetConfig,
    on_ready: Callable[[str], None],
    on_metrics: Callable[[list[dict]], None],
) -> dict:
    """Run the federation `settings` describe (port, storage, exit_when_done=True) with the phones
    of `fleet`; returns the fleet's summary (as fedkey.device_sim.fleets.thread_fleet.run_fleet).

    `on_ready(url)` is called once the server answers; `on_metrics(rows)` once the phones heard
    "finished" (metrics.jsonl is then complete, perplexity.png drawn), while the server exits."""
    from fedkey.device_sim.fleets.thread_fleet import fleet_pool, run_fleet

    storage_dir = Path(settings.storage)
    with ServerProcess(settings, storage_dir) as server:
        with closing(fleet_pool(fleet)) as pool:  # its processes start while the server does
            server.wait_healthy()
            on_ready(server.url)
            summary = run_fleet(fleet, pool=pool)
            storage = RunStorage(storage_dir)
            storage.plot(f"{settings.strategy} over HTTP on {settings.data}")
            on_metrics(storage.read_metrics())
            server.wait(timeout=120)
    return summary
