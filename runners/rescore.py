"""A checkpoint scored again on held-out text, as every round of a run scores its global model
(fedkey.models.metrics.held_out_scores, fedkey.federation.engine), and set beside what the run recorded for that
round in the checkpoint: `fedkey evaluate`, and fedkey_bench.paper_verify for a results table's rows.

The run's held-out text is its corpus (`--data`, `--paper-protocol`, `--seed` for the demo) cut to
its `--max-eval-sentences`, keystroke savings on its first `--ksr-sentences` test sentences; with
`--partition user` the validation and test messages are those of its `--clients` phones' senders,
and a corpus with held-out senders (NUS SMS, Ubuntu IRC) is scored on theirs too (the unseen_*
fields), as `fedkey simulate` scores them. The same text, precision and code give the same
figures to the last digit on one machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fedkey.common.config import DataConfig, Precision, Scheme
from fedkey.federation.config import FederationConfig

#: What a round records of its model and a rescoring compares, in a metrics row's order.
SCORES = {"val_ppl": "validation perplexity", "test_ppl": "test perplexity",
          "top1": "top-1 (test)", "top3": "top-3 (test)", "bar_top1": "the bar's top-1 (test)",
          "bar_top3": "the bar's top-3 (test)",
          "all_top1": "the bar's top-1 over every word (test)",
          "all_top3": "the bar's top-3 over every word (test)",
          "oov": "words out of the vocabulary (test)", "ksr": "keystroke savings",
          "unseen_test_ppl": "perplexity (senders who never trained)",
          "unseen_top1": "top-1 (never trained)", "unseen_top3": "top-3 (never trained)",
          "unseen_bar_top1": "the bar's top-1 (never trained)",
          "unseen_bar_top3": "the bar's top-3 (never trained)",
          "unseen_all_top1": "the bar's top-1 over every word (never trained)",
          "unseen_all_top3": "the bar's top-3 over every word (never trained)",
          "unseen_oov": "words out of the vocabulary (never trained)",
          "unseen_ksr": "keystroke savings (never trained)"}  # fmt: skip
#: Relative difference under which a score agrees with the recorded one (bf16 sums may differ in
#: their last digits from one build of torch or one CPU to another).
AGREE = 1e-3


def agrees(now: float | None, then: float | None) -> bool:
    """Whether two figures of one score agree (a figure missing on either side: nothing to
    compare, so no disagreement)."""
    return now is None or then is None or abs(now - then) <= AGREE * max(abs(then), 1e-12)


@dataclass
class Rescored:
    """One checkpoint's scores now, and those its run recorded for its round ({}: none)."""

    scores: dict[str, float | None]
    recorded: dict[str, float | None]
    round: int | None
    strategy: str | None
    recorded_precision: str | None  # the precision the run evaluated in
    precision: str
    device: str
    sentences: tuple[int, int]  # validation, test
    differ: list[str] = field(default_factory=list)  # the scores that do not agree

    @property
    def agrees(self) -> bool | None:
        """Whether every score agrees with the recorded one (None: nothing recorded)."""
        return not self.differ if self.recorded else None


def rescore(
    checkpoint: Path,
    data: str,
    paper_protocol: bool = False,
    max_eval_sentences: int | None = None,
    seed: int = 0,
    clients: int = 100,
    partition: Scheme = "iid",
    ksr_sentences: int = FederationConfig.ksr_sentences,
    device: str = "auto",
    precision: Precision = "auto",
) -> Rescored:
    """Score `checkpoint` on the held-out text of `data` cut as a run cuts it (0 or None: all of
    it). Raises safetensors' SafetensorError for a file that is no checkpoint, FileNotFoundError
    or ValueError for a corpus that is not there, ValueError for one with nothing held out."""
    from fedkey.corpora.dataset import load_cut
    from fedkey.models.checkpoint import load_checkpoint
    from fedkey.models.metrics import held_out_scores, unseen_scores
    from fedkey.models.precision import resolve_device, resolve_precision

    model, tokenizer, meta = load_checkpoint(checkpoint)
    cut = DataConfig(data=data, paper_protocol=paper_protocol, clients=clients,
                     partition=partition, max_eval_sentences=max_eval_sentences or None,
                     seed=seed)  # fmt: skip
    corpus, _ = load_cut(cut)
    if not corpus.valid or not corpus.test:
        raise ValueError(f"{data}: no validation or test sentences to score")
    where = resolve_device(device)
    resolved = resolve_precision(precision, where)
    scores = held_out_scores(model, tokenizer, corpus.valid, corpus.test, device=where,
                             precision=resolved, ksr_sentences=ksr_sentences)  # fmt: skip
    if corpus.unseen_test:  # the senders who never trained, as simulate scores them
        scores |= unseen_scores(model, tokenizer, corpus.unseen_test, device=where,
                                precision=resolved, ksr_sentences=ksr_sentences)  # fmt: skip
    row = meta.get("metrics") or {}
    recorded = {k: row[k] for k in SCORES if k in row}
    return Rescored(
        scores=scores, recorded=recorded, round=meta.get("round"), strategy=meta.get("strategy"),
        recorded_precision=row.get("eval_precision"), precision=resolved, device=str(where),
        sentences=(len(corpus.valid), len(corpus.test)),
        differ=[k for k in SCORES if not agrees(scores.get(k), recorded.get(k))],
    )  # fmt: skip
