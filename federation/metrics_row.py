"""The fields of a metrics row: one JSON object per round in a run's ``metrics.jsonl``, and each
element of ``GET /v1/metrics``'s ``rounds``.

This is the one declaration of what a row holds: the round engine (fedkey.federation.engine.Federation
``_record``) writes the ``ALWAYS`` fields every round, the evaluator and the probes add the
``CONDITIONAL`` ones when their option is on, and the documentation's reference page
(docs/reference/metrics.md) is generated from these two tables. tests/federation/test_metrics_row.py
holds a real round's row to them: a field written but not declared here, or declared and not
written, fails it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedkey.federation.config import PrivacyConfig


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
    "selected": RowField(
        "list[str]",
        "The phones the strategy selected for this round (under DP: only in the server's own "
        "metrics.jsonl, never in what it publishes).",
    ),
    "uploaded": RowField(
        "list[str]",
        "The phones whose uploads the round took: in time, and past the checks (under DP: only "
        "in the server's own metrics.jsonl, never in what it publishes).",
    ),
    "aggregated": RowField(
        "list[str]",
        "The phones whose updates went into the new global model: those uploaded that the "
        "outlier filter kept (under DP: only in the server's own metrics.jsonl, never in what it "
        "publishes).",
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
    "all_top1": RowField(
        "float | null",
        "`bar_top1` over every word of the test set (the end of a message aside), a word out of "
        "the vocabulary counting as a miss: what the user sees of all they type, which a "
        "smaller vocabulary cannot raise by leaving the hard words out.",
    ),
    "all_top3": RowField("float | null", "`bar_top3` over every word, as `all_top1`."),
    "oov": RowField(
        "float | null",
        "Share of the test set's words (the end of a message aside) out of the vocabulary "
        "(`<unk>`): `all_top1` = `bar_top1` x (1 - `oov`).",
    ),
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
    "bytes_up": RowField(
        "int",
        "Bytes of the uploads the round took (`uploaded`; under DP with Poisson sampling: only "
        "in the server's own metrics.jsonl, as the cohort's size).",
    ),
    "bytes_down": RowField(
        "int",
        "Bytes of the model sent to the selected phones this round (under DP with Poisson "
        "sampling: only in the server's own metrics.jsonl).",
    ),
    "epsilon": RowField(
        "float | null",
        "The differential-privacy epsilon spent so far (at the run's delta); null without DP.",
    ),
    "rho": RowField(
        "float | null",
        "The privacy spent so far as rho-zCDP (what Gboard reports); null without DP. Under "
        "`--dp-mechanism tree` or `blt` it is that mechanism's bound and `epsilon` its "
        "conversion; under `gaussian` it is rounds / (2 z^2), which cannot count the "
        "amplification by sampling that `epsilon` counts.",
    ),
    "delta": RowField(
        "float | null",
        "The delta `epsilon` is reported at: `--dp-delta`, or by default 1/N^1.1 for the N "
        "phones the rounds were drawn from (the largest population so far); null without DP "
        "(or before a server has seen a phone).",
    ),
    "noise_reproducible": RowField(
        "bool | null",
        "Whether the DP noise and the sampled cohorts were drawn from a passphrase (`--dp-secret`: "
        "reproducible by whoever knows it, so `epsilon` bounds nothing against them) rather than "
        "from the server's own secret (fedkey.federation.privacy.secret); null without DP.",
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
        "`noise_std`, `sampling`, `noise_multiplier` (given, or calibrated to "
        "`--dp-target-epsilon`; in round 0's row too); under `--dp-mechanism tree` or `blt`, "
        "in round 0's row too: `min_separation` (the rounds between one phone's participations "
        "that selection enforces and the accounting assumes), and per round "
        "`release_noise_std`, `tree_nodes` (the tree's), `max_participations`; under "
        "`--dp-clip-quantile`, `clip_quantile`, `unclipped_fraction_noisy` (the noised share of updates within the "
        "clip), `next_clip`, `count_stddev` and `update_noise_multiplier`). Under DP the row "
        "holds only what the guarantee covers (fedkey.federation.metrics_row.public_info): the strategy's "
        "`strategy`, `mode`, its settings `epsilon` / `epsilon_med`, `num_updates` and "
        "`attention_cap` (of the cohort's size: not under `--dp-sampling poisson`), `clip`'s "
        "`mode`, `scope` and `norm`, and all of `dp`; no per-phone weights, norms, losses or "
        "exact counts (the clipped updates among them).",
    ),
}

#: When a row scores the held-out senders who never trained (Corpus.unseen_test).
UNSEEN_WHEN = (
    "`simulate`, `train-central` or `ngram` on a corpus with held-out senders (`nus-sms`, "
    "`ubuntu-irc`)"
)

#: When a row scores the model mixed with an n-gram (fedkey.models.mixture).
NGRAM_WHEN = "`--ngram PATH` (`simulate`, `server`, `run`)"

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
    "unseen_all_top1": RowField(
        "float | null",
        "`all_top1` on the held-out senders' messages.",
        UNSEEN_WHEN,
    ),
    "unseen_all_top3": RowField(
        "float | null",
        "`all_top3` on the held-out senders' messages.",
        UNSEEN_WHEN,
    ),
    "unseen_oov": RowField(
        "float | null",
        "`oov` on the held-out senders' messages.",
        UNSEEN_WHEN,
    ),
    "unseen_ksr": RowField(
        "float | null",
        "`ksr` on the held-out senders' first messages.",
        UNSEEN_WHEN,
    ),
    "ngram_weight": RowField(
        "float",
        "The model's weight lam in the mixture lam x model + (1 - lam) x n-gram that the keyboard "
        "ships (Mikolov et al. 2010's linear interpolation): of 0, 0.05, ..., 1, the one with the "
        "lowest validation perplexity this round.",
        NGRAM_WHEN,
    ),
    "mix_val_ppl": RowField(
        "float", "Validation perplexity of the mixture (at `ngram_weight`).", NGRAM_WHEN
    ),
    "mix_test_ppl": RowField("float", "Test perplexity of the mixture.", NGRAM_WHEN),
    "mix_bar_top1": RowField(
        "float | null", "`bar_top1` of the mixture (as the keyboard ranks it).", NGRAM_WHEN
    ),
    "mix_all_top1": RowField("float | null", "`all_top1` of the mixture.", NGRAM_WHEN),
    "mix_ksr": RowField(
        "float | null",
        "`ksr` of the mixture, on the same first test sentences (null when `--ksr-sentences 0`).",
        NGRAM_WHEN,
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


#: What a DP round's ``info`` may publish (public_info), key by key: None keeps the value as it
#: is, a set keeps those keys of a nested object. Each is a setting, a function of the public
#: facts (the clip, the cohort's size, the noised model before the round) or a noised statistic.
DP_INFO: dict[str, frozenset[str] | None] = {
    "strategy": None,
    "mode": None,  # the strategy's: fixed under DP (FedMed's mediation is refused, always adaptive)
    "epsilon": None,  # FedAtt's and FedAttOpt's server step size, a setting
    "epsilon_med": None,  # FedMed's threshold, a setting (0 under DP)
    "num_updates": None,  # the cohort's size
    "attention_cap": None,  # FedAtt's largest weight, a function of the cohort's size
    "clip": frozenset({"mode", "scope", "norm"}),  # the bound: the configured S or C_t
    "dp": frozenset(
        {
            "mechanism",  # the settings
            "sampling",
            "noise_multiplier",
            "min_separation",
            "clip",  # the round's clip C_t, and what follows from it, m and the model before
            "sensitivity",
            "noise_std",
            "update_noise_multiplier",
            "release_noise_std",  # the tree's, of the round and b
            "tree_nodes",
            "max_participations",
            "clip_quantile",  # adaptive clipping's settings
            "count_stddev",
            "unclipped_fraction_noisy",  # its noised count, and C_(t+1) from it
            "next_clip",
        }
    ),
}

#: Facts of the cohort's size: public where the accountant takes the size as given (fixed-size
#: cohorts, the tree), private under Poisson sampling, whose add/remove-one neighbours differ in it.
COHORT_SIZE_KEYS = frozenset({"num_updates", "attention_cap"})


def public_info(info: dict[str, Any], privacy: PrivacyConfig) -> dict[str, Any]:
    """What a round's ``info`` may publish: under DP its DP_INFO keys alone; without DP `info`
    itself (the same object, so a row without DP is as it always was).

    Why: the DP guarantee, the (epsilon, delta) the accountant reports, covers one release per
    round, the noised aggregate (and under adaptive clipping the noised count it pays for), and
    by post-processing (Dwork & Roth 2014, Prop. 2.1) whatever is computed from that alone. Any
    other function of the phones' updates is a further release the accountant never paid for: a
    phone's attention weight, the update norms' median or maximum, FedMed's mean train loss, the
    exact number of clipped updates (under adaptive clipping the very count that is noised), or,
    under Poisson sampling, the exact cohort size, can each tell a phone's presence or its data,
    and epsilon would then bound nothing. Rows are public (GET /v1/metrics, metrics.jsonl, the
    checkpoint devices download, the export's privacy facts), so the row keeps only what the
    guarantee covers (and, as published, names no phone: public_row); the server's own memory (the
    strategy's after_round state) is not the row's and keeps what it needs. A key of an unknown shape is left out (an allow-list, not a deny-list).
    """
    if not privacy.dp:
        return info
    drop = COHORT_SIZE_KEYS if privacy.sampling == "poisson" else frozenset()
    public: dict[str, Any] = {}
    for key, value in info.items():  # in the row's own order
        if key not in DP_INFO or key in drop:
            continue
        allowed = DP_INFO[key]
        if allowed is None:
            if not isinstance(value, Mapping | list):
                public[key] = value
        elif isinstance(value, Mapping):
            public[key] = {k: v for k, v in value.items() if k in allowed}
    return public


#: The row's fields that name phones.
PHONE_KEYS = frozenset({"selected", "uploaded", "aggregated"})

#: What the public event stream (fedkey.server.events) carries under DP: these event types, each with
#: these fields alone. Not listed, so never published under DP: the per-phone events
#: (device_enrolled, update_received, update_rejected), every field naming a phone (cohort,
#: device_id, aggregated), every free-text one (a rejection's detail, a failure's reason, which
#: can quote a name or an exception), exact counts of uploads (received, quorum), and the scores
#: on the held-out text (val_ppl, test_ppl: public_row's argument).
DP_EVENTS: dict[str, frozenset[str]] = {
    "round_opened": frozenset({"round", "attempt", "deadline", "model_round"}),
    "round_failed": frozenset({"round", "attempt"}),
    "round_aggregated": frozenset({"round", "attempt", "epsilon"}),
    "aggregation_postponed": frozenset({"round", "attempt", "retry_in"}),
    "run_finished": frozenset({"round"}),
    "model_exported": frozenset({"round", "bytes"}),
    "export_failed": frozenset({"round"}),
}
#: The row's fields that are a multiple of the cohort's size (the model's bytes times it).
ROW_COHORT_SIZE_KEYS = frozenset({"bytes_up", "bytes_down"})

#: What a DP row publishes (public_row): settings, the accountant's figures and the noised
#: round's info, nothing scored on the phones' text. Every other field (the phones it names, the
#: perplexities, top-k and keystroke savings on the held-out text, the best round chosen by them,
#: a probe's figures) is the server's own.
DP_ROW = frozenset(
    {
        "round",
        "strategy",
        "data",
        "bytes_up",
        "bytes_down",
        "epsilon",
        "rho",
        "delta",
        "noise_reproducible",
        "seconds",
        "train_precision",
        "eval_precision",
        "eval_device",
        "info",
    }
)


#: The row's scores on the held-out text, which a DP row publishes only with --dp-publish-scores.
SCORE_KEYS = frozenset(
    {
        "val_ppl",
        "test_ppl",
        "top1",
        "top3",
        "bar_top1",
        "bar_top3",
        "all_top1",
        "all_top3",
        "oov",
        "ksr",
        "best_round",
        "best_val_ppl",
        "best_test_ppl",
        "col_val_ppl",
        "col_test_ppl",
        "best_col_val_ppl",
        "best_col_test_ppl",
        "unseen_test_ppl",
        "unseen_top1",
        "unseen_top3",
        "unseen_bar_top1",
        "unseen_bar_top3",
        "unseen_all_top1",
        "unseen_all_top3",
        "unseen_oov",
        "unseen_ksr",
        "ngram_weight",
        "mix_val_ppl",
        "mix_test_ppl",
        "mix_bar_top1",
        "mix_all_top1",
        "mix_ksr",
    }
)


def dp_events(privacy: PrivacyConfig) -> dict[str, frozenset[str]] | None:
    """The event stream's allow-list (fedkey.server.events): None without DP, else DP_EVENTS, with the
    round's perplexities under --dp-publish-scores."""
    if not privacy.dp:
        return None
    if not privacy.publish_scores:
        return DP_EVENTS
    scored = DP_EVENTS["round_aggregated"] | {"val_ppl", "test_ppl"}
    return {**DP_EVENTS, "round_aggregated": scored}


def public_row(row: dict[str, Any], privacy: PrivacyConfig) -> dict[str, Any]:
    """The metrics row as the server publishes it (GET /v1/metrics, the checkpoint devices
    download, the keyboard's export): under DP the DP_ROW fields alone, less the cohort's size
    under Poisson sampling (ROW_COHORT_SIZE_KEYS, as public_info's COHORT_SIZE_KEYS); without DP
    `row` itself.

    Why: which phones were selected and aggregated is an exact function of their updates (the
    checks and the outlier filter decide it), and under Poisson sampling which phones were
    selected is the very presence that add/remove-one adjacency protects; the held-out scores are
    exact functions of the phones' held-out text (and the best round is chosen by them); none is
    a release the accountant paid for (public_info's argument); --dp-publish-scores publishes
    the scores (SCORE_KEYS) all the same, outside the guarantee. The server, the trusted curator
    of central DP, keeps them in its own records (metrics.jsonl, its database, its log), which
    the operator reads.
    """
    if not privacy.dp:
        return row
    keep = DP_ROW | (SCORE_KEYS if privacy.publish_scores else frozenset())
    keep -= ROW_COHORT_SIZE_KEYS if privacy.sampling == "poisson" else frozenset()
    return {k: v for k, v in row.items() if k in keep}
