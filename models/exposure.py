"""Exposure of a canary: how much more likely the model finds the planted secret than the other
candidates of its format (Carlini et al. 2019, "The Secret Sharer", USENIX Security).

    log-perplexity   Px(s) = -log2 Pr(s | model), the whole sentence with its </s>
    rank(s)          the position of Px(s) among {Px(r) : r in R}, 1 = the lowest
    exposure(s)      log2 |R| - log2 rank(s)

A model that ranks the secret first gives log2 |R| (13.3 bits for 10^4 candidates); one that
finds it no likelier than a random candidate gives about 1: a uniformly random rank has mean
exposure log2 e ~ 1.44 bits, and when every candidate scores the same the secret shares the mean
rank (|R| + 1) / 2 with all of them (exposure ~ 1). Tied scores always share their mean rank.

Up to `max_exact` candidates (10^5 by default) every candidate is scored: a tree over the slots
shares the recurrent state of each common prefix, so 10^4 candidates cost 1 + 10 + ... + 10^4
model steps, about an evaluation of the demo's validation set. Larger spaces use the paper's
estimates from random candidates: exposure = -log2 Pr_r[Px(r) <= Px(s)], the probability taken
as the share of sampled candidates the secret does not beat; when fewer than `min_hits` of them
beat it (the share would be ~0), from a skew-normal fitted to the sampled log-perplexities
(the paper's extrapolation by distribution modelling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedkey.models.canary import SLOT, CanaryFormat, check_vocabulary
from fedkey.models.model import LanguageModel, State
from fedkey.models.tokenizers import Tokenizer

Method = Literal["exact", "sampled", "skew-normal"]
LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class Exposure:
    exposure: float  # bits: log2 |R| - log2 rank
    rank: float  # 1 = the likeliest candidate; ties share their mean rank; estimated if sampled
    candidates: int  # |R|
    log_perplexity: float  # Px(secret), bits
    method: Method


def word_pieces(fmt: CanaryFormat, tokenizer: Tokenizer, secret: str) -> dict[str, list[int]]:
    """Each word of the format as token ids. A word tokenizer gives one id per word; a
    SentencePiece one may give several, and must cut a sentence where its words are cut."""
    check_vocabulary(tokenizer, fmt.vocabulary(), f"the canary format {fmt.template!r}")
    pieces = {w: tokenizer.encode(w)[1:-1] for w in fmt.vocabulary()}
    joined = [t for w in secret.split() for t in pieces[w]]
    if tokenizer.encode(secret)[1:-1] != joined:
        raise ValueError(
            f"the tokenizer cuts {secret!r} differently from its words one by one; "
            "a canary needs words it reads the same in and out of a sentence"
        )
    return pieces


def _expand(state: State, options: list[State]) -> State:
    """Stack the states each option produced from the same parents: row parent * O + option."""
    if isinstance(state, tuple):
        h = _expand(state[0], [s[0] for s in options if isinstance(s, tuple)])
        c = _expand(state[1], [s[1] for s in options if isinstance(s, tuple)])
        assert isinstance(h, torch.Tensor) and isinstance(c, torch.Tensor)
        return (h, c)
    stacked = torch.stack([s for s in options if isinstance(s, torch.Tensor)], dim=2)
    layers, parents, count, hidden = stacked.shape
    return stacked.reshape(layers, parents * count, hidden)


@torch.no_grad()
def enumerate_log_probs(
    model: LanguageModel, tokenizer: Tokenizer, fmt: CanaryFormat, secret: str
) -> torch.Tensor:
    """ln Pr(candidate) of every candidate of `fmt`, in index order (CanaryFormat.candidate):
    [|R|] float64. A tree over the template: each word's options extend every partial sentence,
    whose recurrent state is shared by all the candidates that start with it."""
    model.eval()
    device = next(model.parameters()).device
    pieces = word_pieces(fmt, tokenizer, secret)
    levels = [[pieces[a] for a in fmt.alphabet] if w == SLOT else [pieces[w]] for w in fmt.words]
    logits, state = model(torch.tensor([[tokenizer.bos_id]], device=device))
    logp = F.log_softmax(logits[:, -1].float(), dim=-1)  # [partial sentences, vocab]
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for depth, options in enumerate(levels):
        last = depth == len(levels) - 1
        totals, states, logps = [], [], []
        for tokens in options:
            t, s, lp = total, state, logp
            for tok in tokens:
                t = t + lp[:, tok].double()
                step = torch.full((t.shape[0], 1), tok, dtype=torch.long, device=device)
                out, s = model(step, s)
                lp = F.log_softmax(out[:, -1].float(), dim=-1)
            totals.append(t)
            states.append(s)
            # After the last word only </s> remains to be scored.
            logps.append(lp[:, tokenizer.eos_id].double() if last else lp)
        total = torch.stack(totals, dim=1).reshape(-1)
        if last:
            return (total + torch.stack(logps, dim=1).reshape(-1)).cpu()
        logp = torch.stack(logps, dim=1).flatten(0, 1)
        state = _expand(state, states)
    raise AssertionError("a canary format has at least one word")


@torch.no_grad()
def sentence_log_probs(
    model: LanguageModel, sequences: list[list[int]], batch_size: int = 512
) -> torch.Tensor:
    """ln Pr of each whole encoded sentence (<s> ... </s>), batched: [len(sequences)] float64."""
    model.eval()
    device = next(model.parameters()).device
    out = torch.empty(len(sequences), dtype=torch.float64)
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk) - 1
        inputs = torch.zeros((len(chunk), width), dtype=torch.long)
        targets = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.bool)
        for i, s in enumerate(chunk):
            n = len(s) - 1
            inputs[i, :n] = torch.tensor(s[:-1])
            targets[i, :n] = torch.tensor(s[1:])
            mask[i, :n] = True
        logits, _ = model(inputs.to(device))
        logp = F.log_softmax(logits.float(), dim=-1).cpu()
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()
        out[start : start + len(chunk)] = (picked * mask).sum(dim=1)
    return out


def rank_among(secret: float, scores: torch.Tensor) -> float:
    """The secret's rank among `scores` (ln Pr of all of R, the secret's own included): 1 + the
    candidates likelier than it, ties sharing their mean rank."""
    better = int((scores > secret).sum())
    equal = int((scores == secret).sum())  # the secret itself at least
    return better + (max(equal, 1) + 1) / 2


def exposure_from_rank(rank: float, candidates: int) -> float:
    return math.log2(candidates) - math.log2(rank)


def _encode(fmt: CanaryFormat, pieces: dict[str, list[int]], tok: Tokenizer, i: int) -> list[int]:
    body = [t for w in fmt.candidate(i).split() for t in pieces[w]]
    return [tok.bos_id, *body, tok.eos_id]


def exposure(
    model: LanguageModel,
    tokenizer: Tokenizer,
    fmt: CanaryFormat,
    secret: str,
    *,
    max_exact: int = 100_000,
    samples: int = 10_000,
    min_hits: int = 10,
    seed: int = 0,
) -> Exposure:
    """The exposure of `secret` (a candidate of `fmt`) under `model`: exact up to `max_exact`
    candidates, else estimated from `samples` random ones (see the module's docstring)."""
    index = fmt.index(secret)
    size = fmt.size
    if size <= max_exact:
        scores = enumerate_log_probs(model, tokenizer, fmt, secret)
        mine = float(scores[index])
        rank = rank_among(mine, scores)
        return Exposure(exposure_from_rank(rank, size), rank, size, -mine * LOG2E, method="exact")
    pieces = word_pieces(fmt, tokenizer, secret)
    rng = np.random.default_rng([seed, 0xCA7A])
    drawn = [int(i) for i in rng.integers(0, size, samples)]
    seqs = [_encode(fmt, pieces, tokenizer, i) for i in [index, *drawn]]
    scores = sentence_log_probs(model, seqs)
    mine, others = float(scores[0]), scores[1:]
    hits = float((others > mine).sum()) + float((others == mine).sum()) / 2
    method: Method = "sampled"
    if hits >= min_hits:
        share = hits / samples
    else:
        share, method = skew_normal_share(others.numpy(), mine), "skew-normal"
    rank = max(1.0, share * size)
    return Exposure(exposure_from_rank(rank, size), rank, size, -mine * LOG2E, method)


def skew_normal_share(log_probs: np.ndarray, secret: float) -> float:
    """Pr[a candidate is at least as likely as the secret] under a skew-normal fitted to the
    sampled log-perplexities (Carlini et al. 2019: their distribution is close to skew-normal)."""
    # scipy: a dependency of dp-accounting, pinned in constraints.txt; it has no type stubs
    from scipy import stats  # type: ignore[import-untyped]

    perplexities = -np.asarray(log_probs, dtype=np.float64)
    shape, loc, scale = stats.skewnorm.fit(perplexities)
    return float(stats.skewnorm.cdf(-secret, shape, loc=loc, scale=scale))


class ExposureProbe:
    """A round metric for fedkey.federation.engine.Federation(probes=...): the exposure and rank of `secret`
    under every round's global model (`canary_exposure`, `canary_rank` in the metrics row)."""

    def __init__(self, fmt: CanaryFormat, secret: str, *, max_exact: int = 100_000) -> None:
        fmt.index(secret)  # refuses a secret that does not fit the format
        self.fmt, self.secret, self.max_exact = fmt, secret, max_exact

    def __call__(self, model: LanguageModel, tokenizer: Tokenizer) -> dict[str, float]:
        e = exposure(model, tokenizer, self.fmt, self.secret, max_exact=self.max_exact)
        return {"canary_exposure": round(e.exposure, 4), "canary_rank": round(e.rank, 1)}
