"""A throwaway PostgreSQL cluster for `fedkey bench load --database postgresql` (issue 16).

The issue asks for the load report on SQLite and on PostgreSQL. The bench starts its own cluster
the way tests/server/test_postgres.py does: Debian's initdb and pg_ctl (the postgresql package,
/usr/lib/postgresql/<version>/bin) in a temporary directory, listening on 127.0.0.1 only on a free
port, trust authentication, one fresh database; as root (initdb refuses it) the cluster runs as the
`postgres` user (or `nobody`) through runuser. Unlike the tests' cluster it keeps durability on
(fsync, synchronous commits): the bench measures the server as it would run, not a tuned test
fixture. It is stopped and deleted when the cell ends.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from runners.processes import free_port

ROLE = "fedkey"
DATABASE = "fedkey"
HOST = "127.0.0.1"

__all__ = ["PostgresError", "cluster"]


class PostgresError(RuntimeError):
    """The throwaway cluster could not be started (one line: why, and what to install)."""


def pg_bin() -> Path | None:
    """The directory holding initdb and pg_ctl: on PATH, else Debian's newest version."""
    found = shutil.which("initdb")
    candidates = [str(Path(found).resolve().parent)] if found else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for d in candidates:
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    return None


def cluster_user() -> str | None:
    """The user to run the cluster as: None for this one, `postgres` (or `nobody`) as root."""
    if os.geteuid() != 0:
        return None
    if not shutil.which("runuser"):
        raise PostgresError("running as root (initdb refuses it) and runuser is not installed")
    for user in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(user)
            return user
    raise PostgresError("running as root (initdb refuses it) and there is no postgres user")


class _Cluster:
    def __init__(self, bindir: Path, root: Path, user: str | None) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.log = root / "postgres.log"
        self.prefix = ["runuser", "-u", user, "--"] if user else []
        self.port = 0

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.prefix, *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "LC_ALL": "C", "LANG": "C"},
        )

    def log_tail(self) -> str:
        return self.log.read_text()[-600:].strip() if self.log.exists() else "(no log)"

    def start(self, max_connections: int) -> None:
        init = self.run(
            str(self.bindir / "initdb"),
            *("-D", str(self.data), "-U", ROLE, "--auth=trust", "-E", "UTF8", "--locale=C"),
        )
        if init.returncode != 0:
            raise PostgresError(f"initdb failed: {(init.stderr or init.stdout).strip()[-400:]}")
        for _ in range(3):  # the free port may be taken between the probe and the start
            self.port = free_port(HOST)
            options = (
                f"-k {shlex.quote(str(self.root))} -h {HOST} -p {self.port} "
                f"-c max_connections={max_connections}"
            )
            ctl = self.run(
                str(self.bindir / "pg_ctl"),
                *("start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.log)),
                *("-o", options),
            )
            if ctl.returncode == 0:
                break
        else:
            raise PostgresError(
                f"pg_ctl start failed: {ctl.stderr.strip()[-300:]}; {self.log_tail()}"
            )
        made = self.run(
            str(self.bindir / "createdb"), *("-h", HOST, "-p", str(self.port), "-U", ROLE, DATABASE)
        )
        if made.returncode != 0:
            raise PostgresError(f"createdb failed: {made.stderr.strip()[-300:]}")

    def stop(self) -> None:
        if self.data.exists():
            self.run(str(self.bindir / "pg_ctl"), "stop", "-m", "fast", "-D", str(self.data))


@contextlib.contextmanager
def cluster(max_connections: int = 100) -> Iterator[str]:
    """A fresh cluster for one bench cell: yields the server's `--database-url`
    (postgresql+psycopg://fedkey@127.0.0.1:PORT/fedkey); stopped and deleted afterwards."""
    bindir = pg_bin()
    if bindir is None:
        raise PostgresError(
            "--database postgresql: PostgreSQL's initdb not found; install it "
            "(apt-get install postgresql) or use --database sqlite"
        )
    user = cluster_user()
    # not a private temp dir of this user: the cluster may run as another one
    root = Path(tempfile.mkdtemp(prefix="fedkey-bench-pg-"))
    if user:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    c = _Cluster(bindir, root, user)
    try:
        c.start(max_connections)
        yield f"postgresql+psycopg://{ROLE}@{HOST}:{c.port}/{DATABASE}"
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)
