"""The embedded demo corpus: size, owners, determinism, and phrases worth suggesting."""

import re
import time
from collections import Counter

import pytest

from fedkey.corpora.demo import PERSONAS, demo_corpus
from fedkey.corpora.demo.shared import SHARED_SLOTS, SHARED_TEMPLATES
from fedkey.corpora.loaders import normalize_text


@pytest.fixture(scope="module")
def demo():
    return demo_corpus(seed=0)


def test_owners_and_sizes(demo):
    assert demo.name == "demo"
    assert len(demo.users) >= 20
    counts = Counter(demo.train_users)
    assert set(counts) == {p.user for p in PERSONAS}  # every owner appears in train
    assert len(demo.train) + len(demo.valid) + len(demo.test) >= 300 * len(demo.users)
    # per owner, all splits: at least 300 messages (train is 80%)
    assert min(counts.values()) >= 240
    assert len(demo.valid) >= 30 * len(demo.users) and len(demo.test) >= 30 * len(demo.users)


def test_messages_are_short_and_normalized(demo):
    for msg in demo.train + demo.valid + demo.test:
        assert 5 <= len(msg.split()) <= 20, msg
        assert msg == normalize_text(msg)


def test_vocabulary_is_modest(demo):
    vocab = {w for m in demo.train + demo.valid + demo.test for w in m.split()}
    assert 1500 <= len(vocab) <= 3000


def test_deterministic():
    a, b = demo_corpus(seed=0), demo_corpus(seed=0)
    assert a == b
    assert demo_corpus(seed=1).train != a.train


def test_fast():
    start = time.perf_counter()
    demo_corpus(seed=2)
    assert time.perf_counter() - start < 1.0


def test_see_you_has_several_continuations(demo):
    nxt = Counter()
    for m in demo.train:
        toks = m.split()
        for i in range(len(toks) - 2):
            if toks[i] == "see" and toks[i + 1] == "you":
                nxt[toks[i + 2]] += 1
    assert sum(nxt.values()) >= 100
    assert {"tomorrow", "later", "soon"} <= set(nxt)
    assert len(nxt) >= 6


def test_owners_have_distinct_vocabularies(demo):
    words = {u: Counter() for u in demo.users}
    for m, u in zip(demo.train, demo.train_users, strict=True):
        words[u].update(m.split())
    top = {u: {w for w, _ in c.most_common(150)} for u, c in words.items()}
    overlaps = [len(top[a] & top[b]) / 150 for i, a in enumerate(top) for b in list(top)[i + 1 :]]
    assert max(overlaps) < 0.8  # shared chat phrases overlap, topics do not


def test_templates_use_known_slots():
    pat = re.compile(r"\{(\w+)\}")
    for p in PERSONAS:
        slots = {**SHARED_SLOTS, **p.slots}
        texts = [*p.templates, *SHARED_TEMPLATES, *p.style.prefixes, *p.style.suffixes]
        texts += [v for vals in slots.values() for v in vals]
        missing = {name for t in texts for name in pat.findall(t)} - set(slots)
        assert not missing, (p.user, missing)
