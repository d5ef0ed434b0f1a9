"""The page's personal words in chromium: in browser mode the messages sent teach the bar the
user's own words (a name outside the vocabulary included), kept in localStorage and never sent;
"clear my words" forgets them, the switch stops the learning, and server mode says where the
feature lives. Then browser mode with the export's n-gram: the page loads ngram.safetensors and
its bar follows the server's mixture."""

from __future__ import annotations

import json

import pytest

from fedkey.keyboard_web.app import create_app
from fedkey.testing.browser import browser_mode_marks
from fedkey.testing.keyboard import ThreadServer

pytestmark = browser_mode_marks()
PHONE = {"width": 390, "height": 844}
STORE = "fedkey.personal.v1"
NAME = "zorblax"


@pytest.fixture
def served(watch_dir):
    with ThreadServer(create_app(None, watch_dir=watch_dir)) as server:
        yield server


class Traffic:
    """Everything the page sends: each request's URL and body, each WebSocket frame."""

    def __init__(self, page):
        self.sent: list[str] = []
        page.on("request", lambda r: self.sent.append(f"{r.method} {r.url} {r.post_data or ''}"))
        page.on("websocket", lambda ws: ws.on("framesent", lambda p: self.sent.append(str(p))))

    def carrying(self, word: str) -> list[str]:
        return [s for s in self.sent if word in s.lower()]


def slot_words(page) -> list[str]:
    return [s.text_content() or "" for s in page.get_by_test_id("suggestion").all()]


def stored(page) -> str | None:
    got: str | None = page.evaluate(f"localStorage.getItem({json.dumps(STORE)})")
    return got


def browser_mode(page) -> None:
    page.select_option('[data-testid="mode"]', "browser")
    page.wait_for_function("window.fedkey.browserReady === true", timeout=30_000)


def type_and_wait(page, text: str) -> None:
    page.keyboard.type(text)
    page.wait_for_function(
        "([t]) => document.querySelector('[data-testid=input]').value === t", arg=[text]
    )


def test_the_bar_learns_my_words_on_this_device_only(browser, served):
    from playwright.sync_api import expect

    context = browser.new_context(viewport=PHONE, is_mobile=True, has_touch=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    traffic = Traffic(page)
    page.goto(served.url + "/")
    note = page.get_by_test_id("personal-note")
    switch = page.get_by_test_id("personal-switch")
    expect(note).to_contain_text("browser mode")  # server mode: where the feature lives
    expect(switch).to_be_disabled()

    browser_mode(page)
    expect(switch).to_be_checked()
    expect(switch).to_be_enabled()
    expect(note).to_contain_text("0 words")
    bar = page.get_by_test_id("suggestion")
    named = bar.filter(has_text=NAME)

    type_and_wait(page, "my friend zo")
    page.wait_for_function("window.fedkey.suggestions.every((w) => w.startsWith('zo'))")
    assert NAME not in slot_words(page)  # not a word of the model's vocabulary
    page.get_by_test_id("input").fill("")

    type_and_wait(page, f"my friend {NAME} is here")
    page.keyboard.press("Enter")  # sends: the text box empties
    expect(page.get_by_test_id("input")).to_have_value("")
    type_and_wait(page, f"My friend {NAME.capitalize()} is here")
    page.get_by_test_id("key-send").click()  # the on-screen send key
    expect(page.get_by_test_id("input")).to_have_value("")
    expect(note).to_contain_text("5 words")

    type_and_wait(page, "my friend zo")
    expect(named).to_have_count(1)
    named.click()  # a word outside the vocabulary is inserted like any other
    expect(page.get_by_test_id("input")).to_have_value(f"my friend {NAME} ")
    assert NAME in (stored(page) or "")
    assert traffic.carrying(NAME) == [], "a personal word left the page"
    assert not [s for s in traffic.sent if "my friend" in s], "a keystroke left the page"

    page.get_by_test_id("input").fill("")
    type_and_wait(page, "my friend zo")
    expect(named).to_have_count(1)
    page.get_by_test_id("personal-clear").click()
    expect(named).to_have_count(0)
    expect(note).to_contain_text("0 words")
    assert stored(page) is None

    switch.uncheck()  # off: nothing learned
    expect(note).to_contain_text("off")
    page.get_by_test_id("input").fill("")
    type_and_wait(page, f"my friend {NAME} is here")
    page.keyboard.press("Enter")
    expect(page.get_by_test_id("input")).to_have_value("")
    assert stored(page) is None
    assert traffic.carrying(NAME) == []
    context.close()
    assert not errors, errors
