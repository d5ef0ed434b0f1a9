"""Where the real corpora live, and how they get there: ``fedkey data fetch nus-sms|ubuntu-irc``.

The data directory is ``$FEDKEY_DATA_DIR``, else the user's cache directory: ``$XDG_CACHE_HOME``
or ``~/.cache`` on Linux, ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows, followed
by ``fedkey/data``. It holds one folder per corpus, laid out as upstream ships it:

* ``nus-sms/smsCorpus_en_xml_2015.03.09_all.zip``: the NUS SMS Corpus (Tao Chen and Min-Yen Kan
  (2013), Creating a Live, Public Short Message Service Corpus: The NUS SMS Corpus, Language
  Resources and Evaluation 47(2):299-355); :mod:`fedkey.corpora.nus_sms` reads it.
* ``ubuntu-irc/{train,dev,test}/*.raw.txt`` and ``LICENSE-data.txt``: the raw #ubuntu logs of the
  IRC disentanglement data (Jonathan K. Kummerfeld et al. (2019), A Large-Scale Corpus for
  Conversation Disentanglement, ACL 2019; CC BY 4.0); :mod:`fedkey.corpora.ubuntu_irc` reads them.

:func:`fetch` downloads a corpus from its upstream URL, pinned to one commit, and checks its
sha256 (NUS SMS: of the zip; Ubuntu IRC: of the 173 logs concatenated in sorted path order, since
the GitHub archive they come in is not byte-stable) before anything goes into place: a download
that fails or does not match leaves nothing behind. The IRC archive is read before its logs'
checksum can be known, so that read is bounded (IRC_MAX_MEMBERS, IRC_MAX_BYTES, IRC_MAX_KEPT).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SOURCES",
    "ChecksumError",
    "MissingCorpus",
    "Source",
    "corpus_path",
    "data_dir",
    "fetch",
    "is_present",
]

#: Called as a download proceeds: (bytes just received, the total when the server says it).
Progress = Callable[[int, int | None], None]


@dataclass(frozen=True)
class Source:
    """A corpus's upstream: where to download it and the sha256 that proves it is the one."""

    name: str
    url: str
    sha256: str
    checked: str  # what the sha256 is of
    license: str


_IRC_COMMIT = "82ed04f9627a45d0d6f2ec3c8683c88eb408a0d5"
SOURCES: dict[str, Source] = {
    "nus-sms": Source(
        "nus-sms",
        "https://github.com/WING-NUS/nus-sms-corpus/raw/d770d9ed3d455693be9cd9317220da9b0542798c/"
        "smsCorpus_en_xml_2015.03.09_all.zip",
        "bf73d77fce35c703dab21826cd2c1698205358c2c25b2d43da1f08671b825bdc",
        "the zip",
        "none stated; cite Chen and Kan (2013)",
    ),
    "ubuntu-irc": Source(
        "ubuntu-irc",
        f"https://github.com/jkkummerfeld/irc-disentanglement/archive/{_IRC_COMMIT}.tar.gz",
        "a88580672f26d4a4a0046bacce7fe1876d6cb630843888096cfb0b15a05fb069",
        "the data/{dev,test,train}/*.raw.txt logs concatenated in sorted path order",
        "CC BY 4.0; cite Kummerfeld et al. (2019)",
    ),
}

_NUS_ZIP = "smsCorpus_en_xml_2015.03.09_all.zip"
# The members of the GitHub archive that are kept: <repo>-<commit>/data/<split>/<log>, the license.
_IRC_KEPT = re.compile(r"[^/]+/data/((?:train|dev|test)/[^/]+\.raw\.txt|LICENSE-data\.txt)")


class MissingCorpus(FileNotFoundError):
    """A named corpus that is not in the data directory."""


class ChecksumError(ValueError):
    """A download that is not the corpus it should be."""


def data_dir() -> Path:
    """``$FEDKEY_DATA_DIR``, else ``<the user's cache directory>/fedkey/data``."""
    if env := os.environ.get("FEDKEY_DATA_DIR"):
        return Path(env).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fedkey" / "data"


def is_present(name: str, root: Path) -> bool:
    """Whether corpus ``name`` is complete in ``root`` (what its loader needs is there)."""
    folder = root / name
    if name == "nus-sms":
        return (folder / _NUS_ZIP).is_file()
    return (folder / "train").is_dir() and any((folder / "train").glob("*.raw.txt"))


def corpus_path(name: str, root: Path | None = None) -> Path:
    """The folder of corpus ``name`` in the data directory; :class:`MissingCorpus` (one line,
    saying what to do) when it is not there."""
    root = data_dir() if root is None else root
    if not is_present(name, root):
        raise MissingCorpus(
            f"{name} is not in {root}: run `fedkey data fetch {name}` or set FEDKEY_DATA_DIR"
        )
    return root / name


def _download(url: str, into: Path, progress: Progress | None) -> str:
    """Stream ``url`` into the file ``into``; -> the sha256 of what came."""
    digest = hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "fedkey"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer, into.open("wb") as out:
            length = answer.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            while chunk := answer.read(1 << 16):
                out.write(chunk)
                digest.update(chunk)
                if progress is not None:
                    progress(len(chunk), total)
    except urllib.error.HTTPError as e:
        raise OSError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise OSError(f"download of {url} failed: {reason}") from None
    return digest.hexdigest()


def _check(source: Source, url: str, expected: str, got: str) -> None:
    if got != expected.lower():
        raise ChecksumError(
            f"{source.name}: sha256 of {source.checked} is {got}, expected {expected}, "
            f"from {url}; nothing was written"
        )


#: What reading the IRC archive may cost before the logs' checksum can be known (the GitHub
#: archive is not byte-stable, so its own bytes have none): its members, the bytes they declare,
#: the bytes kept (the logs are 19 MB). Past any, the archive is refused and nothing written.
IRC_MAX_MEMBERS = 100_000
IRC_MAX_BYTES = 4 << 30
IRC_MAX_KEPT = 256 << 20


def _unpack_irc(archive: Path, into: Path) -> str:
    """The logs and the license of the GitHub archive into ``into``, within the IRC_MAX_* bounds
    (ChecksumError past one); -> the logs' sha256."""
    members, declared, kept_bytes = 0, 0, 0
    with tarfile.open(archive) as tar:
        for member in tar:
            members, declared = members + 1, declared + member.size
            kept = _IRC_KEPT.fullmatch(member.name)
            if kept is not None and member.isfile():
                kept_bytes += member.size
            if members > IRC_MAX_MEMBERS or declared > IRC_MAX_BYTES or kept_bytes > IRC_MAX_KEPT:
                raise ChecksumError(
                    f"ubuntu-irc: {archive.name} is larger than the upstream archive "
                    f"({members} members, {declared} bytes read so far); nothing was written"
                )
            if kept is None or not member.isfile():
                continue
            target = into / kept.group(1)  # no "..": the pattern allows none
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            if source is not None:
                with source, target.open("wb") as out:
                    shutil.copyfileobj(source, out)
    digest = hashlib.sha256()
    for log in sorted(into.glob("*/*.raw.txt"), key=lambda p: p.relative_to(into).as_posix()):
        digest.update(log.read_bytes())
    return digest.hexdigest()


def fetch(
    name: str,
    root: Path | None = None,
    *,
    url: str | None = None,
    sha256: str | None = None,
    progress: Progress | None = None,
    force: bool = False,
) -> tuple[Path, bool]:
    """Download corpus ``name`` into the data directory ``root`` (default :func:`data_dir`) and
    check it; ``url`` and ``sha256`` replace the upstream's (a mirror, a test). -> (its folder,
    whether anything was downloaded: False when it was there already and not ``force``).

    Everything is written beside the target first and moved into place only once the checksum
    matches: a failed or wrong download raises (OSError, :class:`ChecksumError`) and leaves the
    data directory as it was."""
    if name not in SOURCES:
        raise ValueError(f"unknown corpus {name!r}; fedkey fetches {', '.join(SOURCES)}")
    source = SOURCES[name]
    root = data_dir() if root is None else root
    target = root / name
    if is_present(name, root) and not force:
        return target, False
    if target.exists() and not force:
        raise FileExistsError(
            f"{target} exists but does not hold {name}; move it away (or pass --force)"
        )
    url, expected = url or source.url, sha256 or source.sha256
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        download = work / "download"
        got = _download(url, download, progress)
        staged = work / name
        staged.mkdir()
        if name == "nus-sms":
            _check(source, url, expected, got)
            download.rename(staged / _NUS_ZIP)
        else:
            _check(source, url, expected, _unpack_irc(download, staged))
        if target.exists():  # --force: the old copy goes only once the new one is sound
            shutil.rmtree(target)
        staged.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target, True
