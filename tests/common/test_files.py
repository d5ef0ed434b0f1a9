import os
import stat
from pathlib import Path

import pytest

from fedkey.common import files
from fedkey.common.files import atomic_write, publish, write_temp


def _fail(monkeypatch, name: str) -> None:
    def failing(*args):
        raise OSError(f"os.{name} failed (test)")

    monkeypatch.setattr(files.os, name, failing)


def test_bytes_and_str_arrive_whole(tmp_path):
    target = tmp_path / "m.safetensors"
    data = bytes(range(256)) * 4096  # 1 MiB
    assert atomic_write(target, data) == target
    assert target.read_bytes() == data
    atomic_write(target, "héllo\n")  # replaces the old file; str goes as UTF-8
    assert target.read_bytes() == "héllo\n".encode()
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


@pytest.mark.parametrize("fail_at", ["write", "fsync", "replace"])
def test_a_failure_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch, fail_at):
    target = tmp_path / "metrics.jsonl"
    target.write_text("old\n")
    data: object = b"new"
    if fail_at == "write":
        data = 123  # the temp file exists, then f.write raises TypeError
    else:
        _fail(monkeypatch, fail_at)
    with pytest.raises((TypeError, OSError)):
        atomic_write(target, data)  # type: ignore[arg-type]
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_the_temp_file_is_beside_the_target_and_fsynced_before_the_rename(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    target = tmp_path / "sub" / "round_0001.safetensors"
    events: list = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        files.os,
        "fsync",
        lambda fd: (events.append(("fsync", stat.S_ISDIR(os.fstat(fd).st_mode))), real_fsync(fd)),
    )
    monkeypatch.setattr(
        files.os,
        "replace",
        lambda src, dst: (events.append(("replace", Path(src), Path(dst))), real_replace(src, dst)),
    )
    atomic_write(target, b"x")
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[0][1] is False and events[2][1] is True  # the file, then the directory
    _, src, dst = events[1]
    assert src.parent == target.parent and dst == target  # same directory: same filesystem
    assert src.name.startswith(".tmp-") and src.suffix == ".safetensors"
    assert target.read_bytes() == b"x"


def test_write_temp_then_publish(tmp_path):
    target = tmp_path / "dev1.safetensors"
    tmp = write_temp(tmp_path, b"update", prefix=".tmp-dev1-", suffix=".safetensors")
    assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-dev1-")
    assert tmp.read_bytes() == b"update" and not target.exists()  # not visible until published
    assert publish(tmp, target) == target
    assert target.read_bytes() == b"update" and not tmp.exists()


def test_publish_failure_removes_the_temp(tmp_path):
    tmp = write_temp(tmp_path, "x")
    with pytest.raises(OSError):
        publish(tmp, tmp_path / "missing_dir" / "f")
    assert list(tmp_path.iterdir()) == []


def test_mode_as_for_open(tmp_path):
    atomic_write(tmp_path / "private", b"x", mode=0o600)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600
    (tmp_path / "plain").write_bytes(b"x")  # what open() gives under this umask
    atomic_write(tmp_path / "atomic", b"x")
    assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode
