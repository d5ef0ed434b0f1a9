"""Browser mode with the export's n-gram, in chromium: the page fetches /ngram.safetensors (the
file model.json names), parses it itself and ranks with the mixture, so its bar is the server's.
With the mixture weight 0 (the n-gram alone) both sides compute the same float64 numbers, so the
bars must agree exactly; a file the server does not use leaves the model alone, and says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedkey.keyboard_web.app import create_app
from fedkey.keyboard_web.suggest import Suggester
from fedkey.testing.browser import browser_mode_marks
from fedkey.testing.keyboard import ThreadServer

pytestmark = browser_mode_marks()
PHONE = {"width": 390, "height": 844}
TEXTS = ["see you ", "see you t", "i will call you ", "the meeting is at th", "ok . wh"]


@pytest.fixture(scope="module")
def ngram_export(models, tmp_path_factory) -> Path:
    """The round-3 model exported with a trigram of the demo corpus, weight 0 (n-gram alone)."""
    from fedkey.corpora.loaders import load_corpus
    from fedkey.export.onnx_export import export_checkpoint
    from fedkey.models.ngram import KneserNey
    from fedkey.models.tokenizers import WordTokenizer

    root = tmp_path_factory.mktemp("kw-ngram")
    tok = WordTokenizer(models.vocab)
    train = load_corpus("demo").train[:3000]
    lm = KneserNey(tok, order=3).fit(tok.encode(s) for s in train)
    path = lm.save(root / "demo.ngram.safetensors", "demo")
    out = root / "export" / "model.onnx"
    export_checkpoint(models.checkpoint, out, ngram=path, ngram_weight=0.0)
    return out


def bar_of(page, text: str) -> list[str]:
    """Type `text` into an empty box; the bar once it answers for it."""
    box = page.get_by_test_id("input")
    box.fill("")
    page.keyboard.type(text)
    page.wait_for_function("([t]) => window.fedkey.suggestedFor === t", arg=[text])
    words: list[str] = page.evaluate("window.fedkey.suggestions")
    return words


def test_browser_mode_ranks_with_the_exports_ngram_as_the_server(browser, ngram_export, models):
    server_side = Suggester(ngram_export)
    assert server_side.ngram.lm is not None and server_side.ngram.weight == 0.0
    alone = Suggester(models.word)
    expected = {t: server_side.suggest_fresh(t)["suggestions"] for t in TEXTS}
    assert any(expected[t] != alone.suggest_fresh(t)["suggestions"] for t in TEXTS)

    with ThreadServer(create_app(ngram_export)) as srv:
        context = browser.new_context(viewport=PHONE)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        urls: list[str] = []
        page.on("request", lambda r: urls.append(r.url))
        page.goto(srv.url + "/")
        page.select_option('[data-testid="mode"]', "browser")
        page.wait_for_function("window.fedkey.browserReady === true", timeout=30_000)
        assert srv.url + "/ngram.safetensors" in urls
        status = page.get_by_test_id("status").text_content() or ""
        assert status.startswith("model and n-gram run in this browser"), status
        for text in TEXTS:
            assert bar_of(page, text) == expected[text], text
        context.close()
        assert not errors, errors


def test_an_ngram_the_server_does_not_use_leaves_the_model_alone(browser, ngram_export, tmp_path):
    """A damaged n-gram file: the server suggests with the model alone and so does the page,
    saying why."""
    d = tmp_path / "export"
    shutil.copytree(ngram_export.parent, d)
    ngram = d / "model.ngram.safetensors"
    ngram.write_bytes(ngram.read_bytes()[:-8] + b"\0" * 8)
    assert json.loads((d / "model.json").read_text())["ngram"]["file"] == ngram.name
    server_side = Suggester(d / "model.onnx")
    assert server_side.ngram.lm is None and server_side.ngram.error

    with ThreadServer(create_app(d / "model.onnx")) as srv:
        page = browser.new_page(viewport=PHONE)
        page.goto(srv.url + "/")
        page.select_option('[data-testid="mode"]', "browser")
        page.wait_for_function("window.fedkey.browserReady === true", timeout=30_000)
        status = page.get_by_test_id("status").text_content() or ""
        assert status.startswith("model runs in this browser (wasm), alone:"), status
        assert "sha256" in status
        page.keyboard.type("see you ")
        page.wait_for_function("window.fedkey.suggestions.length === 3")
        page.close()
