"""Evaluation: perplexity, top-1/top-3 next-word accuracy, keystroke savings rate.

Perplexity is exp(total NLL / predicted words), the end of sentence counted as a word. For a
SentencePiece model the NLL of a word is the sum of its pieces' NLLs, so the divisor is still
the number of words + 1 per sentence and the numbers compare with word-level models.

`precision` (fedkey.models.precision): the forward's arithmetic; the log-probabilities and the sums are
float32 whatever it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TypedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedkey.common.config import Precision
from fedkey.models.batching import IGNORE, batches, column_batches, seeded_order
from fedkey.models.model import LanguageModel
from fedkey.models.precision import autocast, resolve_precision
from fedkey.models.tokenizers import Tokenizer, WordTokenizer

#: Scores (predicted words x vocabulary) in one evaluation batch: 20 MB of float32, under the
#: 32 MB above which glibc's malloc maps every block afresh instead of reusing its heap. PTB's
#: validation set (a 10k vocabulary: 500 words a batch) scored in 8.4 s against 11.2 s at 64
#: sentences a batch (about 1,500 words), bf16, one thread, best of 3 interleaved.
SCORES = 5_000_000


class Evaluation(TypedDict):
    """What :func:`evaluate` (and the n-gram models' `evaluate`) report on held-out sentences."""

    ppl: float
    nll: float
    words: int
    top1: float | None  # None for SentencePiece, or when no target is a real word
    top3: float | None
    bar_top1: float | None  # the suggestion bar's ranking: </s> and <unk> never shown
    bar_top3: float | None


def perplexity(mean_nll: float) -> float:
    """exp(mean NLL), inf past the float range (a diverged model: a x100 update, say)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


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
    model.eval()
    model.to(device)
    resolved = resolve_precision(precision, device)
    seqs = [tokenizer.encode(s) for s in sentences]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    # At most SCORES scores a batch (see SCORES: larger blocks cost page faults at every batch).
    for inputs, targets in batches(seqs, batch_size, order, max(1, SCORES // tokenizer.vocab_size)):
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
    """-> {"ppl", "nll", "words", "top1", "top3", "bar_top1", "bar_top3"} on held-out sentences.

    top-k accuracy (word tokenizers only; None for SentencePiece) counts the predictions whose
    target is a real word: not </s> and not <unk>, which a suggestion bar would never show.
    top1/top3 rank the model's own k most likely tokens, </s> and <unk> among them (as the paper
    bench has always scored); bar_top1/bar_top3 rank only the words a bar shows
    (Tokenizer.special_ids left out): what a user sees, and what production keyboards report as
    top-k recall (Hard et al. 2018, "Federated Learning for Mobile Keyboard Prediction", Sec. 5).
    `accuracy=False` leaves them out (None): the top-3 search is about a quarter of the time, and
    a validation set is read for its perplexity only.
    """
    nll, scored = 0.0, 0
    hits = {"top1": 0, "top3": 0, "bar_top1": 0, "bar_top3": 0}
    word_level = accuracy and isinstance(tokenizer, WordTokenizer)
    for targets, logp in token_log_probs(
        model, tokenizer, sentences, batch_size, device, precision
    ):
        nll += float(F.nll_loss(logp, targets, reduction="sum"))
        if word_level:
            real = (targets != tokenizer.eos_id) & (targets != tokenizer.unk_id)
            for prefix in ("", "bar_"):
                if prefix:  # the bar's ranking: the specials never shown
                    logp[:, tokenizer.special_ids] = -math.inf
                match = logp.topk(3, dim=-1).indices == targets.unsqueeze(-1)
                hits[prefix + "top1"] += int((match[..., 0] & real).sum())
                hits[prefix + "top3"] += int((match.any(-1) & real).sum())
            scored += int(real.sum())
    words = sum(tokenizer.num_words(s) + 1 for s in sentences)
    shares = {k: (v / scored if word_level and scored else None) for k, v in hits.items()}
    return {"ppl": perplexity(nll / max(words, 1)), "nll": nll, "words": words,
            **shares}  # type: ignore[typeddict-item]  # fmt: skip


def held_out_scores(
    model: LanguageModel,
    tokenizer: Tokenizer,
    valid: list[str],
    test: list[str],
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
    ksr_sentences: int = 0,
) -> dict[str, float | None]:
    """What every round of a run records of its global model (fedkey.federation.engine), and what `fedkey
    evaluate` scores a checkpoint by: validation perplexity (read for the best round, so no
    accuracy), test perplexity, top-1/top-3 on the test set (the model's ranking and the bar's),
    and keystroke savings on its first `ksr_sentences` sentences (None: off, or a SentencePiece
    vocabulary)."""
    val = evaluate(model, tokenizer, valid, batch_size, device, precision, accuracy=False)
    scores = _test_scores(model, tokenizer, test, batch_size, device, precision, ksr_sentences)
    return {"val_ppl": val["ppl"], **scores}


#: What _test_scores (and fedkey.runners.baselines' n-gram) reports of held-out sentences, in order.
TEST_FIELDS = ("test_ppl", "top1", "top3", "bar_top1", "bar_top3", "ksr")


def _test_scores(
    model: LanguageModel,
    tokenizer: Tokenizer,
    sentences: list[str],
    batch_size: int,
    device: torch.device | str,
    precision: Precision,
    ksr_sentences: int,
) -> dict[str, float | None]:
    """TEST_FIELDS of held-out sentences: perplexity, top-1 and top-3 (the model's ranking and
    the bar's), keystroke savings on the first `ksr_sentences` (None: off, or SentencePiece)."""
    scores = evaluate(model, tokenizer, sentences, batch_size, device, precision)
    ksr = None
    if isinstance(tokenizer, WordTokenizer) and ksr_sentences > 0:
        ksr = keystroke_savings(model, tokenizer, sentences[:ksr_sentences], precision=precision)
    return {"test_ppl": scores["ppl"], "top1": scores["top1"], "top3": scores["top3"],
            "bar_top1": scores["bar_top1"], "bar_top3": scores["bar_top3"], "ksr": ksr}  # fmt: skip


def unseen_scores(
    model: LanguageModel,
    tokenizer: Tokenizer,
    unseen: list[str],
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: Precision = "fp32",
    ksr_sentences: int = 0,
) -> dict[str, float | None]:
    """The test fields of :func:`held_out_scores` on the messages of held-out senders who never
    trained (``Corpus.unseen_test``), each named ``unseen_<field>`` (``unseen_test_ppl``,
    ``unseen_top1``, ``unseen_bar_top1``, ..., ``unseen_ksr`` on its first `ksr_sentences`)."""
    scores = _test_scores(model, tokenizer, unseen, batch_size, device, precision, ksr_sentences)
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


@torch.no_grad()
def keystroke_savings(
    model: LanguageModel,
    tokenizer: WordTokenizer,
    sentences: list[str],
    slots: int = 3,
    precision: Precision = "fp32",
) -> float:
    """Keystroke savings of a neural model (see :func:`keystroke_savings_of`)."""
    model.eval()
    device = model.decoder.bias.device
    resolved = resolve_precision(precision, device)

    def scores(ids: list[int]) -> np.ndarray:
        with autocast(resolved, device):  # the context before each word:
            logits, _ = model(torch.tensor([ids[:-2]], device=device))
        row_scores: np.ndarray = logits[0].float().cpu().numpy()
        return row_scores

    return keystroke_savings_of(scores, tokenizer, sentences, slots)


def keystroke_savings_of(
    scores_for: Callable[[list[int]], np.ndarray],  # encoded sentence -> [words, vocab] scores
    tokenizer: Tokenizer,
    sentences: list[str],
    slots: int = 3,
) -> float:
    """Share of characters a user need not type with a `slots`-wide suggestion bar.

    The user types a sentence word by word; each word costs len(word) + 1 keystrokes (the space).
    Before each keystroke of a word the bar shows the `slots` most likely vocabulary words that
    start with what is typed so far (next words when nothing is typed yet); if the intended word
    is there, one tap inserts it with its space. KSR = 1 - keystrokes / characters.
    `scores_for` gives any model's next-word scores (higher = likelier) before each word.
    """
    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError("keystroke savings need a word vocabulary")
    vocab = np.array(tokenizer.itos, dtype=object)
    suggestible = np.ones(len(vocab), dtype=bool)
    suggestible[tokenizer.special_ids] = False
    first_char = np.array([v[:1] for v in tokenizer.itos], dtype=object)
    typed_chars, keystrokes = 0, 0
    for sentence in sentences:
        words = sentence.split()
        scores = scores_for(tokenizer.encode(sentence))
        for pos, word in enumerate(words):
            typed_chars += len(word) + 1
            cost = len(word) + 1
            wid = tokenizer.stoi.get(word)
            if wid is not None and suggestible[wid]:
                s = scores[pos]
                better = (s > s[wid]) & suggestible
                # The words ranked above the intended one that still match what is typed; each
                # letter narrows the previous set (the first one with a vectorized comparison).
                rivals: list[str] = []
                for k in range(len(word)):
                    if k == 0:
                        rank = int(better.sum())
                    elif k == 1:
                        rivals = list(vocab[better & (first_char == word[0])])
                        rank = len(rivals)
                    else:
                        rivals = [v for v in rivals if v.startswith(word[:k])]
                        rank = len(rivals)
                    if rank < slots:
                        cost = k + 1  # k letters typed, then one tap
                        break
            keystrokes += cost
    return 1.0 - keystrokes / max(typed_chars, 1)
