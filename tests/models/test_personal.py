"""The personal cache (fedkey.models.personal) and its measure on a user's messages in time order
(fedkey.models.personal_eval): the formula, what a user sees it learn, and the bound on its size."""

import itertools
import math

import numpy as np
import pytest

from fedkey.models.bar import savings_scores
from fedkey.models.personal import MAX_WORDS, PersonalCache, previous_tokens
from fedkey.models.personal_eval import by_sender, evaluate_personal
from fedkey.models.tokenizers import WordTokenizer

SETTING = {"max_weight": 0.3, "ramp": 50.0, "beta": 2.0}
TOK = WordTokenizer(["<unk>", "<s>", "</s>", "call", "me", "them", "you"])
# The same next-word distribution everywhere; the bar's savings: call 1.2, them 0.8, you 0.6, me 0.4.
ROW = np.array([0.05, 0.0, 0.05, 0.3, 0.2, 0.2, 0.2])


def base(ids):
    return np.tile(ROW, (len(ids) - 1, 1))


def score(senders, setting=SETTING):
    (result,) = evaluate_personal(base, TOK, senders, [setting])
    return result


def test_the_mixture_is_the_cache_formula_by_hand():
    cache = PersonalCache(max_weight=0.3, ramp=4, beta=2)
    cache.learn(["hi", "bob", ","])  # "," is not a word: never counted
    cache.learn(["hi", "zed"])
    # c1: hi 2, bob 1, zed 1 (n = 4); c2[<s>] = {hi: 2}, c2[hi] = {bob: 1, zed: 1}
    assert (cache.unigrams, cache.total) == ({"hi": 2, "bob": 1, "zed": 1}, 4)
    p = cache.probabilities("hi")  # (c2 + 2 * c1 / 4) / (2 + 2)
    assert p == pytest.approx({"hi": 0.25, "bob": 0.375, "zed": 0.375})
    assert cache.weight() == pytest.approx(0.3 * 4 / (4 + 4))  # mu = 0.15
    words = ["<unk>", "<s>", "</s>", "hi", "bob"]
    base = np.array([0.1, 0.0, 0.1, 0.5, 0.3])
    vocab_p, extra, extra_p = cache.mix(base, {w: i for i, w in enumerate(words)}, "hi")
    # hi: 0.85 * 0.5 + 0.15 * 0.25; bob: 0.85 * 0.3 + 0.15 * 0.375; zed (no base): 0.15 * 0.375
    assert vocab_p == pytest.approx([0.085, 0.0, 0.085, 0.4625, 0.31125])
    assert (extra, extra_p.tolist()) == (["zed"], pytest.approx([0.05625]))
    assert vocab_p.sum() + extra_p.sum() == pytest.approx(1.0)


def test_a_sentence_restarts_the_bigram_context_and_an_empty_cache_changes_nothing():
    assert previous_tokens(["ok", ".", "bob", ",", "hi"]) == ["<s>", "ok", "<s>", "bob", ","]
    empty = PersonalCache()
    base = np.array([0.2, 0.8])
    vocab_p, extra, _ = empty.mix(base, {"a": 0, "b": 1}, "<s>")
    assert (empty.weight(), vocab_p.tolist(), extra) == (0.0, [0.2, 0.8], [])
    cache = PersonalCache()
    cache.learn(["ok", "!", "bob", ",", "hi"])
    assert cache.bigrams == {"<s>": {"ok": 1, "bob": 1}, ",": {"hi": 1}}


def test_a_word_outside_the_vocabulary_is_offered_once_the_user_has_typed_it():
    """Each "zorblax" costs its 7 letters and a space until the user has sent it once; then it
    is offered after its first letter: 2 keystrokes. ("call" is the bar's first word: 1.)
    With nothing typed it is not offered yet: mu = 0.3 * 2 / 52 after two words, so its
    savings are at most 7 * 0.0115, far below the vocabulary's."""
    messages = ["call zorblax"] * 3
    r = score({"me": messages})
    assert r["words"] == 6 and r["oov"] == 0.5
    assert r["ksr"] == pytest.approx(1 - (1 + 8 + 1 + 2 + 1 + 2) / 39)
    off = score({"me": messages}, {**SETTING, "max_weight": 0})
    assert off["ksr"] == pytest.approx(1 - 3 * (1 + 8) / 39)
    # The bar's top 3 after "call" (me, them, you) still hold the base's words: no OOV hit yet.
    assert (r["all_top3"], r["bar_top3"]) == (0.5, 1.0)


def test_a_message_is_never_helped_by_itself_nor_by_a_later_one_nor_by_another_sender():
    assert score({"me": ["zorblax zorblax zorblax"]})["ksr"] == 0.0
    assert score({"a": ["zorblax"], "b": ["zorblax"], "c": ["zorblax"]})["ksr"] == 0.0
    assert score({"me": ["zorblax"] * 3})["ksr"] == pytest.approx(1 - (8 + 2 + 2) / 24)
    # The first message scores the same whatever follows it.
    first = score({"me": ["call zorblax"]})
    assert score({"me": ["call zorblax", "zorblax"]})["ksr"] == pytest.approx(
        1 - ((1 - first["ksr"]) * 13 + 2) / 21
    )


def test_the_cache_keeps_at_most_5000_words_dropping_the_least_counted_first():
    cache = PersonalCache()
    cache.learn(["w0", "w1", "w0"])
    cache.learn([f"x{i}" for i in range(MAX_WORDS - 1)])  # 5,001 distinct words
    assert len(cache) == MAX_WORDS == 5000
    # w1 (once, and used longest ago of the words seen once) went, with its bigram; w0 stays.
    assert "w1" not in cache and cache.unigrams["w0"] == 2 and "x0" in cache
    assert cache.total == sum(cache.unigrams.values()) == 2 + MAX_WORDS - 1
    assert all("w1" not in row for row in cache.bigrams.values()) and "w1" not in cache.bigrams


def test_among_equal_counts_the_word_used_longest_ago_goes():
    cache = PersonalCache(max_words=3)
    cache.learn(["a", "b", "c"])
    cache.learn(["a"])  # a: 2
    cache.learn(["b", "d"])  # b: 2, c and d once; c was used longest ago
    assert list(cache) == ["a", "b", "d"] and cache.total == 5
    # "b c" went with c; "a b" stays.
    assert cache.bigrams == {"<s>": {"a": 2, "b": 1}, "a": {"b": 1}, "b": {"d": 1}}


def test_by_sender_keeps_each_senders_order():
    assert by_sender(["a1", "b1", "a2", "b2", "a3"], ["a", "b", "a", "b", "a"]) == {
        "a": ["a1", "a2", "a3"],
        "b": ["b1", "b2"],
    }


# ---- The fast evaluation (sparse in the cache, several settings at once) against the definition


def _bar(candidates, word, k, slots):
    """Whether the bar offers `word` after its first k letters: the candidates (word, p, tie
    key) a bar shows that complete them, by log(p * (len - k)), finite only."""
    scored = []
    for w, p, key in candidates:
        if w.startswith(word[:k]) and any(ch.isalnum() for ch in w):
            with np.errstate(divide="ignore"):
                s = float(savings_scores(np.log([p]), np.array([len(w)]), k)[0])
            if s > -math.inf:
                scored.append((-s, key, w))
    return word in [w for _, _, w in sorted(scored)[:slots]]


def _reference(base, tok, senders, setting, slots=3):
    """Every field by brute force: the whole mixed distribution at every word, the bar sorted."""
    V = tok.vocab_size
    hits = dict.fromkeys(("all_top1", "all_top3", "bar_top1", "bar_top3"), 0)
    words = known = typed = keystrokes = 0
    for messages in senders.values():
        cache = PersonalCache(setting["max_weight"], setting["ramp"], setting["beta"])
        for message in messages:
            tokens = message.split()
            probs = base(tok.encode(message))
            for i, (word, prev) in enumerate(zip(tokens, previous_tokens(tokens), strict=True)):
                p, extra, extra_p = cache.mix(probs[i], tok.stoi, prev)
                oov_key = {w: V + r for r, w in enumerate(sorted(extra))}
                candidates = [(tok.itos[v], p[v], v) for v in range(3, V)]
                candidates += [(w, q, oov_key[w]) for w, q in zip(extra, extra_p, strict=True)]
                ranked = [w for q, _, w in sorted((-q, key, w) for w, q, key in candidates) if q]
                in_vocab = word in tok.stoi
                words, known, typed = words + 1, known + in_vocab, typed + len(word) + 1
                for prefix, counted in (("all_", True), ("bar_", in_vocab)):
                    hits[prefix + "top1"] += counted and word in ranked[:1]
                    hits[prefix + "top3"] += counted and word in ranked[:3]
                offered = [k for k in range(len(word)) if _bar(candidates, word, k, slots)]
                keystrokes += offered[0] + 1 if offered else len(word) + 1
            cache.learn(tokens)

    def share(count, of):
        return count / of if of else None

    return {"words": words, "oov": share(words - known, words), "ksr": 1 - keystrokes / typed,
            **{k: share(v, words if k.startswith("all") else known) for k, v in hits.items()}}  # fmt: skip


def test_the_fast_evaluation_matches_the_definition_at_every_setting():
    rng = np.random.default_rng(0)
    lexicon = ["a", "ab", "abc", "b", "ba", "bad", "cab", "cabs", "d", ",", "."]
    tok = WordTokenizer.build(lexicon, max_size=None)
    tables: dict[tuple[int, ...], np.ndarray] = {}

    def base(ids):
        key = tuple(ids)
        if key not in tables:
            tables[key] = rng.dirichlet(np.full(tok.vocab_size, 0.5), size=len(ids) - 1)
        return tables[key]

    pool = lexicon[:9] + ["abz", "zed", "zebra", "ab-c", ",", "."]  # and words outside it
    senders = {
        s: [" ".join(rng.choice(pool, size=rng.integers(1, 7))) for _ in range(8)]
        for s in ("x", "y")
    }
    settings = [
        {"max_weight": m, "ramp": r, "beta": b}
        for m, r, b in itertools.product((0.0, 0.2, 0.7), (1.0, 20.0), (0.5, 4.0))
    ]
    fast = evaluate_personal(base, tok, senders, settings)
    for setting, got in zip(settings, fast, strict=True):
        want = _reference(base, tok, senders, setting)
        assert {k: got[k] for k in want} == pytest.approx(want), setting


def test_without_the_cache_the_fields_are_the_bars_of_fedkey_models_metrics():
    """max_weight 0: the base alone, scored as the n-gram's evaluate and keystroke_savings_of."""
    from fedkey.models.metrics import keystroke_savings_of
    from fedkey.models.ngram import KneserNey

    train = ["the cat sat on the mat", "the dog sat on a log .", "a cat ate the fish , ok"]
    tok = WordTokenizer.build(train, max_size=None)
    lm = KneserNey(tok, order=3).fit(tok.encode(s) for s in train)
    held_out = ["the cat ate a log", "a dog sat on the zebra .", "the fish , the cat"]
    (off,) = evaluate_personal(
        lambda ids: np.exp(lm.sentence_log_probs(ids)), tok, {"me": held_out},
        [{"max_weight": 0.0, "ramp": 1.0, "beta": 1.0}],
    )  # fmt: skip
    scores = lm.evaluate(held_out)
    for field in ("bar_top1", "bar_top3", "all_top1", "all_top3", "oov"):
        assert off[field] == pytest.approx(scores[field]), field
    assert off["ksr"] == pytest.approx(keystroke_savings_of(lm.sentence_log_probs, tok, held_out))
