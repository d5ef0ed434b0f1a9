"""KneserNey as arrays and as its file (ngram.safetensors, "fedkey-kn-1"): the same numbers as
Kneser-Ney computed from the counts, the same after a save and a load, still distributions when
pruned, and refused for another vocabulary or a damaged file."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from fedkey.models.ngram import KN_FORMAT, KneserNey, vocab_sha256
from fedkey.models.tokenizers import WordTokenizer

TRAIN = ["the cat sat on the mat", "the dog sat on the log", "a cat ate the fish"] * 3
CONTEXTS = [("<s>",), ("<s>", "the"), ("sat", "on"), ("on", "the"), ("zebra", "zebra"), ("fish",)]

# Numbers of the dict-based KneserNey this one replaced (fedkey before issue 65), fitted on TRAIN
# with the vocabulary below (order 3), printed with repr(lm.distribution(context)[id]):
# (context, word, probability).
PREVIOUS = [
    (("<s>", "<s>"), "the", 0.6339209084307124),
    (("<s>", "<s>"), "a", 0.2889681124975243),
    (("sat", "on"), "the", 0.9384036442859972),
    (("sat", "on"), "zebra", 0.0021786492374727667),
    (("on", "the"), "mat", 0.42789661319073086),
    (("on", "the"), "cat", 0.019944543473955238),
    (("<s>", "fish"), "</s>", 0.26084373143196676),
    (("zebra", "zebra"), "cat", 0.10962566844919787),
]


@pytest.fixture(scope="module")
def tok() -> WordTokenizer:
    return WordTokenizer.build(TRAIN + ["zebra"], max_size=None)


@pytest.fixture(scope="module")
def lm(tok) -> KneserNey:
    return KneserNey(tok, order=3).fit(tok.encode(s) for s in TRAIN)


def ids(tok: WordTokenizer, words) -> list[int]:
    return [tok.stoi[w] for w in words]


def brute_force_kn(tok: WordTokenizer, sentences: list[str], order: int, context: list[int]):
    """Interpolated Kneser-Ney (Chen & Goodman) from n-gram counts in dicts, one word at a time:
    raw counts at the highest order, continuation counts below, D = n1 / (n1 + 2 n2) per order,
    the unigram interpolated with the uniform distribution."""
    bos, V = tok.bos_id, tok.vocab_size
    padded = [[bos] * (order - 2) + tok.encode(s) for s in sentences]
    counts = {
        order: Counter(tuple(a[i : i + order]) for a in padded for i in range(len(a) - order + 1))
    }
    for k in range(order - 1, 0, -1):  # in how many distinct contexts each (k)-gram follows
        counts[k] = Counter(g[1:] for g in counts[k + 1])

    def discount(c: Counter) -> float:
        n1 = sum(v == 1 for v in c.values())
        n2 = sum(v == 2 for v in c.values())
        return n1 / (n1 + 2 * n2) if n1 + n2 else 0.5

    ctx = tuple([bos] * (order - 2) + context)
    out = np.zeros(V)
    for w in range(V):
        d, total = discount(counts[1]), sum(counts[1].values())
        p = (max(counts[1][(w,)] - d, 0) + d * len(counts[1]) / V) / total
        for k in range(2, order + 1):
            head = ctx[len(ctx) - (k - 1) :]
            row = {g[-1]: n for g, n in counts[k].items() if g[:-1] == head}
            if row:
                d, total = discount(counts[k]), sum(row.values())
                p = max(row.get(w, 0) - d, 0) / total + d * len(row) / total * p
        out[w] = p
    return out


@pytest.mark.parametrize("order", [2, 3, 4])
def test_unpruned_distributions_are_kneser_ney_from_the_counts(tok, order):
    lm = KneserNey(tok, order=order).fit(tok.encode(s) for s in TRAIN)
    for words in CONTEXTS:
        context = ids(tok, words)
        expected = brute_force_kn(tok, TRAIN, order, context)
        assert np.allclose(lm.distribution(context), expected, rtol=1e-6, atol=0), words


def test_unpruned_distributions_keep_the_previous_implementations_numbers(tok, lm):
    for context, word, previous in PREVIOUS:
        got = lm.distribution(ids(tok, context))[tok.stoi[word]]
        assert math.isclose(got, previous, rel_tol=1e-6), (context, word)


def test_save_and_load_give_identical_distributions(tok, lm, tmp_path):
    path = lm.save(tmp_path / "ngram.safetensors", corpus="three sentences")
    back = KneserNey.load(path, tok)
    assert (back.order, back.min_count, back.corpus) == (3, 1, "three sentences")
    assert (back.sentences, back.tokens) == (len(TRAIN), sum(len(s.split()) + 1 for s in TRAIN))
    for words in CONTEXTS:
        context = ids(tok, words)
        assert np.array_equal(back.distribution(context), lm.distribution(context)), words


def test_the_file_is_safetensors_with_the_documented_tensors_and_metadata(tok, lm, tmp_path):
    from safetensors import safe_open

    path = lm.save(tmp_path / "ngram.safetensors", corpus="three sentences")
    with safe_open(str(path), framework="numpy") as f:
        meta, names = f.metadata(), set(f.keys())
        ctx3, off3 = f.get_tensor("ctx3"), f.get_tensor("off3")
    assert meta["format"] == KN_FORMAT and meta["order"] == "3" and meta["min_count"] == "1"
    assert meta["vocab_sha256"] == vocab_sha256(tok.itos) and meta["vocab_size"] == "14"
    expected = {"unigram"} | {
        f"{n}{k}" for k in (2, 3) for n in ("ctx", "off", "gamma", "word", "prob")
    }
    assert names == expected
    # A trigram context (a, b) is a * V + b, sorted; "sat on" is followed by "the" only.
    key = tok.stoi["sat"] * tok.vocab_size + tok.stoi["on"]
    i = int(np.searchsorted(ctx3, key))
    assert ctx3[i] == key and off3[i + 1] - off3[i] == 1 and (np.diff(ctx3) > 0).all()


def test_pruned_distributions_still_sum_to_one_and_the_file_shrinks(tok, lm, tmp_path):
    train = TRAIN + ["the cat ate the log", "a dog sat on a mat", "the fish sat"]
    full = KneserNey(tok, order=3).fit(tok.encode(s) for s in train)
    pruned = KneserNey(tok, order=3).fit((tok.encode(s) for s in train), min_count=2)
    assert len(pruned.levels[1].word) < len(full.levels[1].word)  # the trigrams seen once went
    for a, b in zip(pruned.levels[0], full.levels[0], strict=True):  # the bigrams did not
        assert np.array_equal(a, b)
    for words in CONTEXTS + [("cat", "ate"), ("dog", "sat"), ("the", "fish")]:
        p = pruned.distribution(ids(tok, words))
        assert math.isclose(p.sum(), 1.0, rel_tol=1e-6) and (p > 0).all(), words
    small = pruned.save(tmp_path / "pruned.safetensors", corpus="c").stat().st_size
    assert small < full.save(tmp_path / "full.safetensors", corpus="c").stat().st_size
    assert KneserNey.load(tmp_path / "pruned.safetensors", tok).min_count == 2


def test_another_vocabulary_is_refused_in_one_line(lm, tmp_path):
    path = lm.save(tmp_path / "ngram.safetensors", corpus="c")
    other = WordTokenizer.build(TRAIN + ["yak"], max_size=None)
    with pytest.raises(ValueError, match="another vocabulary") as e:
        KneserNey.load(path, other)
    assert "\n" not in str(e.value) and "vocabulary" in str(e.value).split(";")[-1]


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b"not safetensors at all",
        lambda b: b.replace(b"fedkey-kn-1", b"fedkey-kn-9"),
    ],
)
def test_a_damaged_or_foreign_file_is_refused_with_a_value_error(tok, lm, tmp_path, damage):
    path = tmp_path / "ngram.safetensors"
    path.write_bytes(damage(lm.to_bytes("c")))
    with pytest.raises(ValueError, match="ngram.safetensors") as e:
        KneserNey.load(path, tok)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        KneserNey.load(tmp_path / "missing.safetensors", tok)


def test_min_count_below_one_is_refused(tok):
    with pytest.raises(ValueError, match="min_count"):
        KneserNey(tok).fit([tok.encode("the cat")], min_count=0)
