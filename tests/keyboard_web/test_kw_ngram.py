"""The n-gram an export mixes in: it changes the bar as the mixture says, a session still costs
one model step per word and agrees with a fresh computation, a broken n-gram file leaves the
model suggesting alone (the reason in /api/info), and browser mode can fetch the n-gram."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fedkey.keyboard_web.app import create_app
from fedkey.keyboard_web.suggest import Suggester, context_words, split_text
from fedkey.models.ngram import KneserNey
from fedkey.models.personal import DEFAULTS
from fedkey.models.tokenizers import WordTokenizer

CONTEXT = "see you "
WEIGHT = 0.5


@pytest.fixture(scope="module")
def plain(models) -> Suggester:
    return Suggester(models.word)


@pytest.fixture(scope="module")
def mixed_export(models, plain, tmp_path_factory):
    """The round-3 export again, with an n-gram that has only seen "see you <the model's third
    suggestion>" -> (the export, that word)."""
    from fedkey.export.onnx_export import export_checkpoint

    third = plain.suggest_fresh(CONTEXT)["suggestions"][2]
    tok = WordTokenizer(models.vocab)
    lm = KneserNey(tok, order=3).fit(tok.encode(f"see you {third}") for _ in range(20))
    root = tmp_path_factory.mktemp("mixed")
    ngram = lm.save(root / "kn.safetensors", corpus=f"'see you {third}' x 20")
    out = root / "export" / "model.onnx"
    export_checkpoint(models.checkpoint, out, ngram=ngram, ngram_weight=WEIGHT)
    return out, third


@pytest.fixture(scope="module")
def mixed(mixed_export) -> Suggester:
    return Suggester(mixed_export[0])


def broken_copy(mixed_export, tmp_path, damage) -> Suggester:
    """A copy of the mixed export whose n-gram file `damage(path)` has broken."""
    src = mixed_export[0].parent
    dst = tmp_path / "export"
    shutil.copytree(src, dst)
    damage(dst / "model.ngram.safetensors")
    return Suggester(dst / "model.onnx")


def test_the_mixture_puts_the_models_third_suggestion_first(mixed, plain, mixed_export):
    _, third = mixed_export
    assert plain.suggest_fresh(CONTEXT)["suggestions"][2] == third  # the model alone: third
    got = mixed.suggest_fresh(CONTEXT)["suggestions"]
    assert got[0] == third and len(got) == 3
    # The bar ranks p = 0.5 * p_model + 0.5 * p_ngram, and the stack stores it.
    session = mixed.new_session()
    session.suggest(CONTEXT)
    ids = mixed.encode(["see", "you"])
    lp, _ = mixed.run(ids, mixed.start().state)
    p_ngram = mixed.ngram.lm.distribution([mixed.bos_id, *ids])
    expected = np.log(WEIGHT * np.exp(lp[-1].astype(np.float64)) + (1 - WEIGHT) * p_ngram)
    assert np.allclose(session.stack[-1].logprobs, expected, rtol=0, atol=1e-5)
    assert np.exp(session.stack[-1].logprobs.astype(np.float64)).sum() == pytest.approx(1, abs=1e-4)


def test_a_session_with_the_ngram_equals_a_fresh_computation_and_steps_once_per_word(mixed):
    text = "see you at the library tomorrow, ok? thanks so much. see you t"
    session = mixed.new_session()
    for i in range(1, len(text) + 1):
        typed = text[:i]
        before = mixed.calls
        got = session.suggest(typed)
        completed = context_words(split_text(typed)[0]) != context_words(split_text(typed[:-1])[0])
        if not completed:
            assert mixed.calls == before, f"{typed!r}: a keystroke inside a word ran the model"
        assert got == mixed.suggest_fresh(typed), typed


def test_the_bar_never_shows_the_word_typed_in_full_with_the_ngram(mixed, mixed_export):
    _, third = mixed_export
    got = mixed.new_session().suggest(CONTEXT + third)["suggestions"]
    assert got and third not in got  # the n-gram's favourite, typed in full, saves nothing
    assert all(w.startswith(third) and len(w) > len(third) for w in got)


def test_info_and_browser_mode_get_the_ngram(mixed_export):
    out, _ = mixed_export
    meta = json.loads(out.with_suffix(".json").read_text())
    with TestClient(create_app(out)) as client:
        info = client.get("/api/info").json()
        ngram = info["ngram"]
        assert ngram["active"] is True and ngram["error"] is None
        assert (ngram["order"], ngram["weight"], ngram["weight_source"]) == (3, WEIGHT, "argument")
        assert ngram["corpus"].startswith("'see you ")
        r = client.get("/ngram.safetensors")
        assert r.status_code == 200 and r.headers["x-fedkey-round"] == "3"
        assert ngram["bytes"] == len(r.content)
        assert hashlib.sha256(r.content).hexdigest() == meta["ngram"]["sha256"]
        assert info["personal"] == DEFAULTS == meta["personal"]


def test_without_an_ngram_nothing_is_mixed_and_browser_mode_is_told(models, plain):
    assert plain.info()["ngram"] is None and plain.ngram.lm is None
    assert plain.info()["personal"] == DEFAULTS
    with TestClient(create_app(models.word)) as client:
        r = client.get("/ngram.safetensors")
        assert r.status_code == 404 and "no n-gram" in r.json()["detail"]


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _other_vocabulary(path):
    """A valid n-gram of another vocabulary, with the export's sha256 updated to match it."""
    tok = WordTokenizer.build(["a b c", "b c d"])
    path.write_bytes(KneserNey(tok).fit(tok.encode(s) for s in ["a b c"]).to_bytes("other"))
    meta_path = path.parent / "model.json"
    meta = json.loads(meta_path.read_text())
    meta["ngram"]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_flip_a_byte, "sha256"),
        (lambda p: p.unlink(), "cannot be read"),
        (_other_vocabulary, "another vocabulary"),
    ],
)
def test_a_broken_ngram_leaves_the_model_suggesting_alone(
    mixed_export, plain, tmp_path, damage, reason
):
    s = broken_copy(mixed_export, tmp_path, damage)
    info = s.info()["ngram"]
    assert info["active"] is False and reason in info["error"] and "model alone" in info["error"]
    for text in (CONTEXT, CONTEXT + "t", "how are "):
        assert s.new_session().suggest(text) == plain.suggest_fresh(text), text
    with TestClient(create_app(s.path)) as client:
        info = client.get("/api/info")
        assert info.status_code == 200 and reason in info.json()["ngram"]["error"]
        assert client.get("/ngram.safetensors").status_code == 404
        with client.websocket_connect("/ws/suggest") as ws:
            ws.send_json({"text": CONTEXT})
            assert ws.receive_json()["suggestions"] == plain.suggest_fresh(CONTEXT)["suggestions"]


def test_serving_with_an_ngram_never_imports_torch(mixed_export):
    code = (
        "import sys; from fedkey.keyboard_web.suggest import Suggester; "
        f"s = Suggester({str(mixed_export[0])!r}); s.new_session().suggest('see you t'); "
        "assert s.info()['ngram']['active'], s.info()['ngram']; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True
    )
