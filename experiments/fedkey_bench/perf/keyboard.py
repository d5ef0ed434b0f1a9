"""Per-keystroke latency of the web keyboard; prints JSON.

    python -m fedkey_bench.perf.keyboard --model runs/x/model.onnx            # WS + in-browser wasm
    python -m fedkey_bench.perf.keyboard --checkpoint runs/demo/checkpoints/round_0008.safetensors
    python -m fedkey_bench.perf.keyboard --model m.onnx --no-browser --keystrokes 2000

WS: the app runs in its own process (uvicorn, loopback); a client types the demo corpus's test
sentences character by character (each sentence from an empty text box, then a space) and
times each {"text"} -> {"suggestions"} round trip: p50/p90/p99/max over `--keystrokes` after a
warm-up. Wasm: chromium (Playwright, /usr/bin/chromium) opens the page in browser mode, types
the same sentences with real key events, and reads `window.fedkeyTimings`: the time from a
keystroke's text to its suggestions, for every keystroke and for those that ran the model (a
word completed); inside a word no model call is made. It also times the WS round trip from
inside chromium (`server_ws_from_chromium`), which adds the browser's own network stack.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedkey.testing import browser as browser_support
from fedkey_bench.common.checkout import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def summary(ms: list[float]) -> dict:
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 4),
        "p90_ms": round(percentile(ms, 90), 4),
        "p99_ms": round(percentile(ms, 99), 4),
        "max_ms": round(max(ms), 4) if ms else None,
        "mean_ms": round(statistics.fmean(ms), 4) if ms else None,
    }


def keystroke_texts(sentences: list[str], n: int) -> list[str]:
    """The text box after each of `n` keystrokes: sentence after sentence, typed from empty."""
    out: list[str] = []
    while len(out) < n:
        for s in sentences:
            typed = s + " "
            out.extend(typed[: i + 1] for i in range(len(typed)))
            if len(out) >= n:
                break
    return out[:n]


def start_server(model: Path, port: int, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fedkey.keyboard_web.app", str(model), "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "FEDKEY_LOG_LEVEL": "warning", **(env or {})},
    )
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the keyboard server exited with {proc.returncode}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/api/info", timeout=1.0)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the keyboard server did not start in 60 s")


def bench_ws(port: int, texts: list[str], warmup: int) -> dict:
    from websockets.sync.client import connect

    times: list[float] = []
    rounds = set()
    with connect(f"ws://127.0.0.1:{port}/ws/suggest", compression=None) as ws:
        for i, text in enumerate(texts[:warmup] + texts):
            msg = json.dumps({"text": text})
            t0 = time.perf_counter()
            ws.send(msg)
            reply = json.loads(ws.recv())
            dt = (time.perf_counter() - t0) * 1e3
            if "error" in reply:
                raise RuntimeError(f"the server answered an error: {reply['error']}")
            rounds.add(reply["round"])
            if i >= warmup:
                times.append(dt)
    return {**summary(times), "round": sorted(rounds, key=str)}


def bench_wasm(port: int, sentences: list[str], keystrokes: int) -> dict:
    from playwright.sync_api import sync_playwright

    chromium, chromium_args = browser_support.CHROMIUM, browser_support.CHROMIUM_ARGS
    if not chromium.exists():
        return {"skipped": f"{chromium} not found"}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), args=chromium_args)
        try:
            page = browser.new_page(viewport={"width": 390, "height": 844})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_function("window.fedkey && window.fedkey.info !== null", timeout=20_000)
            info = page.evaluate("window.fedkey.info")
            if not info["browser_mode"]["available"]:
                return {"skipped": info["browser_mode"]["reason"]}
            page.select_option('[data-testid="mode"]', "browser")
            page.wait_for_function("window.fedkey.browserReady === true", timeout=60_000)
            load_ms = page.evaluate("window.fedkey.browserLoadMs")
            ws_in_page = page.evaluate(WS_FROM_PAGE, keystroke_texts(sentences, keystrokes))
            box = page.get_by_test_id("input")
            box.focus()
            typed = 0
            warm = True
            for s in sentences * 1000:
                text = s + " "
                page.keyboard.type(text)
                typed += len(text)
                if warm and typed >= 50:  # warm-up: the first calls compile and allocate
                    page.wait_for_timeout(100)
                    page.evaluate(
                        "() => { for (const k of Object.keys(window.fedkeyTimings))"
                        " window.fedkeyTimings[k].length = 0; }"
                    )
                    warm, typed = False, 0
                # Keep the box short: clear it between sentences, like the WS bench.
                box.fill("")
                if not warm and typed >= keystrokes:
                    break
            page.wait_for_timeout(200)
            t = page.evaluate("window.fedkeyTimings")
            if errors:
                raise RuntimeError(f"page errors: {errors}")
            return {
                "keystrokes": typed,
                "computed": len(t["browser"]),
                "median_ms": round(statistics.median(t["browser"]), 4) if t["browser"] else None,
                "all": summary(t["browser"]),
                "with_model_call": summary(t["browserModel"]),
                "model_load_ms": round(load_ms, 1),
                # The same keystrokes sent to /ws/suggest from inside the page (server mode's
                # network cost as chromium sees it, without rendering).
                "server_ws_from_chromium": summary(ws_in_page[20:]),
                "chromium": browser.version,
            }
        finally:
            browser.close()


WS_FROM_PAGE = """async (texts) => {
  const ws = new WebSocket(`ws://${location.host}/ws/suggest`);
  await new Promise((resolve) => (ws.onopen = resolve));
  const out = [];
  for (const text of texts) {
    const reply = new Promise((resolve) => (ws.onmessage = resolve));
    const t0 = performance.now();
    ws.send(JSON.stringify({ text }));
    await reply;
    out.push(performance.now() - t0);
  }
  ws.close();
  return out;
}"""


def export_to_temp(checkpoint: Path, tmp: Path) -> Path:
    from fedkey.export.onnx_export import (
        export_checkpoint,  # torch: the bench only, never the server
    )

    out = tmp / "model.onnx"
    export_checkpoint(checkpoint, out)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m fedkey_bench.perf.keyboard", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="an exported model.onnx (model.json beside it)")
    src.add_argument("--checkpoint", type=Path, help="a checkpoint to export first (needs torch)")
    p.add_argument("--data", default="demo", help="corpus whose test sentences are typed")
    p.add_argument("--keystrokes", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--browser-keystrokes", type=int, default=300)
    p.add_argument("--no-browser", action="store_true", help="skip the in-browser (wasm) part")
    a = p.parse_args(argv)

    from fedkey.corpora.loaders import load_corpus

    sentences = load_corpus(a.data).test
    with tempfile.TemporaryDirectory(prefix="fedkey-bench-") as tmp:
        model = a.model if a.model else export_to_temp(a.checkpoint, Path(tmp))
        meta = json.loads(model.with_suffix(".json").read_text())
        port = free_port()
        server = start_server(model, port)
        try:
            result = {
                "model": str(model),
                "model_config": meta["model"],
                "round": meta.get("round"),
                "int8": meta.get("int8"),
                "data": a.data,
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                },
                "ws": bench_ws(port, keystroke_texts(sentences, a.keystrokes), a.warmup),
            }
            if not a.no_browser:
                result["wasm"] = bench_wasm(port, sentences, a.browser_keystrokes)
        finally:
            server.terminate()
            server.wait(10)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
