"""The template grammar that writes the demo owners' messages.

A template is a string with ``{slot}`` placeholders; a slot is a list of alternatives that may
themselves hold placeholders (expanded recursively). Alternatives early in a list are picked more
often (Zipf-like weights), so every owner has favourite phrases, places and people, as real
typists do. After expansion an owner's :class:`Style` rewrites the message: contractions and
texting abbreviations ("you" -> "u"), greetings and sign-offs, and how much punctuation survives.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from fedkey.common.text import normalize_text

_SLOT_RE = re.compile(r"\{(\w+)\}")
_TERMINATORS = frozenset({".", "!", "?"})
MIN_TOKENS = 5
MAX_TOKENS = 20


@dataclass(frozen=True)
class Style:
    """How an owner types, applied after the template is filled.

    subs: phrase -> spellings this owner uses instead (each occurrence replaced with probability
    ``sub_rate``). punct: "full" keeps punctuation and ends every message with one; "minimal"
    drops commas and final periods; "none" drops all punctuation but keeps a question mark with
    probability ``keep_question``. prefixes/suffixes: openers and sign-offs, used with the given
    rates. exclaim_rate: chance that a final "." becomes "!".
    """

    subs: Mapping[str, Sequence[str]] = field(default_factory=dict)
    sub_rate: float = 0.0
    punct: str = "full"
    keep_question: float = 0.0
    prefixes: Sequence[str] = ()
    prefix_rate: float = 0.0
    suffixes: Sequence[str] = ()
    suffix_rate: float = 0.0
    exclaim_rate: float = 0.0


@dataclass(frozen=True)
class Persona:
    """One simulated phone owner: an id, a short description, own templates and slot lists
    (which override the shared ones of the same name), a style, how often the owner uses the
    shared everyday templates, and how many messages the owner writes (an inclusive range)."""

    user: str
    description: str
    templates: Sequence[str]
    slots: Mapping[str, Sequence[str]]
    style: Style
    shared_rate: float = 0.3
    n_messages: tuple[int, int] = (300, 460)


class _Chooser:
    """Zipf-weighted choice from slot lists, with cumulative weights cached per list."""

    def __init__(self, rng: random.Random, exponent: float = 0.7) -> None:
        self.rng = rng
        self.exponent = exponent
        self._cum: dict[int, list[float]] = {}

    def __call__(self, options: Sequence[str]) -> str:
        cum = self._cum.get(id(options))
        if cum is None or len(cum) != len(options):
            cum = list(accumulate(1.0 / (i + 1) ** self.exponent for i in range(len(options))))
            self._cum[id(options)] = cum
        return self.rng.choices(options, cum_weights=cum)[0]


def expand(template: str, slots: Mapping[str, Sequence[str]], choose: _Chooser) -> str:
    """Fill ``{slot}`` placeholders recursively (at most 6 levels deep)."""
    text = template
    for _ in range(6):
        if "{" not in text:
            return text

        def fill(m: re.Match) -> str:
            name = m.group(1)
            if name not in slots:
                raise KeyError(f"template {template!r} uses unknown slot {{{name}}}")
            return choose(slots[name])

        text = _SLOT_RE.sub(fill, text)
    raise ValueError(f"template {template!r} nests slots too deeply")


class Writer:
    """Writes one owner's messages with that owner's random stream."""

    def __init__(
        self,
        persona: Persona,
        shared_templates: Sequence[str],
        shared_slots: Mapping[str, Sequence[str]],
        rng: random.Random,
    ) -> None:
        self.persona = persona
        self.shared_templates = shared_templates
        self.slots = {**shared_slots, **persona.slots}
        self.rng = rng
        self.choose = _Chooser(rng)
        style = persona.style
        self.sub_re = None
        if style.subs:
            keys = sorted(style.subs, key=len, reverse=True)
            self.sub_re = re.compile(r"\b(?:" + "|".join(map(re.escape, keys)) + r")\b")

    def _substitute(self, text: str) -> str:
        style = self.persona.style
        if self.sub_re is None or style.sub_rate <= 0:
            return text

        def repl(m: re.Match) -> str:
            if self.rng.random() < style.sub_rate:
                return self.rng.choice(style.subs[m.group(0)])
            return m.group(0)

        return self.sub_re.sub(repl, text)

    def _punctuate(self, tokens: list[str]) -> list[str]:
        style = self.persona.style
        rng = self.rng
        if style.punct == "none":
            keep_q = rng.random() < style.keep_question
            tokens = [t for t in tokens if t[0].isalnum() or (t == "?" and keep_q)]
        elif style.punct == "minimal":
            tokens = [t for t in tokens if t != ","]
            while tokens and tokens[-1] == ".":
                tokens.pop()
        else:
            if tokens and tokens[-1] not in _TERMINATORS:
                tokens.append(".")
        if tokens and tokens[-1] == "." and rng.random() < style.exclaim_rate:
            tokens[-1] = "!"
        return tokens

    def message(self) -> str:
        """One normalized message of MIN_TOKENS..MAX_TOKENS tokens."""
        p = self.persona
        style = p.style
        rng = self.rng
        best: list[str] = []
        for _ in range(30):
            pool = self.shared_templates if rng.random() < p.shared_rate else p.templates
            text = expand(rng.choice(pool), self.slots, self.choose)
            if style.prefixes and rng.random() < style.prefix_rate:
                text = expand(rng.choice(style.prefixes), self.slots, self.choose) + " " + text
            if style.suffixes and rng.random() < style.suffix_rate:
                if style.punct == "full" and text.rstrip()[-1:] not in _TERMINATORS:
                    text += " ."  # "see you then . thanks ." rather than "see you then thanks ."
                text = text + " " + expand(rng.choice(style.suffixes), self.slots, self.choose)
            tokens = self._punctuate(normalize_text(self._substitute(text)).split())
            if MIN_TOKENS <= len(tokens) <= MAX_TOKENS:
                return " ".join(tokens)
            if len(tokens) > len(best) and len(tokens) <= MAX_TOKENS:
                best = tokens
        # Very unlikely: pad a short draw with a sign-off or cut a long one.
        while len(best) < MIN_TOKENS:
            best += expand("{signoff}", self.slots, self.choose).split()
        return " ".join(best[:MAX_TOKENS])

    def messages(self) -> list[str]:
        lo, hi = self.persona.n_messages
        n = self.rng.randint(lo, hi)
        return [self.message() for _ in range(n)]
