"""A run's held-out sets, encoded once and scored in parts where the cores are idle.

Every round scores the global model on the validation sentences (perplexity) and the test
sentences (perplexity and the bar's top-k: fedkey.models.metrics.held_out_scores). A simulation's
resident trainers (fedkey.device_sim.training.resident) sit idle while the server does it, so
each takes a part of every set (:func:`parts`: the sentences dealt out shortest first, so the
parts pad alike), keeps it encoded for the run, and returns a tally of its part
(:func:`tally_part`); the tallies merged (fedkey.models.scoring.Tally.merge) give the set's
figures (:func:`fields`). The counts are the same integers; the NLL sums in another order, so a
perplexity agrees with the one-process figure to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedkey.common.config import Precision
from fedkey.models.metrics import scoring_order, tally_of, test_fields_of
from fedkey.models.model import LanguageModel
from fedkey.models.scoring import Tally
from fedkey.models.tokenizers import Tokenizer


@dataclass
class HeldOutSet:
    """One set as a worker keeps it: its part's encoded sentences and whether the round reads
    its top-k (test) or only its perplexity (validation)."""

    seqs: list[list[int]]
    accuracy: bool


def parts(tokenizer: Tokenizer, sentences: Sequence[str], n: int) -> list[list[list[int]]]:
    """`sentences` encoded and dealt to `n` parts in scoring order (shortest first), so each part
    holds sentences of every length."""
    seqs = [tokenizer.encode(s) for s in sentences]
    order = scoring_order(seqs)
    return [[seqs[i] for i in order[p::n]] for p in range(n)]


def tally_part(
    model: LanguageModel,
    tokenizer: Tokenizer,
    part: HeldOutSet,
    batch_size: int,
    precision: Precision,
) -> Tally:
    """The tally of one part on the CPU (no accuracy for a validation part)."""
    return tally_of(model, tokenizer, part.seqs, batch_size, "cpu", precision, part.accuracy)


def merged(tallies: Sequence[Tally]) -> Tally:
    """The parts' tallies added, in the order given."""
    first, *rest = tallies
    for t in rest:
        first.merge(t)
    return first


def fields(
    valid: Tally, valid_words: int, test: Tally, test_words: int, ksr: float | None
) -> dict[str, float | None]:
    """The round's held-out fields (as fedkey.models.metrics.held_out_scores gives them) from the
    merged tallies of the two sets."""
    return {
        "val_ppl": valid.result(valid_words)["ppl"],
        **test_fields_of(test.result(test_words), ksr),
    }
