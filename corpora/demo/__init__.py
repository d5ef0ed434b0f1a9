"""The embedded demo corpus: generated typing histories of simulated phone owners.

The generator code *is* the shipped corpus, so a fresh install needs no download:
``demo_corpus(seed)`` writes the same messages for the same seed on every machine (each owner
has a random stream seeded with ``(seed, owner)``; Python's string seeding does not depend on
``PYTHONHASHSEED``). Owners, their topics and typing styles: :mod:`fedkey.corpora.demo.personas`;
phrases everyone uses: :mod:`fedkey.corpora.demo.shared`; the template engine:
:mod:`fedkey.corpora.demo.grammar`.
"""

from __future__ import annotations

import random

from fedkey.corpora.demo.grammar import Persona, Style, Writer
from fedkey.corpora.demo.personas import PERSONAS
from fedkey.corpora.demo.shared import SHARED_SLOTS, SHARED_TEMPLATES
from fedkey.corpora.loaders import Corpus, split_user_messages

__all__ = ["PERSONAS", "Persona", "Style", "demo_corpus", "demo_messages"]


def demo_messages(seed: int = 0) -> dict[str, list[str]]:
    """Every owner's messages in writing order, normalized like ``normalize_text``."""
    out: dict[str, list[str]] = {}
    for persona in PERSONAS:
        rng = random.Random(f"fedkey-demo/{seed}/{persona.user}")
        out[persona.user] = Writer(persona, SHARED_TEMPLATES, SHARED_SLOTS, rng).messages()
    return out


def demo_corpus(seed: int = 0) -> Corpus:
    """The demo corpus (name "demo"): 22 owners, 300-460 messages each of 5-20 tokens, split
    80/10/10 per owner (see ``split_user_messages``), ``train_users`` filled."""
    return split_user_messages(demo_messages(seed), seed, 0.1, 0.1, name="demo")
