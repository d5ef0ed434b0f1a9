"""fedkey.runners.processes: the child processes of `fedkey demo` and `fedkey run` log to files and stop
together (terminate, then kill what ignores it), however the block that started them ends."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedkey.runners.processes import (
    ProcessError,
    ProcessGroup,
    listen_problem,
    wait_for,
    wait_healthy,
)

PY = sys.executable
SLEEPER = [PY, "-c", "import time; print('up', flush=True); time.sleep(600)"]
# Ignores SIGTERM (after saying so in its log): only a kill stops it.
STUBBORN = [
    PY,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ignoring', flush=True); time.sleep(600)",
]


def test_group_stops_every_child_on_an_exception_killing_the_stubborn(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ProcessGroup(tmp_path, env={"FEDKEY_PROBE": "42"}, grace=1.0) as group:
            a = group.start("a", SLEEPER)
            b = group.start("b", STUBBORN)
            env = group.start("env", [PY, "-c", "import os; print(os.environ['FEDKEY_PROBE'])"])
            assert wait_for(lambda: "ignoring" in group.log("b").read_text(), 30)
            assert env.wait(timeout=30) == 0
            raise RuntimeError("boom")
    assert a.returncode is not None and b.returncode == -9  # b took a SIGKILL
    assert (tmp_path / "a.log").read_text() == "up\n"
    assert (tmp_path / "env.log").read_text() == "42\n"


def test_first_exit_reports_the_child_that_stopped(tmp_path):
    with ProcessGroup(tmp_path, grace=5.0) as group:
        quick = group.start("quick", [PY, "-c", "pass"])
        done = group.start("done", [PY, "-c", "import time; time.sleep(0.5)"])
        slow = group.start("slow", SLEEPER)
        assert group.first_exit(ignore=[quick], interval=0.05) is done
        assert slow.poll() is None
    assert slow.poll() is not None


def test_wait_for_gives_up_at_the_deadline_or_when_the_process_exits():
    start = time.monotonic()
    assert not wait_for(lambda: False, timeout=0.3, interval=0.05)
    assert time.monotonic() - start >= 0.3
    proc = subprocess.Popen([PY, "-c", "pass"])
    assert not wait_for(lambda: False, timeout=60, proc=proc, interval=0.05)
    assert wait_for(lambda: True, timeout=0)


def test_wait_healthy_names_the_process_that_died():
    proc = subprocess.Popen([PY, "-c", "raise SystemExit(3)"])
    with pytest.raises(ProcessError, match="the keyboard exited with code 3 before it was ready"):
        wait_healthy("http://127.0.0.1:9", proc, name="the keyboard")


def test_listen_problem():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert listen_problem("127.0.0.1", busy.getsockname()[1]) == "Address already in use"
    assert listen_problem("127.0.0.1", 0) is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_sigterm_or_sighup_stops_the_group_as_ctrl_c_does(tmp_path, sig):
    """`kill <pid of fedkey demo>` used to end the parent at once and leave its server and
    keyboard running; now the group stops its children first."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from fedkey.runners.processes import ProcessGroup\n"
        f"with ProcessGroup(Path({str(tmp_path)!r}), grace=5.0) as group:\n"
        f"    child = group.start('sleeper', {SLEEPER!r})\n"
        "    print(child.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [PY, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]
    )
    pid = int(parent.stdout.readline())
    try:
        assert wait_for(lambda: (tmp_path / "sleeper.log").read_text() == "up\n", 30)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        assert not Path(f"/proc/{pid}").exists()  # stopped and reaped by the parent
        assert parent.returncode != -sig  # the parent ended through its handler, not the signal
    finally:
        parent.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        parent.stdout.close()
