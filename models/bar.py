"""The suggestion bar's ranking: the three slots filled for keystrokes saved, not probability alone.

One rule, shared by the keyboard that shows the bar (fedkey.keyboard_web.suggest, and its port in
keyboard_web/static/suggest.js) and the keystroke-savings measure that scores it
(fedkey.models.metrics.keystroke_savings_of).

With `k` characters of a word typed, tapping a suggested word w inserts it and its space: one
keystroke instead of the len(w) - k letters left and the space, so it saves len(w) - k keystrokes.
A slot is worth P(w) * (len(w) - k), the keystrokes it saves on average, and the bar shows the
three best (as the expected-savings ranking of the KSR literature: Trnka & McCoy 2008, "Evaluating
word prediction: framing keystroke savings"). So:

- a word the user has already typed in full saves nothing and never takes a slot;
- while a word is typed, only completions of its prefix are shown (no other word can be tapped
  usefully), the likeliest long ones first;
- with nothing typed, a long likely word outranks a short one slightly likelier ("because" over
  "i" when they are close), which is what the user's thumbs feel.

Top-1 and top-3 accuracy stay the model's ranking by probability (what the literature reports);
keystroke savings measure this bar.
"""

from __future__ import annotations

import numpy as np

__all__ = ["savings_scores", "word_lengths"]


def word_lengths(words: list[str]) -> np.ndarray:
    """The length in characters of each vocabulary word, as float64 (for `savings_scores`)."""
    return np.fromiter((len(w) for w in words), dtype=np.float64, count=len(words))


def savings_scores(logprobs: np.ndarray, lengths: np.ndarray, typed: int) -> np.ndarray:
    """log(P(w) * (len(w) - typed)) for each candidate (-inf where the word saves nothing).

    `logprobs` and `lengths` are aligned (any subset of the vocabulary, e.g. the completions of the
    typed prefix); the bar shows the three highest, best first."""
    left = lengths - typed
    with np.errstate(divide="ignore"):
        gain = np.where(left > 0, np.log(np.maximum(left, 1e-300)), -np.inf)
    return logprobs.astype(np.float64) + gain
