"""The page's privacy block in chromium on a phone: epsilon so far against the budget at its
delta, rho and the mechanism, the noise, the bounding; after a hot reload to a run without DP it
says so, and to a DP-FTRL run with adaptive clipping it names the tree and its b."""

from __future__ import annotations

import re

import pytest

from fedkey.keyboard_web.app import create_app
from fedkey.testing.browser import CHROMIUM
from fedkey.testing.keyboard import ThreadServer, save_round
from tests.keyboard_web.test_kw_privacy import CLIP, engine_round

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed"),
]
PHONE = {"width": 390, "height": 844}
SMALL = {"width": 360, "height": 640}
SCREENSHOT = "/tmp/keyboard-privacy.png"


def test_panel_shows_epsilon_budget_and_bounding_then_no_dp(browser, models, tmp_path):
    from playwright.sync_api import expect

    watch = tmp_path / "watch"
    row, server = engine_round()
    save_round(models, row["round"], watch, metrics=row, server=server)
    app = create_app(None, watch_dir=watch, poll_seconds=0.2)
    with ThreadServer(app) as srv:
        context = browser.new_context(
            viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True
        )
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(srv.url + "/")

        privacy = page.get_by_test_id("privacy")
        expect(privacy).to_have_text(
            re.compile(r"^epsilon [\d.]+ of budget 8 \(delta 1e-5\) · rho [\d.]+ · gaussian$")
        )
        words = privacy.text_content().split()
        assert float(words[1]) == pytest.approx(row["epsilon"], rel=5e-3)  # three significant
        assert float(words[words.index("rho") + 1]) == pytest.approx(row["rho"], rel=5e-3)
        expect(page.get_by_test_id("privacy-detail")).to_have_text(
            "noise multiplier 1.1 · fixed-size cohorts · 3 noised rounds"
        )
        # Under DP no exact count (fedkey.federation.metrics_row.public_info), even if an export had one.
        expect(page.get_by_test_id("bounding")).to_have_text("adaptive clip, S = 0.84")
        expect(page.get_by_test_id("bounding-detail")).to_have_text("attention ≤ 0.23")
        expect(page.get_by_test_id("strategy")).to_have_text("fedatt")
        # Readable on a phone: nothing wider than the screen, the keyboard still on it.
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        box = page.locator(".privacy-card").bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
        keys = page.locator(".keyboard").bounding_box()
        assert keys is not None and keys["y"] + keys["height"] <= PHONE["height"] + 1
        page.screenshot(path=SCREENSHOT)

        # A short phone (360x640): the main lines stay, the keyboard still fits on the screen.
        small = browser.new_context(viewport=SMALL, is_mobile=True, has_touch=True)
        short = small.new_page()
        short.goto(srv.url + "/")
        expect(short.get_by_test_id("privacy")).to_have_text(privacy.text_content())
        expect(short.get_by_test_id("privacy-detail")).to_be_hidden()
        kb = short.locator(".keyboard").bounding_box()
        assert kb is not None and kb["y"] + kb["height"] <= SMALL["height"] + 1
        assert short.evaluate("document.documentElement.scrollWidth") <= SMALL["width"]
        small.close()

        off = {"mode": "off", "median_norm": 0.42, "max_norm": 1.9}  # as --bound off reports it
        plain, plain_server = engine_round(steps=4, noise_multiplier=None, clip=off)
        save_round(models, 4, watch, metrics=plain, server=plain_server)  # hot reload
        expect(page.get_by_test_id("round")).to_have_text("4")
        expect(privacy).to_have_text("no differential privacy (epsilon: none)")
        expect(page.get_by_test_id("privacy-detail")).to_be_hidden()
        expect(page.get_by_test_id("bounding")).to_have_text("none (--bound off)")
        expect(page.get_by_test_id("bounding-detail")).to_be_hidden()

        tree, tree_server = engine_round(steps=5, clip={**CLIP, "mode": "dp"}, tree=True)
        save_round(models, 5, watch, metrics=tree, server=tree_server)  # DP-FTRL, adaptive clip
        expect(page.get_by_test_id("round")).to_have_text("5")
        expect(privacy).to_have_text(
            re.compile(
                r"^epsilon [\d.]+ of budget 8 \(delta 2\.94e-3\) · rho [\d.]+ · tree, b = 10$"
            )
        )
        words = privacy.text_content().split()
        assert float(words[words.index("rho") + 1]) == pytest.approx(tree["rho"], rel=5e-3)
        expect(page.get_by_test_id("privacy-detail")).to_have_text(
            "DP-FTRL tree aggregation · noise multiplier 1.2 · 5 noised rounds"
        )
        expect(page.get_by_test_id("bounding")).to_have_text(
            "DP clip (adaptive, quantile 0.5), S = 0.84"
        )
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        page.screenshot(path=SCREENSHOT.replace(".png", "-tree.png"))

        # DP-FTRL with BLT noise: the same accounting fields, the mechanism named as such
        blt = {**tree, "info": {**tree["info"], "dp": {**tree["info"]["dp"], "mechanism": "blt"}}}
        save_round(models, 6, watch, metrics={**blt, "round": 6}, server=tree_server)
        expect(page.get_by_test_id("round")).to_have_text("6")
        expect(privacy).to_have_text(re.compile(r" · blt, b = 10$"))
        expect(page.get_by_test_id("privacy-detail")).to_have_text(
            re.compile(r"^DP-FTRL BLT matrix factorization · noise multiplier 1.2")
        )
        context.close()
        assert not errors, errors
