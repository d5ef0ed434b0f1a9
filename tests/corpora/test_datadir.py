"""The data directory and `fedkey data fetch` (fedkey.corpora.datadir, cli/data.py): downloads from an
HTTP server on 127.0.0.1 serving small fixture files, with the URL and checksum overridden."""

import hashlib
import io
import tarfile
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.corpora.datadir import ChecksumError, MissingCorpus, corpus_path, data_dir, fetch
from fedkey.corpora.loaders import load_corpus
from fedkey.corpora.nus_sms import ZIP_NAME
from tests.corpora.test_nus_sms import _timed, write_zip

runner = CliRunner()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """(a folder, the URL it is served at) on 127.0.0.1; the server always shut down."""
    folder = tmp_path / "served"
    folder.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _irc_archive(folder: Path) -> tuple[Path, str]:
    """A GitHub-archive-like tar.gz of two logs, the license and files that are not kept; ->
    (its path, the sha256 of the logs concatenated in sorted path order)."""
    logs = {"dev/2005-02-09_03.raw.txt": b"[09:01] <carol> hello\n",
            "train/2005-02-08.train-a.raw.txt": b"[12:18] <alice> hi\n[12:19] <bob> alice: hey\n"}  # fmt: skip
    others = {
        "LICENSE-data.txt": b"CC BY 4.0\n",
        "train/2005-02-08.train-a.annotation.txt": b"1 2 -\n",
    }
    path = folder / "irc.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {**logs, **others, "../evil.raw.txt": b"no"}.items():
            info = tarfile.TarInfo(f"irc-disentanglement-abc/data/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path, _sha(b"".join(logs[k] for k in sorted(logs)))


def test_the_data_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(tmp_path / "d"))
    assert data_dir() == tmp_path / "d"
    monkeypatch.delenv("FEDKEY_DATA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("sys.platform", "linux")
    assert data_dir() == tmp_path / "cache" / "fedkey" / "data"
    with pytest.raises(MissingCorpus, match="ubuntu-irc is not in"):
        corpus_path("ubuntu-irc")


def test_fetch_nus_sms_checks_the_zip_and_puts_it_in_place(served, tmp_path):
    folder, url = served
    zipped = write_zip(folder, _timed("a", 10) + _timed("b", 10)).read_bytes()
    root = tmp_path / "data"
    seen: list[int] = []
    where, downloaded = fetch("nus-sms", root, url=f"{url}/{ZIP_NAME}", sha256=_sha(zipped),
                              progress=lambda n, total: seen.append(n))  # fmt: skip
    assert downloaded and where == root / "nus-sms" and sum(seen) == len(zipped)
    assert (where / ZIP_NAME).read_bytes() == zipped
    assert sorted(p.name for p in root.iterdir()) == ["nus-sms"]  # no temporary left
    assert fetch("nus-sms", root, url="http://127.0.0.1:9/none")[1] is False  # there already


def test_a_wrong_checksum_writes_nothing_and_says_so_in_one_line(served, tmp_path, monkeypatch):
    folder, url = served
    write_zip(folder, _timed("a", 3))
    root = tmp_path / "data"
    with pytest.raises(ChecksumError, match="nothing was written"):
        fetch("nus-sms", root, url=f"{url}/{ZIP_NAME}", sha256="0" * 64)
    assert list(root.iterdir()) == []
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(root))
    result = runner.invoke(app, ["data", "fetch", "nus-sms", "--url", f"{url}/{ZIP_NAME}",
                                 "--sha256", "0" * 64, "--no-progress"])  # fmt: skip
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: nus-sms: sha256 of the zip is ")
    assert "expected 0000" in lines[0] and list(root.iterdir()) == []
    result = runner.invoke(app, ["data", "fetch", "nus-sms", "--url", f"{url}/absent.zip"])
    assert result.exit_code == 1 and "404" in result.output and list(root.iterdir()) == []


def test_fetch_ubuntu_irc_keeps_the_logs_and_checks_them(served, tmp_path, monkeypatch):
    folder, url = served
    _, sha = _irc_archive(folder)
    root = tmp_path / "data"
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(root))
    args = ["data", "fetch", "ubuntu-irc", "--url", f"{url}/irc.tar.gz", "--sha256"]
    result = runner.invoke(app, [*args, "f" * 64])
    assert result.exit_code == 1 and "nothing was written" in result.output
    assert list(root.iterdir()) == []
    result = runner.invoke(app, [*args, sha])
    assert result.exit_code == 0, result.output
    got = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert got == ["ubuntu-irc/LICENSE-data.txt", "ubuntu-irc/dev/2005-02-09_03.raw.txt",
                   "ubuntu-irc/train/2005-02-08.train-a.raw.txt"]  # fmt: skip
    corpus = load_corpus("ubuntu-irc")
    assert set(corpus.users) | set(corpus.unseen_users or []) == {"alice", "bob", "carol"}
    result = runner.invoke(app, ["data", "where"])
    assert "ubuntu-irc: present" in result.output and "nus-sms: absent" in result.output


def test_an_irc_archive_past_its_bounds_is_refused_before_it_is_read_whole(
    served, tmp_path, monkeypatch
):
    """The archive is parsed before the logs' checksum can be known: its logs may declare no
    more than IRC_MAX_KEPT bytes (here lowered to 10), or it is refused and nothing written."""
    folder, url = served
    _, sha = _irc_archive(folder)
    root = tmp_path / "data"
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(root))
    monkeypatch.setattr("fedkey.corpora.datadir.IRC_MAX_KEPT", 10)
    args = ["data", "fetch", "ubuntu-irc", "--url", f"{url}/irc.tar.gz", "--sha256", sha]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "larger than the upstream archive" in result.output
    assert list(root.iterdir()) == []


def test_a_command_names_the_missing_corpus_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDKEY_DATA_DIR", str(tmp_path))
    result = runner.invoke(app, ["ngram", "--data", "nus-sms", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"error: nus-sms is not in {tmp_path}: run `fedkey data fetch nus-sms` or set FEDKEY_DATA_DIR"
    )


def test_fetch_has_help():
    result = runner.invoke(app, ["data", "fetch", "--help"])
    assert result.exit_code == 0 and "--sha256" in result.output and "nus-sms" in result.output
