"""A throwaway PostgreSQL cluster: tests/server/test_postgres.py's, and that of the research
harness's `fedkey-bench load --database postgresql` cells (as fedkey.testing.postgres).

Debian's initdb and pg_ctl (the postgresql package, /usr/lib/postgresql/<version>/bin) in a
temporary directory, listening on 127.0.0.1 only on a free port, trust authentication, one fresh
database; as root (initdb refuses it) the cluster runs as the `postgres` user (or `nobody`)
through runuser. `cluster()` keeps durability on (fsync, synchronous commits): the load bench
measures the server as it would run, not a tuned test fixture. The tests start theirs with
`temp_cluster(settings=FAST)`, durability off. Either is stopped and deleted at the end.
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

from fedkey.runners.processes import free_port

ROLE = "fedkey"
DATABASE = "fedkey"
HOST = "127.0.0.1"

#: Server settings for a cluster whose data may be lost (the tests'): no fsync, no WAL waits.
FAST = ("fsync=off", "synchronous_commit=off", "full_page_writes=off", "shared_buffers=16MB")

__all__ = ["FAST", "Cluster", "PostgresError", "cluster", "temp_cluster"]


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


class Cluster:
    """A cluster in `root` run by `user` (None: this one); `port` once started."""

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

    def url(self, database: str = DATABASE) -> str:
        """The SQLAlchemy URL of `database` on this cluster, as the server's --database-url."""
        return f"postgresql+psycopg://{ROLE}@{HOST}:{self.port}/{database}"

    def start(self, max_connections: int, settings: tuple[str, ...] = ()) -> None:
        """initdb, then pg_ctl start with `settings` (postgresql.conf lines, e.g. FAST; FAST
        also skips initdb's sync), then the database DATABASE; PostgresError saying why not."""
        init = self.run(
            str(self.bindir / "initdb"),
            *("-D", str(self.data), "-U", ROLE, "--auth=trust", "-E", "UTF8", "--locale=C"),
            *(["--no-sync"] if "fsync=off" in settings else []),
        )
        if init.returncode != 0:
            raise PostgresError(f"initdb failed: {(init.stderr or init.stdout).strip()[-400:]}")
        for _ in range(3):  # the free port may be taken between the probe and the start
            self.port = free_port(HOST)
            options = (
                f"-k {shlex.quote(str(self.root))} -h {HOST} -p {self.port} "
                f"-c max_connections={max_connections}"
                + "".join(f" -c {setting}" for setting in settings)
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
def temp_cluster(max_connections: int = 100, settings: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """A started cluster in a fresh temporary directory, stopped and deleted afterwards;
    PostgresError (one line: why, what to install) when it cannot start."""
    bindir = pg_bin()
    if bindir is None:
        raise PostgresError(
            "PostgreSQL's initdb not found; install it (apt-get install postgresql)"
        )
    user = cluster_user()
    # not a private temp dir of this user: the cluster may run as another one
    root = Path(tempfile.mkdtemp(prefix="fedkey-pg-"))
    if user:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    c = Cluster(bindir, root, user)
    try:
        c.start(max_connections, settings)
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def cluster(max_connections: int = 100) -> Iterator[str]:
    """A fresh cluster for one bench cell: yields the server's `--database-url`
    (postgresql+psycopg://fedkey@127.0.0.1:PORT/fedkey); stopped and deleted afterwards."""
    if pg_bin() is None:
        raise PostgresError(
            "--database postgresql: PostgreSQL's initdb not found; install it "
            "(apt-get install postgresql) or use --database sqlite"
        )
    with temp_cluster(max_connections) as c:
        yield c.url()
