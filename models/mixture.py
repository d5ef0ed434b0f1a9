"""The keyboard's model mixed with a Kneser-Ney n-gram, and that mixture scored.

Linear interpolation (Mikolov et al. 2010, "Recurrent neural network based language model", Sec.
3; Gboard's decoder likewise mixes an n-gram with its neural model): p(w) = lam * p_nn(w) +
(1 - lam) * p_kn(w), lam from GRID (0, 0.05, ..., 1) with the lowest perplexity on the
VALIDATION text (:func:`choose_weight`: the targets' probabilities are all it needs).

:func:`evaluate_mixture` scores the mixture on held-out text exactly as the model is scored
(fedkey.models.metrics.evaluate: the same batches, the same fedkey.models.scoring.Tally, so lam = 1
gives the model's figures and lam = 0 the n-gram's), and :func:`mixture_keystroke_savings` its
keystroke savings (fedkey.models.metrics.keystroke_savings_of). A run with an n-gram
(fedkey.federation.engine, `--ngram`) scores the mixture every round with :class:`NgramMixture`,
which reads the model's scores as the round's own evaluation computes them
(fedkey.models.metrics.Taps) and keeps what of the n-gram the held-out text needs from the first
round on (see there).

The n-gram is used through its public interface alone: `distribution(context)` (the sentence so
far, from its <s>), `tokenizer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from fedkey.common.config import Precision
from fedkey.models.metrics import (
    Taps,
    keystroke_savings_of,
    next_word_log_probs,
    scoring_order,
    token_log_probs,
)
from fedkey.models.model import LanguageModel
from fedkey.models.ngram import mix
from fedkey.models.scoring import Evaluation, Tally, perplexity, target_ranks
from fedkey.models.tokenizers import Tokenizer, WordTokenizer

if TYPE_CHECKING:
    from fedkey.models.ngram import KneserNey

#: The mixture weights tried on the validation text: 0, 0.05, ..., 1 (lam: the model's share).
GRID = tuple(i / 20 for i in range(21))
#: The n-gram's likeliest words kept per test position for the rounds' top-1 (NgramMixture).
KEPT = 16
#: The fields a round's metrics row gains from the mixture, in order.
MIX_FIELDS = (
    "ngram_weight", "mix_val_ppl", "mix_test_ppl", "mix_bar_top1", "mix_all_top1", "mix_ksr"
)  # fmt: skip


def check_vocabulary(ngram: KneserNey, tokenizer: Tokenizer) -> None:
    """A ValueError (one line) unless the n-gram's vocabulary is the model's, word for word."""
    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError("an n-gram mixes with a word-vocabulary model only (--tokenizer word)")
    mine, its = tokenizer.itos, ngram.tokenizer.itos
    if list(mine) != list(its):
        raise ValueError(
            f"the n-gram's vocabulary ({len(its)} words) is not the model's ({len(mine)} words): "
            "fit the n-gram on the model's own vocabulary"
        )


def _nll(model_log_probs: np.ndarray, ngram_probs: np.ndarray, lam: float) -> float:
    """The negative log-likelihood of targets of these probabilities under the mixture."""
    with np.errstate(divide="ignore"):
        return -float(np.log(mix(model_log_probs, ngram_probs, lam)).sum())


def choose_weight(
    model_log_probs: np.ndarray, ngram_probs: np.ndarray, words: int, grid: Sequence[float] = GRID
) -> tuple[float, float]:
    """(lam, perplexity): the weight of `grid` under which the mixture's perplexity of the
    targets is lowest (the first of equals), from the model's log-probabilities and the
    n-gram's probabilities of the same targets; `words` divides the NLL (the predicted words)."""
    ppl = {lam: perplexity(_nll(model_log_probs, ngram_probs, lam) / max(words, 1)) for lam in grid}
    best = min(grid, key=ppl.__getitem__)
    return best, ppl[best]


def ngram_rows(ngram: KneserNey, ids: list[int]) -> np.ndarray:
    """[len(ids) - 1, vocab] float64: the n-gram's next-word probabilities at each position of an
    encoded sentence."""
    return np.stack([ngram.distribution(ids[: i + 1]) for i in range(len(ids) - 1)])


def _row_batches(ngram: KneserNey, seqs: list[list[int]]) -> Callable[[int], np.ndarray]:
    """A reader of the n-gram's rows of `seqs` in fedkey.models.metrics.scoring_order: called with
    a batch's size n, it returns the next n rows (whole sentences, as the batches hold them)."""
    order = iter(scoring_order(seqs))

    def take(n: int) -> np.ndarray:
        rows: list[np.ndarray] = []
        while sum(len(r) for r in rows) < n:
            rows.append(ngram_rows(ngram, seqs[next(order)]))
        if sum(len(r) for r in rows) != n:
            raise RuntimeError("the n-gram's rows are out of step with the model's batches")
        return np.concatenate(rows)

    return take


@torch.no_grad()
def evaluate_mixture(
    model: LanguageModel,
    ngram: KneserNey,
    sentences: list[str],
    lam: float,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
) -> Evaluation:
    """fedkey.models.metrics.evaluate of the mixture lam * model + (1 - lam) * n-gram: the same
    batches of the model's log-probabilities, each row mixed with the n-gram's, counted by the
    same Tally (ppl, top1/top3, bar_top1/bar_top3, all_top1/all_top3, oov)."""
    tokenizer = ngram.tokenizer
    take = _row_batches(ngram, [tokenizer.encode(s) for s in sentences])
    tally = Tally.of(tokenizer)
    for targets, logp in token_log_probs(
        model, tokenizer, sentences, batch_size, device, precision
    ):
        t = targets.cpu().numpy()
        p = mix(logp.cpu().numpy(), take(len(t)), lam)
        with np.errstate(divide="ignore"):
            tally.add(t, p, np.log(p[np.arange(len(t)), t]))
    return tally.result(sum(tokenizer.num_words(s) + 1 for s in sentences))


def mixture_keystroke_savings(
    model: LanguageModel,
    ngram: KneserNey,
    sentences: list[str],
    lam: float,
    precision: Precision = "fp32",
) -> float:
    """fedkey.models.metrics.keystroke_savings_of the mixture (the bar of fedkey.models.bar ranks
    its probabilities)."""
    model_rows = next_word_log_probs(model, precision)

    def scores(ids: list[int]) -> np.ndarray:
        words = len(ids) - 2
        with np.errstate(divide="ignore"):
            mixed: np.ndarray = np.log(mix(model_rows(ids), ngram_rows(ngram, ids)[:words], lam))
        return mixed

    return keystroke_savings_of(scores, ngram.tokenizer, sentences)


@dataclass
class _Held:
    """What of the n-gram a held-out text needs, per target in scoring order (the model's
    batches): the targets, the n-gram's probability of each; for the test text also its `kept`
    likeliest words that a bar shows (`top_ids`, `top_probs`), the highest probability of a shown
    word outside them (`bound`), and each target's sentence and position (`contexts`: the exact
    row when the kept words do not decide)."""

    targets: np.ndarray  # int64 [N]
    probs: np.ndarray  # float64 [N]
    words: int
    top_ids: np.ndarray  # int64 [N, kept] (empty [N, 0] for a validation text)
    top_probs: np.ndarray  # float64 [N, kept]
    bound: np.ndarray  # float64 [N]
    contexts: list[tuple[list[int], int]]  # (encoded sentence, position of the target)


def _top(rows: np.ndarray, shown: np.ndarray, kept: int) -> tuple[np.ndarray, ...]:
    """(ids, probabilities) of each row's `kept` likeliest `shown` words, and the highest
    probability of a shown word left out (0 when none is)."""
    r = rows[:, shown]
    if kept >= r.shape[1]:
        return np.tile(shown, (len(r), 1)), r, np.zeros(len(r))
    part = np.argpartition(-r, kept, axis=1)[:, : kept + 1]  # the kept + 1 likeliest, the last
    top = part[:, :kept]
    return shown[top], np.take_along_axis(r, top, 1), r[np.arange(len(r)), part[:, kept]]


def _held(ngram: KneserNey, sentences: list[str], kept: int) -> _Held:
    """The n-gram's side of `sentences` (see _Held); `kept` 0: the targets' probabilities only."""
    tokenizer = ngram.tokenizer
    seqs = [tokenizer.encode(s) for s in sentences]
    shown = np.setdiff1d(np.arange(tokenizer.vocab_size), tokenizer.special_ids)
    targets: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    top: list[np.ndarray] = []
    bound: list[np.ndarray] = []
    contexts: list[tuple[list[int], int]] = []
    for i in scoring_order(seqs):
        rows, t = ngram_rows(ngram, seqs[i]), np.asarray(seqs[i][1:], dtype=np.int64)
        targets.append(t)
        probs.append(rows[np.arange(len(t)), t])
        if kept:
            for got, part in zip((ids, top, bound), _top(rows, shown, kept), strict=True):
                got.append(part)
            contexts += [(seqs[i], pos) for pos in range(len(t))]
    n = sum(len(t) for t in targets)
    return _Held(
        np.concatenate(targets) if targets else np.zeros(0, np.int64),
        np.concatenate(probs) if probs else np.zeros(0),
        n,
        np.concatenate(ids) if ids else np.zeros((n, 0), np.int64),
        np.concatenate(top) if top else np.zeros((n, 0)),
        np.concatenate(bound) if bound else np.zeros(n),
        contexts,
    )


def _target_log_probs(targets: Tensor, logp: Tensor) -> np.ndarray:
    """The model's log-probability of each target, float64 on the CPU."""
    return logp.gather(1, targets[:, None])[:, 0].double().cpu().numpy()


class NgramMixture:
    """A run's n-gram beside its model: each round's mixture scores (MIX_FIELDS) for the model
    the round evaluates, reading the batches the round's own evaluation computes
    (:meth:`round`: its `taps`), so the model runs no further pass over the held-out text.

    The n-gram's side of the validation and test text never changes, so it is computed once, at
    the first round, in `scoring_order`: each target's probability and, for the test text, the
    n-gram's `kept` likeliest shown words at each position. A round's mixture top-1 needs no
    full n-gram row then: the target is the bar's first when no kept word beats it and the best
    word of the model outside them cannot, even with the n-gram's highest probability left out;
    a position where that does not decide is ranked on its exact row (fedkey.models.scoring's
    rule, the same as :func:`evaluate_mixture`'s, which tests/models/test_mixture.py holds it to).
    """

    def __init__(
        self,
        ngram: KneserNey,
        tokenizer: Tokenizer,
        valid: list[str],
        test: list[str],
        ksr_sentences: int = 0,
        kept: int = KEPT,
    ):
        check_vocabulary(ngram, tokenizer)
        self.ngram, self.valid, self.test = ngram, valid, test
        self.ksr_sentences, self.kept = ksr_sentences, kept
        self._held: tuple[_Held, _Held] | None = None

    def held(self) -> tuple[_Held, _Held]:
        """The n-gram's side of the validation and test text (computed on the first call)."""
        if self._held is None:
            self._held = (_held(self.ngram, self.valid, 0), _held(self.ngram, self.test, self.kept))
        return self._held

    def round(self) -> MixtureRound:
        """The scorer of one round's model (its taps: fedkey.models.metrics.held_out_scores')."""
        return MixtureRound(self, *self.held())


class MixtureRound:
    """One round's mixture: `taps` read the model's validation and test batches; then
    :meth:`fields` gives the row's MIX_FIELDS."""

    def __init__(self, mixture: NgramMixture, valid: _Held, test: _Held):
        self.mixture, self.valid_held, self.test_held = mixture, valid, test
        tokenizer = mixture.ngram.tokenizer
        self.special, self.unk, self.eos = tokenizer.special_ids, tokenizer.unk_id, tokenizer.eos_id
        self.valid_model: list[np.ndarray] = []  # the model's log-probabilities of the targets
        self.test_model: list[np.ndarray] = []
        self.lam: float | None = None
        self.val_ppl = math.nan
        self.hits = self.known = self.real = 0
        self.taps = Taps(valid=[self._read_valid], test=[self._read_test])

    def _read_valid(self, targets: Tensor, logp: Tensor) -> None:
        self.valid_model.append(_target_log_probs(targets, logp))

    def weight(self) -> float:
        """lam, chosen on the validation batches read so far (all of them once the test's come)."""
        if self.lam is None:
            model = np.concatenate(self.valid_model) if self.valid_model else np.zeros(0)
            held = self.valid_held
            if len(model) != len(held.probs):
                raise RuntimeError("the validation batches do not match the n-gram's targets")
            self.lam, self.val_ppl = choose_weight(model, held.probs, held.words)
        return self.lam

    def _read_test(self, targets: Tensor, logp: Tensor) -> None:
        lam, held = self.weight(), self.test_held
        start = sum(len(a) for a in self.test_model)
        span = slice(start, start + len(targets))
        t = targets.cpu().numpy()
        if not np.array_equal(t, held.targets[span]):
            raise RuntimeError("the test batches are out of step with the n-gram's targets")
        model = _target_log_probs(targets, logp)
        self.test_model.append(model)
        known = (t != self.eos) & (t != self.unk)
        hit = self._first(logp, t, model, span, lam) & known
        self.hits += int(hit.sum())
        self.known += int(known.sum())
        self.real += int((t != self.eos).sum())

    def _first(
        self, logp: Tensor, t: np.ndarray, model: np.ndarray, span: slice, lam: float
    ) -> np.ndarray:
        """Whether each target is the bar's first word under the mixture (see NgramMixture)."""
        held = self.test_held
        own = mix(model, held.probs[span], lam)
        ids = held.top_ids[span]
        index = torch.as_tensor(ids, device=logp.device)
        kept = mix(logp.gather(1, index).double().cpu().numpy(), held.top_probs[span], lam)
        beats = (kept > own[:, None]) | ((kept == own[:, None]) & (ids < t[:, None]))
        beaten = (beats & (ids != t[:, None])).any(1)
        # The model's best shown word outside the kept ones (and not the target itself).
        rest = logp.clone()
        rest.scatter_(1, index, -math.inf)
        rest[:, self.special] = -math.inf
        rest.scatter_(1, torch.as_tensor(t, device=logp.device)[:, None], -math.inf)
        best = rest.max(1).values.double().cpu().numpy()
        at_most = mix(best, held.bound[span], lam)  # what an outside word can reach
        at_least = mix(best, np.zeros(len(t)), lam)  # what the model's best outside one has
        first: np.ndarray = ~beaten & (at_most < own)
        open_ = ~beaten & ~first & ~(at_least > own) & ~np.isnan(own)  # NaN: a diverged model
        for j in np.flatnonzero(open_):
            first[j] = self._exact(logp[j], int(t[j]), span.start + j, lam)
        return first

    def _exact(self, logp: Tensor, target: int, index: int, lam: float) -> bool:
        """Whether `target` is the bar's first on the exact mixed row of test position `index`."""
        ids, pos = self.test_held.contexts[index]
        row = mix(logp.cpu().numpy()[None], self.mixture.ngram.distribution(ids[: pos + 1]), lam)
        _, bar = target_ranks(row, np.array([target]), self.special)
        return bool(bar[0] < 1)

    def fields(
        self, model: LanguageModel, precision: Precision = "fp32"
    ) -> dict[str, float | None]:
        """MIX_FIELDS: lam, the mixture's validation and test perplexity, its bar top-1 over the
        words in the vocabulary and over every word, its keystroke savings on the first
        `ksr_sentences` test sentences (None: off)."""
        lam, held, mixture = self.weight(), self.test_held, self.mixture
        got = np.concatenate(self.test_model) if self.test_model else np.zeros(0)
        if len(got) != len(held.probs):
            raise RuntimeError("the test batches do not match the n-gram's targets")
        ksr = None
        if mixture.ksr_sentences > 0:
            text = mixture.test[: mixture.ksr_sentences]
            ksr = mixture_keystroke_savings(model, mixture.ngram, text, lam, precision)
        return {
            "ngram_weight": lam,
            "mix_val_ppl": self.val_ppl,
            "mix_test_ppl": perplexity(_nll(got, held.probs, lam) / max(held.words, 1)),
            "mix_bar_top1": self.hits / self.known if self.known else None,
            "mix_all_top1": self.hits / self.real if self.real else None,
            "mix_ksr": ksr,
        }
