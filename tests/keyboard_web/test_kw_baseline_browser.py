"""The panel's line comparing the served round with round 0 (the model the run started from: with
--init, the base pretrained on public chat), in chromium on a short phone: test perplexity and
the suggestion bar's top-1 (bar_top1) of both rounds, as the federation's metrics rows relayed by
GET /api/metrics score them; the mixture's (mix_*) when the served export mixes its n-gram in.
Without a round-0 row there is no such line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request

import pytest
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from fedkey.keyboard_web.app import create_app
from fedkey.testing.browser import CHROMIUM
from fedkey.testing.keyboard import ThreadServer, save_round

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed"),
]
SMALL = {"width": 360, "height": 640}

# Rounds 0..3 of a federation fine-tuning the shipped base on NUS SMS (runs/demo-tune: fedatt,
# --init base --ngram base), as its metrics.jsonl recorded them, with a field the page must not see.
ROWS = [
    {"round": r, "strategy": "fedatt", "val_ppl": v, "test_ppl": t, "top1": 0.07,
     "bar_top1": b, "mix_val_ppl": mv, "mix_test_ppl": mt, "mix_bar_top1": mb,
     "ngram_weight": 0.7, "epsilon": None, "aggregated": ["alice-pixel"]}
    for r, v, t, b, mv, mt, mb in (
        (0, 286.33, 281.96, 0.09921, 264.46, 259.23, 0.10729),
        (1, 196.78, 195.65, 0.11566, 192.10, 190.22, 0.11823),
        (2, 163.55, 162.20, 0.13032, 160.40, 159.13, 0.12860),
        (3, 142.84, 142.14, 0.14281, 141.02, 139.34, 0.14587),
    )
]  # fmt: skip


def fake_federation(rows: list[dict]) -> FastAPI:
    """What the keyboard asks of `fedkey server`: GET /v1/metrics (these rows) and WS /v1/events
    (open, quiet)."""
    app = FastAPI()

    @app.get("/v1/metrics")
    async def metrics():
        return {"rounds": rows}

    @app.websocket("/v1/events")
    async def events(ws: WebSocket):
        await ws.accept()
        try:
            while True:
                await ws.receive_text()
        except (WebSocketDisconnect, RuntimeError, asyncio.CancelledError):
            return

    return app


@pytest.fixture(scope="module")
def trigram(models, tmp_path_factory):
    """A trigram of the demo corpus on the served model's vocabulary (an export mixes it in)."""
    from fedkey.corpora.loaders import load_corpus
    from fedkey.models.ngram import KneserNey
    from fedkey.models.tokenizers import WordTokenizer

    tok = WordTokenizer(models.vocab)
    lm = KneserNey(tok, order=3).fit(tok.encode(s) for s in load_corpus("demo").train[:3000])
    return lm.save(tmp_path_factory.mktemp("kw-base") / "demo.ngram.safetensors", "demo")


def export_round_3(models, out_dir, ngram=None):
    """The trained weights as round 3, its metrics row ROWS[3] (with `ngram` mixed in)."""
    onnx = save_round(models, 3, out_dir, metrics={k: ROWS[3][k] for k in ("val_ppl", "test_ppl")})
    if ngram is not None:
        from fedkey.export.onnx_export import export_checkpoint

        ckpt = out_dir.parent / f".ckpt-{out_dir.name}-3.safetensors"
        export_checkpoint(ckpt, onnx, ngram=ngram, ngram_weight=0.7)
    return onnx


@contextlib.contextmanager
def open_page(browser, onnx, rows):
    """A 360x640 page of a keyboard serving `onnx` and following a federation with `rows`:
    (page, its errors, the keyboard's URL)."""
    with (
        ThreadServer(fake_federation(rows)) as fed,
        ThreadServer(create_app(onnx, events_url=fed.url)) as kb,
    ):
        context = browser.new_context(viewport=SMALL, is_mobile=True, has_touch=True)
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(kb.url + "/")
            yield page, errors, kb.url
        finally:
            context.close()


def assert_fits(page, lines: int = 1) -> None:
    """The line takes at most `lines` lines (12px text), and the keyboard is still on the 360x640
    screen."""
    line = page.get_by_test_id("baseline").bounding_box()
    assert line is not None and line["height"] <= 16.5 * lines, line
    assert page.evaluate("document.documentElement.scrollWidth") <= SMALL["width"]
    kb = page.locator(".keyboard").bounding_box()
    assert kb is not None and kb["y"] + kb["height"] <= SMALL["height"] + 1


def test_the_served_round_against_round_0(browser, models, tmp_path):
    from playwright.sync_api import expect

    onnx = export_round_3(models, tmp_path / "plain")
    with open_page(browser, onnx, ROWS) as (page, errors, url):
        with urllib.request.urlopen(url + "/api/metrics", timeout=10) as r:
            relayed = json.load(r)["rounds"]
        assert relayed[0] == {k: ROWS[0][k] for k in ("round", "strategy", "val_ppl", "test_ppl",
                              "top1", "bar_top1", "mix_val_ppl", "mix_test_ppl", "mix_bar_top1",
                              "epsilon")}  # fmt: skip
        line = page.get_by_test_id("baseline")
        # The export mixes in no n-gram: the model's own numbers, test perplexity and bar_top1.
        expect(line).to_have_text("vs round 0: perplexity 282 → 142, top-1 0.099 → 0.143")
        expect(line).to_be_visible()
        title = line.get_attribute("title") or ""
        assert (
            title.startswith(
                "round 0 (the initial model, before any phone trained) against round 3"
            )
            and "test perplexity" in title
        ), title
        assert "n-gram" not in title
        expect(page.get_by_test_id("round")).to_have_text("3")
        assert_fits(page)
        page.screenshot(path="/tmp/keyboard-baseline.png")
        assert not errors, errors


def test_with_the_ngram_the_line_shows_the_mixture(browser, models, trigram, tmp_path):
    from playwright.sync_api import expect

    onnx = export_round_3(models, tmp_path / "mixed", ngram=trigram)
    with open_page(browser, onnx, ROWS) as (page, errors, _):
        line = page.get_by_test_id("baseline")
        expect(line).to_have_text(
            "vs round 0 (with the n-gram): perplexity 259 → 139, top-1 0.107 → 0.146"
        )
        assert "mixed with the keyboard's n-gram" in (line.get_attribute("title") or "")
        assert_fits(page, lines=2)  # at 360 px it wraps; the keyboard stays on screen
        assert not errors, errors


def test_without_a_round_0_row_there_is_no_line(browser, models, tmp_path):
    from playwright.sync_api import expect

    onnx = export_round_3(models, tmp_path / "old")
    with open_page(browser, onnx, ROWS[1:]) as (page, errors, _):  # an old run's rows
        # The rows have arrived (the chart draws rounds 1..3, both curves), yet no line.
        expect(page.locator("#chart-source")).to_have_text("· live")
        expect(page.locator("#chart circle")).to_have_count(6)
        expect(page.get_by_test_id("served-note")).to_have_text("serving round 3")
        line = page.get_by_test_id("baseline")
        expect(line).to_be_hidden()
        assert line.text_content() == ""
        assert not errors, errors
