"""The Suggester: one model step per new word, edits from the common prefix, same answers as a
from-scratch computation, completions, sentence restarts, SentencePiece refused clearly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedkey.keyboard_web.suggest import (
    DEFAULT_MAX_CONTEXT,
    Suggester,
    SuggestError,
    context_words,
    split_text,
)

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = {"<unk>", "<s>", "</s>"}


@pytest.fixture(scope="module")
def sugg(models) -> Suggester:
    return Suggester(models.word)


@pytest.fixture(scope="module")
def lstm(models) -> Suggester:
    return Suggester(models.lstm)


class RunLog:
    """Wraps Suggester.run to record the tokens of every model call."""

    def __init__(self, s: Suggester, monkeypatch):
        self.calls: list[list[int]] = []
        real = s.run

        def run(tokens, state):
            self.calls.append(list(tokens))
            return real(tokens, state)

        monkeypatch.setattr(s, "run", run)

    def take(self) -> list[list[int]]:
        out, self.calls = self.calls, []
        return out


def real_word(w: str) -> bool:
    return w not in SPECIALS and any(ch.isalnum() for ch in w)


@pytest.mark.parametrize("which", ["sugg", "lstm"])
def test_one_model_step_per_new_word_and_same_as_fresh(which, request, monkeypatch):
    s: Suggester = request.getfixturevalue(which)
    session = s.new_session()
    log = RunLog(s, monkeypatch)
    text = "see you at the library tomorrow, ok? thanks so much "
    grew_by_one = 0
    for i in range(1, len(text) + 1):
        typed = text[:i]
        got = session.suggest(typed)
        calls = log.take()
        ctx_before = context_words(split_text(typed[:-1])[0])
        ctx_after = context_words(split_text(typed)[0])
        if ctx_after == ctx_before:
            assert calls == [], f"{typed!r}: a keystroke that completes no word ran the model"
        elif ctx_after[: len(ctx_before)] == ctx_before:
            # One step per completed word: a space, one; "ok?" completes two ("ok", "?").
            assert calls == [[t] for t in s.encode(ctx_after[len(ctx_before) :])], typed
            grew_by_one += len(calls) == 1
        else:
            assert calls == [], typed  # a sentence end: back to <s>, which is cached
        assert got == s.suggest_fresh(typed), typed
        log.take()
        if not split_text(typed)[1]:
            assert len(got["suggestions"]) == 3, (typed, got)
    assert grew_by_one >= 8


def test_edits_recompute_from_common_prefix(sugg, monkeypatch):
    s = sugg
    ids = s.encode
    session = s.new_session()
    log = RunLog(s, monkeypatch)

    session.suggest("see you at the library ")
    log.take()
    # Backspace into the last word: the context shrinks, no model call (log-probs are kept).
    r = session.suggest("see you at the lib")
    assert log.take() == []
    assert r == s.suggest_fresh("see you at the lib")
    log.take()
    # A different word after the common prefix: only it is fed.
    r = session.suggest("see you at the gym ")
    assert log.take() == [ids(["gym"])]  # "see you at the" is kept
    assert r == s.suggest_fresh("see you at the gym ")
    log.take()
    # An edit in the middle (select + paste): recompute from "see" on, one step per word.
    r = session.suggest("see me at the gym ")
    assert log.take() == [[t] for t in ids(["me", "at", "the", "gym"])]
    assert r == s.suggest_fresh("see me at the gym ")
    log.take()


def test_a_paste_steps_once_per_word_and_keeps_every_state(sugg, monkeypatch):
    s = sugg
    session = s.new_session()
    log = RunLog(s, monkeypatch)
    session.suggest("thank you so much ")  # a paste: one step per word
    assert log.take() == [[t] for t in s.encode(["thank", "you", "so", "much"])]
    assert len(session.stack) == 4
    # Back into "so": the context "thank you" is on the stack; no call.
    r = session.suggest("thank you so")
    assert log.take() == []
    assert r == s.suggest_fresh("thank you so")
    log.take()
    # Another word after "thank you": one step from the state stored there.
    r = session.suggest("thank you very ")
    assert log.take() == [s.encode(["very"])]
    assert r == s.suggest_fresh("thank you very ")


def test_next_words_are_real_words(sugg):
    for text in ["", "see you ", "how are ", "hello, ", "what?! ", "the the the "]:
        got = sugg.new_session().suggest(text)
        assert got["round"] == 3
        words = got["suggestions"]
        assert len(words) == 3 and len(set(words)) == 3, (text, words)
        assert all(real_word(w) and w in sugg.stoi for w in words), (text, words)


def test_next_words_are_the_top3_by_keystrokes_saved(sugg):
    """P(w) * len(w): the model's probability times the keystrokes tapping w saves."""
    ids, _ = sugg.context_ids("see you ")
    lp, _ = sugg.run(ids, sugg.initial.state)
    score = lp[-1].astype(np.float64) + np.log([len(w) for w in sugg.words])
    for i, w in enumerate(sugg.words):
        if not real_word(w):
            score[i] = -np.inf
    expected = [sugg.words[i] for i in np.argsort(-score, kind="stable")[:3]]
    assert sugg.suggest_fresh("see you ")["suggestions"] == expected


@pytest.mark.parametrize("prefix", ["t", "se", "to", "w", "don'", "Th"])
def test_completions_start_with_the_prefix_and_rank_by_keystrokes_saved(sugg, prefix):
    text = "see you " + prefix
    got = sugg.new_session().suggest(text)["suggestions"]
    low = prefix.lower()
    candidates = [w for w in sugg.words if w.startswith(low) and len(w) > len(low) and real_word(w)]
    assert got, f"no completion for {prefix!r}"
    assert len(got) == min(3, len(candidates))
    assert all(w.startswith(low) for w in got), got
    ids, _ = sugg.context_ids(text)
    lp, _ = sugg.run(ids, sugg.initial.state)
    scores = {w: float(lp[-1][sugg.stoi[w]]) + np.log(len(w) - len(low)) for w in candidates}
    best = sorted(candidates, key=lambda w: (-scores[w], sugg.stoi[w]))[:3]
    assert got == best


def test_a_word_typed_in_full_never_takes_a_slot(sugg):
    """ "the" typed in full saves nothing; its longer completions fill the bar."""
    for text in ("see you the", "see you to", "i", "see you a"):
        partial = split_text(text)[1]
        assert partial in sugg.stoi, partial
        got = sugg.new_session().suggest(text)["suggestions"]
        assert partial not in got and all(len(w) > len(partial) for w in got), (text, got)
        assert got == sugg.suggest_fresh(text)["suggestions"]


def test_unknown_prefix_has_no_completions(sugg):
    assert sugg.suggest_fresh("see you zzzzqx")["suggestions"] == []


def test_sentence_end_restarts_the_context(sugg):
    session = sugg.new_session()
    for end in [".", "!", "?", "...", "?!"]:
        text = f"see you at the gym {end} how are "
        assert split_text(text)[0][-2:] == ["how", "are"]
        assert sugg.context_ids(text)[0] == sugg.encode(["how", "are"])
        assert session.suggest(text) == sugg.suggest_fresh("how are ")
    # Right after the terminator (a space or not): the first word of a sentence.
    assert session.suggest("thanks. ") == sugg.suggest_fresh("")
    assert session.suggest("thanks!") == sugg.suggest_fresh("")


def test_context_is_capped(sugg):
    words = [f"w{i}" for i in range(130)]
    assert context_words(words[:40]) == words[:40]
    for n in (41, 59, 60, 61, 130):
        ctx = context_words(words[:n])
        assert DEFAULT_MAX_CONTEXT // 2 < len(ctx) <= DEFAULT_MAX_CONTEXT, n
        assert ctx == words[n - len(ctx) : n]
        assert (n - len(ctx)) % (DEFAULT_MAX_CONTEXT // 2) == 0  # the window moves by hops
    text = " ".join(["the"] * 100) + " "
    session = sugg.new_session()
    for k in range(1, 100):
        partial = " ".join(["the"] * k) + " "
        assert session.suggest(partial) == sugg.suggest_fresh(partial)
    assert session.suggest(text) == sugg.suggest_fresh(text)
    assert len(session.stack) <= DEFAULT_MAX_CONTEXT


def test_split_text_follows_normalize_text():
    from fedkey.corpora.loaders import normalize_text

    assert split_text("Hello, World! ") == (["hello", ",", "world", "!"], "")
    assert split_text("See you T") == (["see", "you"], "t")
    assert split_text("I DON\u2019") == (["i"], "don'")
    assert split_text("well-") == ([], "well-")
    assert split_text("(hel") == (["("], "hel")
    assert split_text("wait...") == (["wait", "..."], "")
    for raw in ["Don't panic... OK?", "e.g. 3.5 apples, well-known!", "\u00c9t\u00c9  caf\u00e9 "]:
        assert " ".join(split_text(raw + " ")[0]) == normalize_text(raw)
    tokens, partial = split_text("x " * 2000 + "see you t")  # only the tail is read
    assert partial == "t" and tokens[-2:] == ["see", "you"] and len(tokens) < 520


def test_sentencepiece_model_gives_a_clear_error(models):
    s = Suggester(models.sentencepiece)
    assert s.info()["suggestions"] is False
    assert "sentencepiece" in s.error and "word" in s.error
    with pytest.raises(SuggestError, match="sentencepiece tokenizer"):
        s.suggest_fresh("see you ")
    with pytest.raises(SuggestError, match="word-vocabulary"):
        s.new_session().suggest("see you ")


def test_info_reports_the_export(sugg):
    info = sugg.info()
    assert info["round"] == 3 and info["strategy"] == "fedavg"
    assert info["perplexity"] == pytest.approx(175.25)
    assert info["int8"] is False and info["cell"] == "gru"


def test_serving_never_imports_torch():
    code = (
        "import sys, fedkey.keyboard_web.app, fedkey.keyboard_web.suggest; "
        "bad = [m for m in ('torch', 'safetensors') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_javascript_port_splits_text_like_python():
    """static/suggest.js (the in-browser mode) parses text exactly like suggest.py."""
    cases = [
        "",
        " ",
        "Hello, world! ",
        "see you t",
        "Don\u2019t panic... OK?",
        "xxx don'",
        "foo.",
        "foo.b",
        "(hel",
        "well-kn",
        "3.5 apples",
        "caf\u00e9 na\u00efve ",
        "\uff21\uff22\uff23 ",  # full-width letters: NFKC
        "what?! really?? ",
        "a -- b ... c",
        " ".join(f"w{i}" for i in range(95)) + " ",
        "x " * 700 + "tail",
    ]
    script = (
        "const s = require(process.argv[1]);"
        "const cases = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "console.log(JSON.stringify(cases.map((c) => { const [t, p] = s.splitText(c);"
        " return [t, p, s.contextWords(t)]; })));"
    )
    out = subprocess.run(
        ["node", "-e", script, str(ROOT / "keyboard_web" / "static" / "suggest.js")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout)
    for case, (tokens, partial, ctx) in zip(cases, got, strict=True):
        py_tokens, py_partial = split_text(case)
        assert (tokens, partial) == (py_tokens, py_partial), case
        assert ctx == context_words(py_tokens), case


def test_int8_export_suggests_and_says_so(models, tmp_path):
    from fedkey.export.onnx_export import export_checkpoint

    out = tmp_path / "int8" / "model.onnx"
    export_checkpoint(models.checkpoint, out, int8=True)
    s = Suggester(out)
    assert s.info()["int8"] is True
    got = s.new_session().suggest("see you ")["suggestions"]
    assert len(got) == 3 and all(real_word(w) for w in got)
    assert s.new_session().suggest("see you t") == s.suggest_fresh("see you t")
