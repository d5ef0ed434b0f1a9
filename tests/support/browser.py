"""The browser the keyboard's browser tests drive (Playwright): Debian's chromium, headless and
quiet (this machine's closed network refuses its background calls)."""

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
