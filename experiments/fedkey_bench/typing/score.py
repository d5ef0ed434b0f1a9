"""The scoring of `fedkey-bench typing`: every keyboard of a population on the same held-out
messages, each sender's in time order, with the personal cache off and on.

A keyboard is a next-word model: a Kneser-Ney 3-gram alone (fedkey.models.ngram), a neural model
alone, or the two mixed, p = lam * p_nn + (1 - lam) * p_kn (fedkey.models.mixture.mix; Mikolov
et al. 2010), lam chosen on the population's VALIDATION messages by
fedkey.models.mixture.choose_weight (the lowest validation perplexity over its GRID), never on
the messages it is scored on. The neural model is run once per message on ids[:-1], one torch
thread, its log_softmax exponentiated.

Each keyboard is scored by one fedkey.models.personal_eval.evaluate_personal pass over a
held-out set ({sender: messages in time order}) with two settings: the cache off (max_weight 0,
the keyboard alone) and fedkey.models.personal.DEFAULTS (the cache of the sender's earlier
messages mixed in; Kuhn & De Mori 1990). The fields are evaluate_personal's (all_top1, all_top3,
bar_top1, bar_top3, ksr, oov) and, without the cache, the perplexity of the targets, </s>
counted, as fedkey.models.metrics computes it. `seconds` is the pass's wall time (both settings:
the model is run once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedkey.models.mixture import choose_weight, mix, ngram_rows
from fedkey.models.ngram import KneserNey
from fedkey.models.personal import DEFAULTS
from fedkey.models.personal_eval import PersonalEvaluation, by_sender, evaluate_personal
from fedkey.models.scoring import perplexity
from fedkey.models.tokenizers import Tokenizer, WordTokenizer
from fedkey_bench.typing.report import REFERENCE

if TYPE_CHECKING:
    from fedkey.models.model import LanguageModel

#: An encoded message -> the model's log-probabilities of each next token, [len(ids) - 1, V].
LogProbs = Callable[[list[int]], np.ndarray]
#: An encoded message -> a keyboard's next-token probabilities, [len(ids) - 1, V].
Probs = Callable[[list[int]], np.ndarray]

#: The two cache settings of every pass: off (the keyboard alone) and the shipped defaults.
CACHE_SETTINGS = ({**DEFAULTS, "max_weight": 0.0}, dict(DEFAULTS))
#: The figures every row states as a multiple of the reference row's (row (a)).
RATIOS = ("all_top1", "ksr")
#: Row (a)'s vocabulary: the most frequent words of the phones' pooled text.
COLLECTED_VOCAB = 10_000


@dataclass
class HeldOut:
    """A population's text as the scoring reads it."""

    valid: list[str]  # the phones' validation messages: the mixture weight is chosen on them
    sets: dict[str, dict[str, list[str]]]  # report.SETS key -> {sender: messages in time order}
    pooled: list[str]  # the phones' training messages, pooled: row (a)'s text


def first_senders(senders: Mapping[str, list[str]], n: int | None) -> dict[str, list[str]]:
    """The first `n` senders (None: all), in the order given."""
    return dict(list(senders.items())[:n] if n is not None else senders.items())


def load_held_out(data: str, clients: int, max_senders: int | None = None,
                  seed: int = 0) -> HeldOut:  # fmt: skip
    """The held-out text of `data` as `fedkey simulate --data DATA --partition user --clients
    CLIENTS` cuts it (fedkey.corpora.dataset.load_cut): the phones' validation and later (test)
    messages, the held-out senders' (unseen_test), the phones' pooled training text; each
    held-out set cut to its first `max_senders` senders."""
    from fedkey.common.config import DataConfig
    from fedkey.corpora.dataset import load_cut
    from fedkey.corpora.partition import partition

    cfg = DataConfig(data=data, partition="user", clients=clients, seed=seed)
    corpus, _ = load_cut(cfg)
    if corpus.test_users is None or corpus.valid_users is None:
        raise ValueError(f"{data}: no senders to its held-out messages (a per-sender corpus)")
    sets = {"phones": by_sender(corpus.test, corpus.test_users)}
    if corpus.unseen_test and corpus.unseen_users:
        sets["unseen"] = by_sender(corpus.unseen_test, corpus.unseen_users)
    shards = partition(corpus, "user", clients, seed)
    return HeldOut(
        valid=list(corpus.valid),
        sets={k: first_senders(v, max_senders) for k, v in sets.items()},
        pooled=[corpus.train[j] for shard in shards for j in shard],
    )


# -- the keyboards -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Keyboard:
    """One row: a neural model, a 3-gram, or both mixed (lam chosen on validation text)."""

    id: str
    label: str
    kind: str  # "collected" (a), "public" (b), "base" (c, d), "federated" / "central" (e)
    tokenizer: WordTokenizer
    model: LogProbs | None = None
    ngram: KneserNey | None = None
    run: str | None = None  # the run whose checkpoint this is
    round: int | None = None  # that checkpoint's round


def model_log_probs(model: LanguageModel) -> LogProbs:
    """The model's log-probabilities of each next token of an encoded message: one forward
    pass over ids[:-1], log_softmax in float32."""
    import torch
    import torch.nn.functional as F

    model.eval()

    def rows(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids[:-1]], dtype=torch.long))
        out: np.ndarray = F.log_softmax(logits[0].float(), dim=-1).numpy()
        return out

    return rows


def probabilities(keyboard: Keyboard, lam: float | None) -> Probs:
    """The keyboard's next-token probabilities: the 3-gram's, the model's, or their mixture at
    lam (the model's share)."""
    model, ngram = keyboard.model, keyboard.ngram
    if model is None and ngram is not None:
        return lambda ids: ngram_rows(ngram, ids)
    if model is not None and ngram is None:
        return lambda ids: np.exp(model(ids).astype(np.float64))
    if model is not None and ngram is not None and lam is not None:
        return lambda ids: mix(model(ids), ngram_rows(ngram, ids), lam)
    raise ValueError(f"{keyboard.id}: a model, a 3-gram, or both with a mixture weight")


def _targets(rows: np.ndarray, ids: list[int]) -> np.ndarray:
    """Each row's probability (or log-probability) of its target ids[1:]."""
    t = np.asarray(ids[1:], dtype=np.int64)
    picked: np.ndarray = rows[np.arange(len(t)), t]
    return picked


class ValidationText:
    """The validation messages encoded once, and the 3-grams' probabilities of their targets
    (the same for every model mixed with one 3-gram)."""

    def __init__(self, tokenizer: Tokenizer, messages: Sequence[str]):
        self.encoded = [tokenizer.encode(m) for m in messages]
        self.words = sum(len(ids) - 1 for ids in self.encoded)  # </s> counted
        self._ngram: dict[int, np.ndarray] = {}

    def ngram_targets(self, ngram: KneserNey) -> np.ndarray:
        if id(ngram) not in self._ngram:
            parts = [_targets(ngram_rows(ngram, ids), ids) for ids in self.encoded]
            self._ngram[id(ngram)] = np.concatenate(parts) if parts else np.zeros(0)
        return self._ngram[id(ngram)]

    def weight(self, model: LogProbs, ngram: KneserNey) -> tuple[float, float]:
        """(lam, the mixture's validation perplexity): choose_weight on these messages."""
        parts = [_targets(model(ids), ids) for ids in self.encoded]
        logp = np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)
        return choose_weight(logp, self.ngram_targets(ngram), self.words)


class _Counted:
    """`probs`, summing the negative log-probability of every target it is asked for (</s>
    counted), so a pass of evaluate_personal also gives the perplexity."""

    def __init__(self, probs: Probs):
        self.probs, self.nll, self.words = probs, 0.0, 0

    def __call__(self, ids: list[int]) -> np.ndarray:
        rows = np.asarray(self.probs(ids), dtype=np.float64)
        with np.errstate(divide="ignore"):
            self.nll -= float(np.log(_targets(rows, ids)).sum())
        self.words += len(ids) - 1
        return rows

    def ppl(self) -> float:
        return perplexity(self.nll / max(self.words, 1))


def score_pass(probs: Probs, tokenizer: WordTokenizer,
               senders: Mapping[str, Sequence[str]]) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """One evaluate_personal pass: (the figures without the cache, with it); `seconds` the
    pass's (both)."""
    counted = _Counted(probs)
    start = time.perf_counter()
    off, on = evaluate_personal(counted, tokenizer, senders, CACHE_SETTINGS)
    seconds = round(time.perf_counter() - start, 2)
    return _figures(off, counted.ppl(), seconds), _figures(on, None, seconds)


def _figures(got: PersonalEvaluation, ppl: float | None, seconds: float) -> dict[str, Any]:
    return {"ppl": ppl, "all_top1": got["all_top1"], "all_top3": got["all_top3"],
            "bar_top1": got["bar_top1"], "bar_top3": got["bar_top3"], "ksr": got["ksr"],
            "oov": got["oov"], "words": got["words"], "seconds": seconds}  # fmt: skip


def score_keyboards(
    keyboards: Iterable[Keyboard],
    held: HeldOut,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every keyboard on every held-out set, the cache off and on: one row each, with the
    multiples of RATIOS over the REFERENCE row's of the same set and cache setting."""
    rows: list[dict[str, Any]] = []
    valid: dict[int, ValidationText] = {}
    for kb in keyboards:
        lam = val_ppl = None
        if kb.model is not None and kb.ngram is not None:
            if id(kb.tokenizer) not in valid:
                valid[id(kb.tokenizer)] = ValidationText(kb.tokenizer, held.valid)
            lam, val_ppl = valid[id(kb.tokenizer)].weight(kb.model, kb.ngram)
        probs = probabilities(kb, lam)
        for set_name, senders in held.sets.items():
            off, on = score_pass(probs, kb.tokenizer, senders)
            for cache, figures in ((False, off), (True, on)):
                row = {"id": kb.id, "label": kb.label, "kind": kb.kind, "run": kb.run,
                       "round": kb.round, "set": set_name, "cache": cache, "ngram_weight": lam,
                       "mix_val_ppl": val_ppl, "senders": len(senders), **figures}  # fmt: skip
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return with_ratios(rows)


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with x_<field> for RATIOS: its figure over the REFERENCE row's of the same set
    and cache setting (None where either is missing or the reference's is 0)."""
    ref = {(r["set"], r["cache"]): r for r in rows if r["id"] == REFERENCE}
    out = []
    for r in rows:
        base = ref.get((r["set"], r["cache"]))
        ratios = {}
        for f in RATIOS:
            mine, theirs = r.get(f), base and base.get(f)
            ratios[f"x_{f}"] = mine / theirs if mine is not None and theirs else None
        out.append({**r, **ratios})
    return out


# -- loading -----------------------------------------------------------------------------------


def load_base(spec: str) -> tuple[LanguageModel, WordTokenizer]:
    """The base model `spec` names (fedkey.models.base: "base" is the shipped one, stored in
    fp16) in fp32, and its vocabulary."""
    from fedkey.models.base import base_model_config, base_tokenizer, read_base
    from fedkey.models.checkpoint import build_model, initial_state

    config = base_model_config(read_base(spec))
    model = build_model(config, initial_state(config, spec))
    return model, _word(base_tokenizer(spec), spec)


def load_run_model(path: Path, tokenizer: WordTokenizer) -> LanguageModel:
    """A run's checkpoint (fedkey.models.checkpoint.load_checkpoint), checked to hold the
    vocabulary of the base the run started from."""
    from fedkey.models.checkpoint import load_checkpoint

    model, tok, _ = load_checkpoint(path)
    if list(_word(tok, str(path)).itos) != list(tokenizer.itos):
        raise ValueError(f"{path}: its vocabulary is not the base's")
    return model


def load_public_ngram(spec: str, tokenizer: WordTokenizer) -> KneserNey:
    """The 3-gram an --ngram value names ("base": the shipped base's), for the base's words."""
    from fedkey.models.base import ngram_path

    return KneserNey.load(ngram_path(spec), tokenizer)


def collected_ngram(pooled: list[str], vocab_size: int = COLLECTED_VOCAB,
                    order: int = 3) -> KneserNey:  # fmt: skip
    """Row (a): the Kneser-Ney 3-gram of the phones' pooled text, on its `vocab_size` most
    frequent words (what a server holding the phones' text could ship)."""
    tokenizer = WordTokenizer.build(pooled, max_size=vocab_size)
    return KneserNey(tokenizer, order).fit(tokenizer.encode(s) for s in pooled)


def _word(tokenizer: Tokenizer, source: str) -> WordTokenizer:
    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError(f"{source}: the typing table needs a word vocabulary")
    return tokenizer


@dataclass(frozen=True)
class Checkpoint:
    """A run's best-validation checkpoint, to be scored."""

    run: str
    label: str
    kind: str  # "federated" or "central"
    path: Path
    round: int


def keyboards(
    held: HeldOut,
    base: tuple[LanguageModel, WordTokenizer],
    public: KneserNey,
    checkpoints: Sequence[Checkpoint] = (),
) -> Iterable[Keyboard]:
    """The rows of a population, in order: (a) the 3-gram of the phones' text, (b) the public
    3-gram, (c) the base, (d) the base + the public 3-gram, (e) each checkpoint alone and + the
    public 3-gram. A generator: each checkpoint is loaded when its rows come."""
    collected = collected_ngram(held.pooled, COLLECTED_VOCAB)
    yield Keyboard(REFERENCE, "3-gram of the phones' text", "collected", collected.tokenizer,
                   ngram=collected)  # fmt: skip
    model, tok = base
    yield Keyboard("kn3-public", "3-gram of public text", "public", tok, ngram=public)
    base_rows = model_log_probs(model)
    yield Keyboard("base", "base", "base", tok, model=base_rows)
    yield Keyboard("base+kn3", "base + 3-gram", "base", tok, model=base_rows, ngram=public)
    for c in checkpoints:
        rows = model_log_probs(load_run_model(c.path, tok))
        yield Keyboard(c.run, c.label, c.kind, tok, model=rows, run=c.run, round=c.round)
        yield Keyboard(f"{c.run}+kn3", f"{c.label} + 3-gram", c.kind, tok, model=rows,
                       ngram=public, run=c.run, round=c.round)  # fmt: skip
