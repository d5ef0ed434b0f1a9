"""The browser the keyboard's browser tests drive (Playwright): Debian's chromium, headless and
quiet (this machine's closed network refuses its background calls)."""

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def browser_mode_marks() -> list[pytest.MarkDecorator]:
    """The marks of a test that drives the page in browser mode: slow, and skipped without
    Chromium or without onnxruntime-web (keyboard_web/node_modules)."""
    from fedkey.keyboard_web.app import ORT_DIST

    return [
        pytest.mark.slow,
        pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed"),
        pytest.mark.skipif(
            not (ORT_DIST / "ort.wasm.min.js").exists(),
            reason="browser mode needs onnxruntime-web: run `npm ci --prefix keyboard_web`",
        ),
    ]
