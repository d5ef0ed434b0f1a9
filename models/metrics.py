"""Evaluation: perplexity, top-1/top-3 next-word accuracy, keystroke savings rate.

Perplexity is exp(total NLL / predicted words), the end of sentence counted as a word. For a
SentencePiece model the NLL of a word is the sum of its pieces' NLLs, so the divisor is still
the number of words + 1 per sentence and the numbers compare with word-level models. The counts
(and the tie rule of every ranking) are fedkey.models.scoring's, shared with the n-grams and the
n-gram mixture (fedkey.models.mixture).

`precision` (fedkey.models.precision): the forward's arithmetic; the log-probabilities and the sums are
float32 whatever it is.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedkey.common.config import Precision
from fedkey.common.text import is_word
from fedkey.models.bar import savings_scores, word_lengths
from fedkey.models.batching import IGNORE, batches, column_batches, seeded_order
from fedkey.models.model import LanguageModel
from fedkey.models.precision import autocast, resolve_precision
from fedkey.models.scoring import Evaluation, Tally, perplexity
from fedkey.models.tokenizers import Tokenizer, WordTokenizer

__all__ = [
    "TEST_FIELDS",
    "Evaluation",
    "Tap",
    "Taps",
    "column_perplexity",
    "encoded_log_probs",
    "evaluate",
    "held_out_scores",
    "keystroke_savings",
    "keystroke_savings_of",
    "ksr_of",
    "next_word_log_probs",
    "perplexity",
    "scoring_order",
    "tally_of",
    "test_fields_of",
    "token_log_probs",
    "unseen_scores",
    "words_of",
]

#: Scores (predicted words x vocabulary) in one evaluation batch: 20 MB of float32, under the
#: 32 MB above which glibc's malloc maps every block afresh instead of reusing its heap. PTB's
#: validation set (a 10k vocabulary: 500 words a batch) scored in 8.4 s against 11.2 s at 64
#: sentences a batch (about 1,500 words), bf16, one thread, best of 3 interleaved.
SCORES = 5_000_000


def scoring_order(seqs: Sequence[list[int]]) -> list[int]:
    """The order :func:`token_log_probs` reads encoded sentences in: shortest first (less padding),
    ties as given. Its batches hold whole sentences, so its targets, concatenated, are those of
    the sentences in this order."""
    return sorted(range(len(seqs)), key=lambda i: len(seqs[i]))


def token_log_probs(
    model: LanguageModel,
    tokenizer: Tokenizer,
    sentences: list[str],
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
) -> Iterator[tuple[Tensor, Tensor]]:
    """Every predicted token of `sentences` (end of sentence included), a batch at a time: its
    target ids [n] and the model's log-probabilities [n, vocab] (float32), on `device`. The
    sentences come shortest first (less padding); what they sum to does not depend on it."""
    seqs = [tokenizer.encode(s) for s in sentences]
    yield from encoded_log_probs(model, seqs, tokenizer.vocab_size, batch_size, device, precision)


def encoded_log_probs(
    model: LanguageModel,
    seqs: list[list[int]],
    vocab_size: int,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
) -> Iterator[tuple[Tensor, Tensor]]:
    """:func:`token_log_probs` of sentences already encoded (`seqs`: <s> ... </s> ids)."""
    model.eval()
    model.to(device)
    resolved = resolve_precision(precision, device)
    order = scoring_order(seqs)
    # At most SCORES scores a batch (see SCORES: larger blocks cost page faults at every batch).
    for inputs, targets in batches(seqs, batch_size, order, max(1, SCORES // vocab_size)):
        keep = targets != IGNORE
        with torch.no_grad(), autocast(resolved, device):
            logits = model.logits_at(inputs.to(device), keep)  # [predicted words, vocab]
        yield targets[keep].to(device), F.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def evaluate(
    model: LanguageModel,
    tokenizer: Tokenizer,
    sentences: list[str],
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
    accuracy: bool = True,
) -> Evaluation:
    """-> {"ppl", "nll", "words", "top1", "top3", "bar_top1", "bar_top3", "all_top1", "all_top3",
    "oov"} on held-out sentences (counted by fedkey.models.scoring.Tally).

    top-k accuracy (word tokenizers only; None for SentencePiece) counts the predictions whose
    target is a real word: not </s> and not <unk>, which a suggestion bar would never show.
    top1/top3 rank the model's own k most likely tokens, </s> and <unk> among them (as the paper
    bench has always scored); bar_top1/bar_top3 rank only the words a bar shows
    (Tokenizer.special_ids left out): what a user sees, and what production keyboards report as
    top-k recall (Hard et al. 2018, "Federated Learning for Mobile Keyboard Prediction", Sec. 5).
    all_top1/all_top3 are the bar's hits over every real word (every target but </s>), an
    out-of-vocabulary one (<unk>) a miss, and oov the share of real words out of the
    vocabulary: a smaller vocabulary cannot look better by leaving the hard words out. Ties go
    to the lower vocabulary id, as in the bar. `accuracy=False` leaves them out (None): a
    validation set is read for its perplexity only.
    """
    return _scored(model, tokenizer, sentences, batch_size, device, precision, accuracy, ())


#: A reader of the model's scores beside the evaluation: called with the (targets [n],
#: log-probabilities [n, vocab]) of every batch, in `scoring_order`.
Tap = Callable[[Tensor, Tensor], None]


@dataclass
class Taps:
    """Other scorers that read the model's scores as :func:`held_out_scores` computes them, so
    that the model runs once (the n-gram mixture, fedkey.models.mixture)."""

    valid: list[Tap] = field(default_factory=list)
    test: list[Tap] = field(default_factory=list)


@torch.no_grad()
def _scored(
    model: LanguageModel,
    tokenizer: Tokenizer,
    sentences: list[str],
    batch_size: int,
    device: torch.device | str,
    precision: Precision,
    accuracy: bool,
    taps: Sequence[Tap],
) -> Evaluation:
    """:func:`evaluate`, each batch also handed to `taps`."""
    seqs = [tokenizer.encode(s) for s in sentences]
    tally = tally_of(model, tokenizer, seqs, batch_size, device, precision, accuracy, taps)
    return tally.result(words_of(tokenizer, sentences))


@torch.no_grad()
def tally_of(
    model: LanguageModel,
    tokenizer: Tokenizer,
    seqs: list[list[int]],
    batch_size: int,
    device: torch.device | str,
    precision: Precision,
    accuracy: bool,
    taps: Sequence[Tap] = (),
) -> Tally:
    """The running sums of encoded sentences (fedkey.models.scoring.Tally; no accuracy: the NLL
    only), each batch also handed to `taps`."""
    tally = Tally.of(tokenizer, accuracy)
    for targets, logp in encoded_log_probs(
        model, seqs, tokenizer.vocab_size, batch_size, device, precision
    ):
        tally.add(targets, logp)
        for tap in taps:
            tap(targets, logp)
    return tally


def words_of(tokenizer: Tokenizer, sentences: Sequence[str]) -> int:
    """The words a set's perplexity is per: its words and each sentence's end."""
    return sum(tokenizer.num_words(s) + 1 for s in sentences)


def held_out_scores(
    model: LanguageModel,
    tokenizer: Tokenizer,
    valid: list[str],
    test: list[str],
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
    ksr_sentences: int = 0,
    taps: Taps | None = None,
    topk: bool = True,
) -> dict[str, float | None]:
    """What every round of a run records of its global model (fedkey.federation.engine), and what `fedkey
    evaluate` scores a checkpoint by: validation perplexity (read for the best round, so no
    accuracy), then TEST_FIELDS: test perplexity, top-1/top-3 on the test set (the model's
    ranking, the bar's, and the bar's over every word), the out-of-vocabulary share, and
    keystroke savings on its first `ksr_sentences` sentences (None: off, or a SentencePiece
    vocabulary). `taps` read the same batches (the validation set's, then the test set's).
    `topk` False: the test set's perplexity only (its top-k fields None)."""
    taps = taps or Taps()
    val = _scored(model, tokenizer, valid, batch_size, device, precision, False, taps.valid)
    scores = _test_scores(
        model, tokenizer, test, batch_size, device, precision, ksr_sentences, taps.test, topk
    )
    return {"val_ppl": val["ppl"], **scores}


#: What _test_scores (and fedkey.runners.baselines' n-gram) reports of held-out sentences, in order.
TEST_FIELDS = (
    "test_ppl", "top1", "top3", "bar_top1", "bar_top3", "all_top1", "all_top3", "oov", "ksr"
)  # fmt: skip


def test_fields_of(scores: Evaluation, ksr: float | None) -> dict[str, float | None]:
    """TEST_FIELDS of an evaluation of test sentences, with their keystroke savings."""
    got = {**scores, "test_ppl": scores["ppl"], "ksr": ksr}
    return {k: got[k] for k in TEST_FIELDS}  # type: ignore[misc]  # the floats of TEST_FIELDS


def _test_scores(
    model: LanguageModel,
    tokenizer: Tokenizer,
    sentences: list[str],
    batch_size: int,
    device: torch.device | str,
    precision: Precision,
    ksr_sentences: int,
    taps: Sequence[Tap] = (),
    topk: bool = True,
) -> dict[str, float | None]:
    """TEST_FIELDS of held-out sentences: perplexity, top-1 and top-3 (the model's ranking and
    the bar's; None without `topk`), keystroke savings on the first `ksr_sentences` (None: off,
    or SentencePiece)."""
    scores = _scored(model, tokenizer, sentences, batch_size, device, precision, topk, taps)
    return test_fields_of(scores, ksr_of(model, tokenizer, sentences, ksr_sentences, precision))


def ksr_of(
    model: LanguageModel,
    tokenizer: Tokenizer,
    sentences: list[str],
    ksr_sentences: int,
    precision: Precision = "fp32",
) -> float | None:
    """Keystroke savings on the first `ksr_sentences` of `sentences`; None when that is 0 or the
    vocabulary is SentencePiece's."""
    if not isinstance(tokenizer, WordTokenizer) or ksr_sentences <= 0:
        return None
    return keystroke_savings(model, tokenizer, sentences[:ksr_sentences], precision=precision)


def unseen_scores(
    model: LanguageModel,
    tokenizer: Tokenizer,
    unseen: list[str],
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
    ksr_sentences: int = 0,
    topk: bool = True,
) -> dict[str, float | None]:
    """The test fields of :func:`held_out_scores` on the messages of held-out senders who never
    trained (``Corpus.unseen_test``), each named ``unseen_<field>`` (``unseen_test_ppl``,
    ``unseen_top1``, ``unseen_bar_top1``, ``unseen_all_top1``, ``unseen_oov``, ...,
    ``unseen_ksr`` on its first `ksr_sentences`); without `topk` the top-k fields None."""
    scores = _test_scores(
        model, tokenizer, unseen, batch_size, device, precision, ksr_sentences, (), topk
    )
    return {f"unseen_{k}": v for k, v in scores.items()}


@torch.no_grad()
def column_perplexity(
    model: LanguageModel,
    tokenizer: Tokenizer,
    sentences: list[str],
    batch_size: int = 128,
    seed: int = 0,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
) -> float:
    """The perplexity the seed papers' published code reported: over the columns of shuffled batches
    of 128 sentences (fedkey.models.batching.column_batches), not over the sentences. That code
    reshuffled at every evaluation; here the order is seeded so that rounds compare."""
    model.eval()
    model.to(device)
    resolved = resolve_precision(precision, device)
    seqs = [tokenizer.encode(s) for s in sentences]
    nll, count = 0.0, 0
    for inputs, targets in column_batches(seqs, batch_size, seeded_order(len(seqs), seed)):
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast(resolved, device):
            logits, _ = model(inputs)
        nll += float(
            F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        )
        count += targets.numel()
    return perplexity(nll / max(count, 1))


def next_word_log_probs(
    model: LanguageModel, precision: Precision = "fp32"
) -> Callable[[list[int]], np.ndarray]:
    """An encoded sentence -> the model's log-probabilities (float32 [words, vocab]) of each of
    its words given the words before it: :func:`keystroke_savings_of`'s `scores_for`."""
    model.eval()
    device = model.decoder.bias.device
    resolved = resolve_precision(precision, device)

    @torch.no_grad()
    def scores(ids: list[int]) -> np.ndarray:
        with autocast(resolved, device):  # the context before each word:
            logits, _ = model(torch.tensor([ids[:-2]], device=device))
        rows: np.ndarray = F.log_softmax(logits[0].float(), dim=-1).cpu().numpy()
        return rows

    return scores


def keystroke_savings(
    model: LanguageModel,
    tokenizer: WordTokenizer,
    sentences: list[str],
    slots: int = 3,
    precision: Precision = "fp32",
) -> float:
    """Keystroke savings of a neural model (see :func:`keystroke_savings_of`)."""
    return keystroke_savings_of(next_word_log_probs(model, precision), tokenizer, sentences, slots)


@dataclass(frozen=True)
class _Bar:
    """A vocabulary as the suggestion bar reads it: the words it may show (a letter or a digit,
    no special token: fedkey.keyboard_web.suggest's rule), their lengths, and those words sorted,
    so that the completions of a prefix are one contiguous range (bisect)."""

    lengths: np.ndarray  # float64 [V]
    hidden: np.ndarray  # bool [V]: the words it never shows
    sorted_words: list[str]
    sorted_ids: np.ndarray  # int64, aligned with sorted_words

    @classmethod
    def of(cls, tokenizer: WordTokenizer) -> _Bar:
        ok = np.array([is_word(w) for w in tokenizer.itos], dtype=bool)
        ok[tokenizer.special_ids] = False
        pairs = sorted((w, i) for i, w in enumerate(tokenizer.itos) if ok[i])
        return cls(
            word_lengths(tokenizer.itos),
            ~ok,
            [w for w, _ in pairs],
            np.array([i for _, i in pairs], dtype=np.int64),
        )

    def completions(self, prefix: str) -> np.ndarray:
        """The ids of the words it may show that start with `prefix` (not empty)."""
        lo = bisect.bisect_left(self.sorted_words, prefix)
        hi = bisect.bisect_left(self.sorted_words, prefix + "\U0010ffff", lo)
        return self.sorted_ids[lo:hi]


def _in_bar(values: np.ndarray, ids: np.ndarray, wid: int, own: float, slots: int) -> bool:
    """Whether the word `wid`, of savings score `own`, is among the `slots` best `values` (the
    scores of the candidates `ids`; ties to the lower id) and not -inf: it saves keystrokes."""
    if not own > -math.inf:
        return False
    ahead = (values > own) | ((values == own) & (ids < wid))
    return int(ahead.sum()) < slots


def keystroke_savings_of(
    scores_for: Callable[[list[int]], np.ndarray],  # encoded sentence -> [words, vocab] scores
    tokenizer: Tokenizer,
    sentences: list[str],
    slots: int = 3,
) -> float:
    """Share of characters a user need not type with the `slots`-wide suggestion bar of
    fedkey.models.bar.

    The user types a sentence word by word; each word costs len(word) + 1 keystrokes (the space).
    Before each keystroke of a word, k characters typed, the bar shows the `slots` words with the
    highest P(w) * (len(w) - k) among the words it may show that start with what is typed and
    are longer (all of them before the first letter); if the intended word is there, one tap
    inserts it with its space: k + 1 keystrokes. A word typed in full is never a tap, and a word
    out of the vocabulary is typed in full. KSR = 1 - keystrokes / characters (Trnka & McCoy
    2008, "Evaluating word prediction: framing keystroke savings").

    `scores_for` gives any model's next-word log-probabilities before each word (or scores that
    differ from them by a constant per position: logits).
    """
    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError("keystroke savings need a word vocabulary")
    bar = _Bar.of(tokenizer)
    every = np.arange(tokenizer.vocab_size)
    typed_chars, keystrokes = 0, 0
    for sentence in sentences:
        words = sentence.split()
        rows = np.asarray(scores_for(tokenizer.encode(sentence))[: len(words)], dtype=np.float64)
        first = savings_scores(rows, bar.lengths, 0)  # nothing typed yet: every word it shows
        first[:, bar.hidden] = -math.inf
        for pos, word in enumerate(words):
            typed_chars += len(word) + 1
            cost = len(word) + 1
            wid = tokenizer.stoi.get(word, tokenizer.unk_id)
            for k in range(0 if bar.hidden[wid] else len(word)):  # k letters typed, then a tap
                if k == 0:
                    ids, values, own = every, first[pos], first[pos, wid]
                else:  # the completions of what is typed; the word itself saves len - k
                    ids = bar.completions(word[:k])
                    values = savings_scores(rows[pos, ids], bar.lengths[ids], k)
                    own = savings_scores(rows[pos, [wid]], bar.lengths[[wid]], k)[0]
                if _in_bar(values, ids, wid, own, slots):
                    cost = k + 1
                    break
            keystrokes += cost
    return 1.0 - keystrokes / max(typed_chars, 1)
