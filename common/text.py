"""The one text normalization every part of fedkey agrees on: what a phone's corpus, the demo
generator and the web keyboard turn raw typed text into (lowercase, space-separated tokens)."""

from __future__ import annotations

import re
import unicodedata

# A word is a run of letters/digits, optionally joined by an apostrophe, hyphen or dot to more
# letters/digits ("don't", "well-known", "3.5", "e.g"). Anything else that is not whitespace is
# punctuation; a run of the same punctuation character stays one token ("...", "!!", "--").
_TOKEN_RE = re.compile(r"\w+(?:['\-.]\w+)*|([^\w\s])\1*")
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})
_TERMINATOR_CHARS = frozenset(".!?")


def is_terminator(token: str) -> bool:
    """A sentence end: a token made only of ". ! ?" ("." "?!" "...")."""
    return bool(token) and all(ch in _TERMINATOR_CHARS for ch in token)


def is_word(token: str) -> bool:
    """A token with a letter or a digit: a word, not punctuation (what a suggestion bar shows)."""
    return any(ch.isalnum() for ch in token)


def fold(s: str) -> str:
    """The character-level part of :func:`normalize_text`: Unicode NFKC, curly apostrophes to
    ``'``, lowercase (what the keyboard reads a partly typed word with)."""
    return unicodedata.normalize("NFKC", s).translate(_APOSTROPHES).lower()


def normalize_text(s: str) -> str:
    """Normalize raw typed text into the corpus convention: lowercase, space-separated tokens.

    Steps: Unicode NFKC, curly apostrophes to ``'``, lowercase, then a regex tokenizer that keeps
    words with inner apostrophes, hyphens or dots whole (``don't``, ``well-known``, ``3.5``) and
    makes every other non-space character a token of its own, a run of one repeated character
    counting as one token (``...``, ``!!``). Examples::

        "Hello, world!"        -> "hello , world !"
        "Don't panic... OK?"   -> "don't panic ... ok ?"

    An empty or whitespace-only string gives ``""``.
    """
    return " ".join(m.group(0) for m in _TOKEN_RE.finditer(fold(s)))
