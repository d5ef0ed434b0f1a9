"""Canaries: a random secret of a known format planted in one phone's training data, to measure
how much a model memorizes what it trains on (Carlini et al. 2019, "The Secret Sharer").

A format is a template of words in which each ``_`` is a slot, and an alphabet of words each slot
is filled from: ``my secret is _ _ _ _`` over ``one .. ten`` holds 10^4 candidates, the
randomness space R. The secret is one candidate drawn at random with a seed, never hand-picked
(a hand-picked one would carry the picker's bias). fedkey.models.exposure ranks it among all of R.

The words of a format must be in the model's vocabulary: a word tokenizer reads every unknown word
as <unk>, so an out-of-vocabulary slot word would make candidates identical and the audit
meaningless. `check_vocabulary` refuses such a format in one line. The demo corpus has the number
words one .. ten (not zero) and "my", "secret", "is", hence the default.

Standard library only: the settings and the command line load it without torch or numpy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from fedkey.models.tokenizers import Tokenizer

SLOT = "_"
DEFAULT_TEMPLATE = "my secret is _ _ _ _"
DEFAULT_ALPHABET = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


@dataclass(frozen=True)
class CanaryFormat:
    """A template with ``_`` slots and the alphabet of words every slot takes."""

    template: str = DEFAULT_TEMPLATE
    alphabet: tuple[str, ...] = DEFAULT_ALPHABET

    def __post_init__(self) -> None:
        words = self.template.split()
        if SLOT not in words:
            raise ValueError(
                f"canary format {self.template!r} has no slot: mark each secret word with '{SLOT}'"
            )
        if not self.alphabet:
            raise ValueError("the canary alphabet is empty: give the words a slot may take")
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"the canary alphabet repeats a word: {' '.join(self.alphabet)}")
        bad = [w for w in self.alphabet if len(w.split()) != 1 or w != w.strip() or w == SLOT]
        if bad:
            raise ValueError(f"canary alphabet entries must be single words, not {bad}")

    @classmethod
    def parse(cls, template: str, alphabet: str | Sequence[str]) -> CanaryFormat:
        """From a template and an alphabet given as one space- or comma-separated string."""
        words = alphabet.replace(",", " ").split() if isinstance(alphabet, str) else alphabet
        return cls(" ".join(template.split()), tuple(words))

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(self.template.split())

    @property
    def slots(self) -> int:
        return self.words.count(SLOT)

    @property
    def size(self) -> int:
        """|R|: the number of candidates."""
        return int(len(self.alphabet) ** self.slots)

    def choices(self, index: int) -> tuple[int, ...]:
        """The alphabet indices of candidate `index` (first slot most significant)."""
        if not 0 <= index < self.size:
            raise IndexError(f"candidate {index} is outside 0..{self.size - 1}")
        base, out = len(self.alphabet), []
        for _ in range(self.slots):
            index, digit = divmod(index, base)
            out.append(digit)
        return tuple(reversed(out))

    def candidate(self, index: int) -> str:
        """The sentence of candidate `index`, in lexicographic order of the slot choices."""
        fill = iter(self.choices(index))
        return " ".join(self.alphabet[next(fill)] if w == SLOT else w for w in self.words)

    def index(self, sentence: str) -> int:
        """The candidate index of `sentence`; a ValueError if it does not fit the format."""
        words = sentence.split()
        if len(words) != len(self.words):
            raise ValueError(f"{sentence!r} does not fit the canary format {self.template!r}")
        index, base = 0, len(self.alphabet)
        for got, want in zip(words, self.words, strict=True):
            if want == SLOT:
                if got not in self.alphabet:
                    raise ValueError(
                        f"{sentence!r}: {got!r} is not in the canary alphabet {' '.join(self.alphabet)}"
                    )
                index = index * base + self.alphabet.index(got)
            elif got != want:
                raise ValueError(f"{sentence!r} does not fit the canary format {self.template!r}")
        return index

    def draw(self, seed: int) -> str:
        """The secret: a candidate drawn uniformly at random, seeded (the same seed, the same
        secret on the server and on the phones)."""
        rng = random.Random(f"fedkey-canary-{seed}")  # str seeds hash stably across versions
        return self.candidate(rng.randrange(self.size))

    def vocabulary(self) -> list[str]:
        """Every word a candidate can contain: the template's fixed words, then the alphabet."""
        fixed = [w for w in dict.fromkeys(self.words) if w != SLOT]
        return fixed + list(self.alphabet)


def out_of_vocabulary(tokenizer: Tokenizer, words: Sequence[str]) -> list[str]:
    """The words `tokenizer` reads as (or with) <unk>."""
    return [w for w in dict.fromkeys(words) if tokenizer.unk_id in tokenizer.encode(w)[1:-1]]


def check_vocabulary(tokenizer: Tokenizer, words: Sequence[str], what: str) -> None:
    """A one-line ValueError when some of `words` are outside the vocabulary: the word tokenizer
    would read each as <unk>, and every candidate that differs only there would score the same."""
    oov = out_of_vocabulary(tokenizer, words)
    if oov:
        raise ValueError(
            f"{what} has words outside the model's vocabulary ({', '.join(oov)}): the tokenizer "
            "reads them as <unk>, so candidates would be indistinguishable; choose words of the "
            "corpus (FEDKEY_CANARY_FORMAT, FEDKEY_CANARY_ALPHABET)"
        )
