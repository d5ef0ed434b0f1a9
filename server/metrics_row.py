"""The fields of a metrics row: one JSON object per round in a run's ``metrics.jsonl``, and each
element of ``GET /v1/metrics``'s ``rounds``.

This is the one declaration of what a row holds: the round engine (server.engine.Federation
``_record``) writes the ``ALWAYS`` fields every round, the evaluator and the probes add the
``CONDITIONAL`` ones when their option is on, and the documentation's reference page
(docs/reference/metrics.md) is generated from these two tables. tests/server/test_metrics_row.py
holds a real round's row to them: a field written but not declared here, or declared and not
written, fails it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowField:
    """One field of a metrics row: its JSON type and what it means (and, for a conditional
    field, when the row has it)."""

    type: str
    description: str
    when: str = ""


#: The fields of every row written by the round engine (simulate, server, run, train-central).
ALWAYS: dict[str, RowField] = {
    "round": RowField("int", "The round this row is of; 0 is the initial model."),
    "strategy": RowField(
        "str", "The aggregation method (`fedavg`, `fedatt`, ...), or the run's label."
    ),
    "data": RowField(
        "str",
        "The corpus the phones trained on: its name (`demo`, `nus-sms`, `ubuntu-irc`, or the "
        "folder or file `--data` named, e.g. `ptb`).",
    ),
    "selected": RowField("list[str]", "The phones the strategy selected for this round."),
    "aggregated": RowField(
        "list[str]",
        "The phones whose updates went into the new global model (those that uploaded, and "
        "passed the checks and the outlier filter, in time).",
    ),
    "val_ppl": RowField(
        "float",
        "Validation perplexity of the new global model: exp(mean negative log-likelihood per "
        "predicted word), the end of sentence counted.",
    ),
    "test_ppl": RowField("float", "Test perplexity of the new global model."),
    "top1": RowField(
        "float | null",
        "Share of the test set's words that are the model's first guess (null for a "
        "SentencePiece vocabulary).",
    ),
    "top3": RowField("float | null", "Share of the test set's words among the first three."),
    "bar_top1": RowField(
        "float | null",
        "`top1` as a suggestion bar ranks: the model's likeliest word that a bar can show "
        "(never `</s>` or `<unk>`); what production keyboards report as top-1 recall.",
    ),
    "bar_top3": RowField("float | null", "`top3` as a suggestion bar ranks."),
    "ksr": RowField(
        "float | null",
        "Keystroke savings on the first test sentences with a 3-slot suggestion bar (null when "
        "off or with SentencePiece).",
    ),
    "best_round": RowField("int", "The round with the lowest validation perplexity so far."),
    "best_val_ppl": RowField("float", "The validation perplexity of that best round."),
    "best_test_ppl": RowField(
        "float",
        "The test perplexity of the best-validation model so far (the seed papers' reporting).",
    ),
    "bytes_up": RowField("int", "Bytes the aggregated phones uploaded this round."),
    "bytes_down": RowField("int", "Bytes of the model sent to the selected phones this round."),
    "epsilon": RowField(
        "float | null",
        "The differential-privacy epsilon spent so far (at the run's delta); null without DP.",
    ),
    "rho": RowField(
        "float | null",
        "The privacy spent so far as rho-zCDP (what Gboard reports); null without DP. Under "
        "`--dp-mechanism tree` it is the tree's bound and `epsilon` its conversion; under "
        "`gaussian` it is rounds / (2 z^2), which cannot count the amplification by sampling "
        "that `epsilon` counts.",
    ),
    "delta": RowField(
        "float | null",
        "The delta `epsilon` is reported at: `--dp-delta`, or by default 1/N^1.1 for the N "
        "phones the rounds were drawn from (the largest population so far); null without DP "
        "(or before a server has seen a phone).",
    ),
    "seconds": RowField("float", "Wall seconds from the round's opening to its aggregation."),
    "train_precision": RowField(
        "str | null",
        "The arithmetic of local training, `fp32` or `bf16`; null on a server whose task says "
        "`auto`, which each phone resolves on its own hardware.",
    ),
    "eval_precision": RowField("str", "The arithmetic of the evaluation, `fp32` or `bf16`."),
    "eval_device": RowField("str", "Where the global model was evaluated (`cpu`, `cuda`)."),
    "info": RowField(
        "object",
        "What the server did this round: the strategy's own report (`strategy`, `mode`, "
        "`num_updates`, its weights or attention, FedAttOpt's `step_scale`, ...), `clip` (what "
        "bounded influence cut: the bound, the clipped updates, `outliers` the cosine filter "
        "rejected) and, under DP, `dp` (`mechanism`, `clip` (the round's clip), `sensitivity`, "
        "`noise_std`, `sampling`; under `--dp-mechanism tree`, in round 0's row too: "
        "`min_separation` (the rounds between one phone's participations that selection "
        "enforces and the accounting assumes), `noise_multiplier`, and per round "
        "`release_noise_std`, `tree_nodes`, `max_participations`; under `--dp-clip-quantile`, "
        "`clip_quantile`, `unclipped_fraction_noisy` (the noised share of updates within the "
        "clip), `next_clip`, `count_stddev` and `update_noise_multiplier`).",
    ),
}

#: When a row scores the held-out senders who never trained (Corpus.unseen_test).
UNSEEN_WHEN = (
    "`simulate`, `train-central` or `ngram` on a corpus with held-out senders (`nus-sms`, "
    "`ubuntu-irc`)"
)

#: Fields a row has only when an option asks for them.
CONDITIONAL: dict[str, RowField] = {
    "col_val_ppl": RowField(
        "float",
        "The seed papers' column perplexity on the validation set; the best round is then "
        "chosen by it.",
        "`--batching columns`",
    ),
    "col_test_ppl": RowField(
        "float", "The seed papers' column perplexity on the test set.", "`--batching columns`"
    ),
    "best_col_val_ppl": RowField(
        "float", "`col_val_ppl` of the best round so far.", "`--batching columns`"
    ),
    "best_col_test_ppl": RowField(
        "float", "`col_test_ppl` of the best round so far.", "`--batching columns`"
    ),
    "unseen_test_ppl": RowField(
        "float",
        "Perplexity on the messages of the held-out senders who never trained (`test_ppl` is on "
        "the training senders' later messages).",
        UNSEEN_WHEN,
    ),
    "unseen_top1": RowField(
        "float | null",
        "`top1` on the held-out senders' messages.",
        UNSEEN_WHEN,
    ),
    "unseen_top3": RowField(
        "float | null",
        "`top3` on the held-out senders' messages.",
        UNSEEN_WHEN,
    ),
    "unseen_bar_top1": RowField(
        "float | null",
        "`bar_top1` on the held-out senders' messages.",
        UNSEEN_WHEN,
    ),
    "unseen_bar_top3": RowField(
        "float | null",
        "`bar_top3` on the held-out senders' messages.",
        UNSEEN_WHEN,
    ),
    "unseen_ksr": RowField(
        "float | null",
        "`ksr` on the held-out senders' first messages.",
        UNSEEN_WHEN,
    ),
    "canary_exposure": RowField(
        "float",
        "The planted secret's exposure in bits (Carlini et al. 2019): log2 of the candidates "
        "less log2 of the secret's rank.",
        "`--canary`",
    ),
    "canary_rank": RowField(
        "float", "The secret's rank among the format's candidates (1: first).", "`--canary`"
    ),
    "backdoor_top1": RowField(
        "float",
        "Share of held-out trigger contexts whose first suggestion is the backdoor's target word.",
        "`simulate --attack backdoor`",
    ),
    "backdoor_top3": RowField(
        "float",
        "Share of held-out trigger contexts with the target among the first three suggestions.",
        "`simulate --attack backdoor`",
    ),
    "rejected": RowField(
        "object",
        "The uploads `simulate` refused as the server would, phone -> reason.",
        "`simulate --malicious N`",
    ),
    "lost": RowField(
        "object",
        "Phones whose training failed twice on the Ray cluster and were left out, phone -> why.",
        "`simulate --backend ray`",
    ),
    "trained_on": RowField(
        "object", "How many phones each Ray node trained this round.", "`simulate --backend ray`"
    ),
}

#: Every declared field, in the order the reference lists them.
FIELDS: dict[str, RowField] = {**ALWAYS, **CONDITIONAL}


def undeclared(row: dict) -> list[str]:
    """The keys of `row` that this module does not declare (a check for tests and tools)."""
    return [k for k in row if k not in FIELDS]
