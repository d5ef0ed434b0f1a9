"""Atomic file writes: the one way fedkey replaces a file on disk.

A reader (a device downloading the model, a resumed server, a watcher of the export directory)
must see either the old file or the new one, never a half-written one, even if the process is
killed or the machine loses power in the middle. So every write goes to a temporary file in the
target's own directory (the same filesystem, so the rename is atomic), which is flushed and
fsynced, then renamed onto the target with os.replace, and then the directory is fsynced too:
the rename is an update of the directory, and without that second fsync a power cut can undo it
even though the file's bytes were safe.

    atomic_write(path, data)            the usual case: the bytes are in memory
    write_temp(directory, data) -> tmp  the two steps apart, for a caller that checks something
    publish(tmp, path)                  between writing and publishing (an upload: the round may
                                        have closed while it streamed in); on failure it removes
                                        the temporary file itself

Temporary files are named `<prefix><random><suffix>` (prefix ".tmp-" by default), so a caller can
find and remove the leftovers of a crash with one glob.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

__all__ = ["atomic_write", "publish", "write_temp"]

_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def atomic_write(
    path: str | Path,
    data: bytes | str,
    *,
    prefix: str = ".tmp-",
    mode: int = 0o666,
) -> Path:
    """Replace `path` with `data` (str is written as UTF-8) so that a crash at any moment leaves
    either the old file whole or the new one whole, never a mixture; returns `path`.

    The temporary file is `<prefix><random><path's suffix>` in `path`'s directory; if anything
    fails it is removed and the exception propagates, with the old file untouched. `mode` is the
    new file's permission bits before the umask, as for os.open (0o600: only this user).
    """
    path = Path(path)
    tmp = write_temp(path.parent, data, prefix=prefix, suffix=path.suffix, mode=mode)
    publish(tmp, path)
    return path


def write_temp(
    directory: str | Path,
    data: bytes | str,
    *,
    prefix: str = ".tmp-",
    suffix: str = "",
    mode: int = 0o666,
) -> Path:
    """Write `data` to a new file `<prefix><random><suffix>` in `directory`, flushed and fsynced,
    and return its path; publish() then puts it in place. On failure nothing is left behind.

    The directory must be the final file's (os.replace is atomic only within one filesystem).
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = Path(directory)
    for _ in range(100):
        tmp = directory / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            fd = os.open(tmp, _FLAGS, mode)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary file name", str(directory))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def publish(tmp: str | Path, path: str | Path) -> Path:
    """Rename `tmp` (from write_temp, in `path`'s directory) onto `path` and fsync the directory,
    so the rename itself survives a power cut; returns `path`. If the rename fails, `tmp` is
    removed and the exception propagates."""
    path = Path(path)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform that cannot open a directory (Windows) cannot sync one either
        return
    try:
        os.fsync(fd)
    except OSError as e:  # a filesystem that does not sync directories: the rename is done
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)
