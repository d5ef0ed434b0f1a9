"""The wheel: what `pip wheel .` builds installs one top-level package, `fedkey`, holding the
keyboard's page and the license, and not the research harness nor the tests' helpers; installed into
a fresh virtual environment, `python -m fedkey` answers and its `fedkey keyboard` serves the page.

The wheel is built from a copy of the source tree (the files git tracks or would track), so a
stale build/ or egg-info in the checkout can neither add to it nor be left behind by it. The fresh
environment gets the dependencies from the dev venv through a .pth file naming the dev venv's
site-packages: a plain path line, so the dev venv's own .pth files (among them the editable
install's finder) are not run and the source tree stays out of reach; the test checks that.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STATIC = ("index.html", "app.js", "suggest.js", "ngram.js", "personal.js", "panel.js", "style.css")
TITLE = "<title>fedkey"
WHERE = (
    "import importlib.util, fedkey.keyboard_web; "
    "print(fedkey.keyboard_web.__file__); print(importlib.util.find_spec('fedkey.cli').origin)"
)


def _source_copy(dest: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_symlink():  # fedkey/server -> ../server: the namespace's links, kept as links
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).symlink_to(os.readlink(src))
        elif src.is_file():  # a tracked file deleted in the work tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("VIRTUAL_ENV", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = _source_copy(tmp_path_factory.mktemp("src"))
    dist = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", str(dist)],
        cwd=src,
    )
    (built,) = dist.glob("fedkey-*.whl")
    return built


def test_the_wheel_installs_one_package_with_the_page_and_the_license(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = z.read(metadata).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"fedkey"}, f"the wheel adds more than fedkey to site-packages: {sorted(tops)}"
    assert "fedkey/federation/privacy/blt_params.json" in names
    # --init base and --ngram base: the shipped base model and its 3-gram
    assert {
        "fedkey/models/shipped/base.safetensors",
        "fedkey/models/shipped/ngram.safetensors",
    } <= set(names)
    assert not [n for n in names if "__pycache__" in n or n.startswith("fedkey/testing/")]
    for f in STATIC:
        path = f"fedkey/keyboard_web/static/{f}"
        assert path in names, f"{path} not in the wheel"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "License-Expression: Apache-2.0" in meta
    assert "License-File: LICENSE" in meta
    harness = [n for n in names if n.startswith(("fedkey_bench/", "experiments/"))]
    assert not harness, f"the research harness is in the wheel: {harness[:5]}"


def _tiny_model(dest: Path) -> Path:
    """An untrained GRU on a few words, exported to ONNX (torch from the dev venv)."""
    import torch

    from fedkey.export.onnx_export import export_checkpoint
    from fedkey.models.checkpoint import build_model, model_state, save_checkpoint
    from fedkey.models.config import ModelConfig
    from fedkey.models.tokenizers import WordTokenizer

    tok = WordTokenizer.build(["see you soon", "see you at the station", "thank you so much"])
    cfg = ModelConfig(vocab_size=tok.vocab_size, cell="gru", emb_size=8, hidden_size=8)
    torch.manual_seed(0)
    ckpt = save_checkpoint(
        dest / "tiny.safetensors",
        model_state(build_model(cfg)),
        cfg,
        tok,
        round_idx=1,
        strategy="fedavg",
    )
    out = dest / "model.onnx"
    export_checkpoint(ckpt, out)
    return out


def test_the_installed_keyboard_serves_its_page(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)]
    )
    site = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    (site / "dev_venv_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    away = tmp_path / "elsewhere"  # a working directory outside the source tree
    away.mkdir()
    env = _clean_env()
    where = _run(  # where the packages would be imported from (cli found, not run)
        [str(py), "-c", WHERE],
        cwd=away,
        env=env,
    ).stdout.split()
    for f in where:
        assert Path(f).resolve().is_relative_to(venv.resolve()), f"imported from {f}, not the wheel"
    usage = _run([str(py), "-m", "fedkey", "--help"], cwd=away, env=env).stdout
    assert "simulate" in usage and "keyboard" in usage

    model = _tiny_model(tmp_path)
    port = _free_port()
    log = tmp_path / "keyboard.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "fedkey"), "keyboard", "--model", str(model), "--port", str(port)],
            cwd=away,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 45
        status, page = 0, ""
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"fedkey keyboard exited:\n{log.read_text()}"
            try:
                status, page = _get(url + "/")
                break
            except OSError:  # not listening yet
                time.sleep(0.2)
        assert status == 200, f"GET / -> {status}\n{log.read_text()}"
        assert TITLE in page
        for f in STATIC[1:]:  # what the page loads
            assert f'"/static/{f}"' in page
            assert _get(f"{url}/static/{f}")[0] == 200, f"GET /static/{f}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
