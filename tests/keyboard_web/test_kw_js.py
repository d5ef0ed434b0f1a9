"""The in-browser mode's modules (keyboard_web/static: ngram.js, suggest.js, personal.js) under
Node against the Python side's numbers: the n-gram file parsed by hand gives fedkey.models.ngram.
KneserNey's distributions bit for bit, the stack holds the server's mixture
(fedkey.keyboard_web.ngram.mix_log_probs), the bar ranks as fedkey.models.bar, and the personal
cache counts, weighs, bounds and stores as fedkey.models.personal.PersonalCache."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedkey.common.text import normalize_text
from fedkey.keyboard_web.ngram import mix_log_probs
from fedkey.models.bar import savings_scores, word_lengths
from fedkey.models.ngram import KneserNey
from fedkey.models.personal import DEFAULTS, MAX_WORDS, PersonalCache
from fedkey.models.tokenizers import WordTokenizer

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "keyboard_web" / "static"
HARNESS = Path(__file__).with_name("harness.js")
TRAIN = [
    "the cat sat on the mat",
    "the dog sat on the log",
    "a cat ate the fish",
    "see you at the cafe",
    "the cat ate the fish",
] * 2 + ["the dog ate"]


def node(command: dict[str, Any]) -> Any:
    """One command of harness.js (Node), its JSON answer."""
    out = subprocess.run(
        ["node", str(HARNESS), str(STATIC)],
        input=json.dumps(command),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def floats(path: Path | str) -> np.ndarray:
    return np.fromfile(path, dtype=np.float64)


def write_floats(path: Path, values: np.ndarray) -> str:
    np.asarray(values, dtype=np.float64).tofile(path)
    return str(path)


@pytest.fixture(scope="module")
def tok() -> WordTokenizer:
    return WordTokenizer.build(TRAIN + ["zebra"], max_size=None)


def kn_file(tmp_path: Path, tok: WordTokenizer, order: int, min_count: int = 1):
    lm = KneserNey(tok, order).fit((tok.encode(s) for s in TRAIN), min_count=min_count)
    path = tmp_path / f"kn{order}-{min_count}.ngram.safetensors"
    path.write_bytes(lm.to_bytes("test sentences"))
    return lm, path


def ids(tok: WordTokenizer, text: str) -> list[int]:
    return [tok.bos_id, *(tok.stoi.get(w, tok.unk_id) for w in text.split())]


CONTEXTS = ["", "the", "the cat", "sat on", "on the", "zebra zebra", "ate the", "nothing known"]


@pytest.mark.parametrize(("order", "min_count"), [(2, 1), (3, 1), (3, 2), (4, 1)])
def test_the_ngram_file_read_by_hand_gives_kneser_ney_exactly(tmp_path, tok, order, min_count):
    """ngram.js parses safetensors itself (header, dtypes, little-endian data) and its
    distribution is KneserNey.distribution, bit for bit, pruned or not."""
    from safetensors.numpy import load

    lm, path = kn_file(tmp_path, tok, order, min_count)
    contexts = [ids(tok, c) for c in CONTEXTS]
    got = node(
        {
            "command": "ngram",
            "file": str(path),
            "words": tok.itos,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "contexts": contexts,
            "out": str(tmp_path / "d"),
        }
    )
    assert got["order"] == order
    tensors = load(path.read_bytes())
    assert set(got["tensors"]) == set(tensors)
    for name, arr in tensors.items():
        assert got["tensors"][name] == list(arr.shape), name
        np.testing.assert_array_equal(floats(tmp_path / f"d.{name}"), arr.astype(np.float64))
    assert got["metadata"]["format"] == "fedkey-kn-1"
    assert got["metadata"]["min_count"] == str(min_count)
    for i, ctx in enumerate(contexts):
        expected = lm.distribution(ctx)
        np.testing.assert_array_equal(floats(tmp_path / f"d.{i}"), expected)
        assert abs(expected.sum() - 1) < 1e-6


def test_int64_keys_past_2_to_the_32_are_read_exactly(tmp_path):
    """Order 4 over 50,000 words: context keys near 1.25e14 (int64 read through BigInt64Array)."""
    V = 50_000
    big = WordTokenizer(["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(3, V))])
    top = [f"w{i}" for i in range(V - 6, V)]
    sentences = [" ".join(top[j:] + top[:j]) for j in range(6)] * 2
    lm = KneserNey(big, order=4).fit(big.encode(s) for s in sentences)
    path = tmp_path / "big.ngram.safetensors"
    path.write_bytes(lm.to_bytes("rotations"))
    assert int(lm.levels[-1].ctx.max()) > 2**32
    contexts = [ids(big, " ".join(top[:3])), ids(big, " ".join(top[2:5])), ids(big, "w5 w6")]
    node(
        {
            "command": "ngram",
            "file": str(path),
            "words": big.itos,
            "contexts": contexts,
            "out": str(tmp_path / "d"),
        }
    )
    np.testing.assert_array_equal(floats(tmp_path / "d.ctx4"), lm.levels[-1].ctx.astype(float))
    for i, ctx in enumerate(contexts):
        np.testing.assert_array_equal(floats(tmp_path / f"d.{i}"), lm.distribution(ctx))
    # The top words follow each other in a cycle: after three of them comes the fourth.
    assert int(np.argmax(floats(tmp_path / "d.0"))) == big.stoi[top[3]]


def test_a_file_not_the_one_named_or_of_another_vocabulary_is_refused(tmp_path, tok):
    _, path = kn_file(tmp_path, tok, 3)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    ok = node({"command": "ngramError", "file": str(path), "words": tok.itos, "sha256": sha})
    assert ok["error"] is None
    wrong = node(
        {"command": "ngramError", "file": str(path), "words": tok.itos, "sha256": "0" * 64}
    )
    assert "sha256" in wrong["error"]
    other = [*tok.itos[:-1], "zzz"]  # as many words, one of them different
    renamed = node({"command": "ngramError", "file": str(path), "words": other, "sha256": sha})
    assert "another vocabulary" in renamed["error"]
    fewer = node({"command": "ngramError", "file": str(path), "words": tok.itos[:-1]})
    assert "the model has" in fewer["error"]


def bar(logprobs: np.ndarray, words: list[str], partial: str, extra=None) -> list[str]:
    """fedkey.models.bar's three slots: the suggestible words completing `partial` (and the
    `extra` (word, log-prob) outside the vocabulary), by savings, ties to the lower id."""
    cands = [
        i
        for i, w in enumerate(words)
        if i > 2 and any(c.isalnum() for c in w) and w.startswith(partial)
    ]
    names = [words[i] for i in cands]
    lps = logprobs[cands]
    keys = list(cands)
    for w, lp in extra or []:
        if w.startswith(partial):
            names.append(w)
            lps = np.append(lps, lp)
            keys.append(len(words))
    scores = savings_scores(np.asarray(lps), word_lengths(names), len(partial))
    ranked = sorted(
        (-s, k, n) for s, k, n in zip(scores.tolist(), keys, names, strict=True) if s != -np.inf
    )
    return [n for _, _, n in ranked[:3]]


BAR_WORDS = ["<unk>", "<s>", "</s>", ".", ",", "i", "to", "the", "today", "tomorrow", "because",
             "cat", "cafe", "caf\u00e9", "ca", "top", "tea", "x", "\U0001f600ok", "tomato"]  # fmt: skip


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    out: np.ndarray = x - np.log(np.exp(x).sum())
    return out


def test_the_bar_ranks_by_keystrokes_saved_as_models_bar(tmp_path):
    """Slots by P(w) * (len(w) - typed): only completions longer than the partial word, never a
    word typed in full, a long likely word over a slightly likelier short one, ties to the lower
    id, never a special or punctuation."""
    rng = np.random.default_rng(0)
    V = len(BAR_WORDS)
    partials = ["", "t", "to", "tom", "ca", "caf", "x", "zz", "i", "\U0001f600"]
    cases = []
    lp = log_softmax(rng.normal(size=V))
    crafted = lp.copy()
    crafted[BAR_WORDS.index("to")] = np.log(0.5)  # the likeliest word, typed in full below
    crafted[BAR_WORDS.index("i")] = np.log(0.2)
    crafted[BAR_WORDS.index("because")] = np.log(0.19)  # "because" (7) over "i" (1)
    crafted[BAR_WORDS.index("today")] = crafted[BAR_WORDS.index("tomato")] = np.log(0.01)
    crafted[BAR_WORDS.index(".")] = crafted[0] = crafted[2] = np.log(0.9)  # never shown
    for logprobs in (lp, crafted):
        got = node(
            {
                "command": "rank",
                "words": BAR_WORDS,
                "logprobs": write_floats(tmp_path / "lp", logprobs),
                "partials": partials,
            }
        )
        for partial, slots in zip(partials, got, strict=True):
            assert slots == bar(logprobs, BAR_WORDS, partial), partial
        cases.append(dict(zip(partials, got, strict=True)))
    mine = cases[1]
    assert mine[""][0] == "because"  # 0.19 * 7 over "to" 0.5 * 2 and "i" 0.2 * 1
    assert mine["to"] and "to" not in mine["to"] and all(w.startswith("to") for w in mine["to"])
    assert mine["i"] == [] and mine["zz"] == []


def test_the_stack_holds_the_mixture_with_the_ngram(tmp_path, tok):
    """Typing through a Session over a model whose next-word row is table[token]: each stack
    entry holds log(w * p_model + (1 - w) * p_kn(. | the sentence so far)), and the bar ranks
    those (the weight from model.json's "ngram")."""
    lm, path = kn_file(tmp_path, tok, 3)
    rng = np.random.default_rng(1)
    V = tok.vocab_size
    table = np.stack([log_softmax(rng.normal(size=V) * 2) for _ in range(V)]).astype(np.float32)
    files = [write_floats(tmp_path / f"row{i}", table[i]) for i in range(V)]
    weight = 0.35
    texts = ["the cat ", "the cat sat on the m", "the dog . a c", "zebra the "]
    got = node(
        {
            "command": "session",
            "words": tok.itos,
            "table": files,
            "ngram": {"path": str(path), "meta": {"file": path.name, "weight": weight, "order": 3}},
            "texts": texts,
            "out": str(tmp_path / "e"),
        }
    )
    final = got["results"][-1]["tokens"]
    assert final == ids(tok, "zebra the")[1:]
    for i in range(len(final) + 1):
        context = [tok.bos_id, *final[:i]]
        expected = mix_log_probs(table[context[-1]], lm.distribution(context), weight)
        np.testing.assert_allclose(floats(tmp_path / f"e.{i}"), expected, rtol=1e-12, atol=0)
    for text, res in zip(texts, got["results"], strict=True):
        words = normalize_text(text).split()
        partial = "" if text.endswith(" ") else words.pop()
        sentence = words[len(words) - words[::-1].index(".") :] if "." in words else words
        context = ids(tok, " ".join(sentence))
        mixed = mix_log_probs(table[context[-1]], lm.distribution(context), weight)
        assert res["suggestions"] == bar(mixed, tok.itos, partial), text
    assert got["steps"] == 2 + 3 + 1 + 2  # one model step per word after the common prefix


def personal_reference(messages: list[str], max_words: int = MAX_WORDS) -> PersonalCache:
    cache = PersonalCache(max_words=max_words)
    for m in messages:
        cache.learn(normalize_text(m).split())
    return cache


MESSAGES = [
    "my friend zorblax is here",
    "My friend Zorblax is here. Zorblax rocks!",
    "see you at the caf\u00e9, ok?",
    "ok",
]


def test_the_personal_cache_counts_and_weighs_as_the_python_cache():
    """Same words (least recently used first), the same weight mu and p_cache(w | prev) as
    fedkey.models.personal; the defaults are its DEFAULTS; stored under fedkey.personal.v1 and
    read back the same; an unreadable store gives an empty cache."""
    ref = personal_reference(MESSAGES)
    queries = [["friend", "zorblax"], ["<s>", "my"], ["<s>", "zorblax"], ["is", "here"],
               ["nothing", "ok"], [",", "ok"], ["the", "caf\u00e9"]]  # fmt: skip
    got = node({"command": "personal", "messages": MESSAGES, "queries": queries})
    assert got["defaults"] == DEFAULTS and got["params"] == DEFAULTS
    assert got["max_words"] == MAX_WORDS == 5000
    assert got["storage_key"] == "fedkey.personal.v1"
    assert got["words"] == list(ref.unigrams)
    assert got["total"] == ref.total and got["size"] == len(ref)
    assert got["weight"] == pytest.approx(ref.weight(), rel=1e-12)
    for (prev, w), p in zip(queries, got["probs"], strict=True):
        assert p == pytest.approx(ref.probabilities(prev)[w], rel=1e-12), (prev, w)
    stored = got["stored"]
    assert dict(stored["words"]) == ref.unigrams
    assert {prev: dict(row) for prev, row in stored["bigrams"]} == ref.bigrams
    assert got["same_back"] and got["garbage"] == 0

    params = {"max_weight": 0.2, "ramp": 10, "beta": 0.5}
    other = node(
        {"command": "personal", "messages": MESSAGES, "params": params, "queries": queries}
    )
    tuned = PersonalCache(0.2, 10, 0.5)
    for m in MESSAGES:
        tuned.learn(normalize_text(m).split())
    assert other["weight"] == pytest.approx(tuned.weight(), rel=1e-12)
    assert other["probs"][0] == pytest.approx(tuned.probabilities("friend")["zorblax"], rel=1e-12)


def test_the_personal_cache_keeps_5000_words_dropping_the_least_counted():
    messages = ["keep keep keep", " ".join(f"x{i}" for i in range(MAX_WORDS + 5))]
    got = node({"command": "personal", "messages": messages})
    ref = personal_reference(messages)
    assert got["size"] == len(ref) == MAX_WORDS
    assert got["words"] == list(ref.unigrams)
    assert "keep" in got["words"] and "x5" not in got["words"] and "x6" in got["words"]
    kept = {w for _, row in got["stored"]["bigrams"] for w, _ in row}
    assert not kept & {f"x{i}" for i in range(6)}
    assert got["total"] == ref.total == 3 + MAX_WORDS - 1


def test_the_bar_mixes_in_the_users_words_outside_the_vocabulary(tmp_path, tok):
    """p(w) = (1 - mu) P(w) + mu p_cache(w | prev) over the vocabulary and the cache: a name
    the user sent twice completes "zo" after "friend", ranked as fedkey.models.personal mixes."""
    rng = np.random.default_rng(2)
    words = [*tok.itos, "zoo", "zone"]
    logprobs = log_softmax(rng.normal(size=len(words)))
    messages = ["my friend zorblax is here"] * 2 + ["the zoo is here"]
    ref = personal_reference(messages)
    partials = ["", "zo", "z", "zorblax", "he", "the"]
    for prev in ("friend", "<s>", "the"):
        got = node(
            {
                "command": "rank",
                "words": words,
                "logprobs": write_floats(tmp_path / "lp", logprobs),
                "partials": partials,
                "messages": messages,
                "prev": prev,
            }
        )
        p, extra_words, extra_p = ref.mix(
            np.exp(logprobs), {w: i for i, w in enumerate(words)}, prev
        )
        extra = list(zip(extra_words, np.log(extra_p).tolist(), strict=True))
        for partial, slots in zip(partials, got, strict=True):
            assert slots == bar(np.log(p), words, partial, extra), (prev, partial)
        if prev == "friend":
            assert "zorblax" in got[1]  # "my friend zo"
            assert got[3] == []  # typed in full: nothing left to save
