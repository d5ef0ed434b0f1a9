"""The canary audit's measure: exposure = log2 |R| - log2 rank (Carlini et al. 2019), exactly
over every candidate of a format, or estimated from samples."""

import math

import pytest
import torch

from fedkey.models.canary import CanaryFormat, check_vocabulary
from fedkey.models.exposure import (
    ExposureProbe,
    enumerate_log_probs,
    exposure,
    rank_among,
    sentence_log_probs,
)
from fedkey.models.model import LanguageModel, ModelConfig
from fedkey.models.tokenizers import WordTokenizer

FMT = CanaryFormat("my secret is _ _ _", ("one", "two", "three", "four", "five", "six"))
TOK = WordTokenizer.build(["my secret is one two three four five six", "hello there"])


def tiny(cell="gru", layers=1, seed=0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(
        ModelConfig(TOK.vocab_size, cell=cell, emb_size=8, hidden_size=8, num_layers=layers)
    )


def test_candidates_are_the_whole_format_in_index_order():
    assert FMT.size == 6**3 and FMT.slots == 3
    sentences = [FMT.candidate(i) for i in range(FMT.size)]
    assert len(set(sentences)) == FMT.size
    assert (
        sentences[0] == "my secret is one one one" and sentences[-1] == "my secret is six six six"
    )
    assert all(FMT.index(s) == i for i, s in enumerate(sentences))
    assert enumerate_log_probs(tiny(), TOK, FMT, sentences[7]).shape == (FMT.size,)


@pytest.mark.parametrize("cell,layers", [("gru", 1), ("lstm", 2)])
def test_the_tree_scores_every_candidate_as_the_whole_sentence_would(cell, layers):
    """The enumeration shares prefixes' recurrent states; each candidate's log-probability must
    still be that of its whole sentence <s> ... </s>."""
    model = tiny(cell, layers)
    tree = enumerate_log_probs(model, TOK, FMT, FMT.candidate(0))
    whole = sentence_log_probs(model, [TOK.encode(FMT.candidate(i)) for i in range(FMT.size)])
    torch.testing.assert_close(tree, whole, atol=1e-5, rtol=0)


def test_a_secret_the_model_ranks_first_has_the_largest_exposure():
    secret = FMT.draw(seed=3)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.tensor([TOK.encode(secret)])
    for _ in range(60):  # memorize the secret
        opt.zero_grad()
        logits, _ = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).backward()
        opt.step()
    e = exposure(model, TOK, FMT, secret)
    assert e.rank == 1 and e.method == "exact"
    assert e.exposure == pytest.approx(math.log2(FMT.size))
    # no sample beats it: the estimate extrapolates from a skew-normal fit, capped at rank 1
    fitted = exposure(model, TOK, FMT, secret, max_exact=10, samples=300)
    assert fitted.method == "skew-normal"
    assert fitted.exposure > math.log2(FMT.size) - 0.5
    # another candidate, which the model was not trained on, is far less exposed
    other = FMT.candidate((FMT.index(secret) + FMT.size // 2) % FMT.size)
    assert exposure(model, TOK, FMT, other).exposure < e.exposure - 3


def indifferent() -> LanguageModel:
    """Every word equally likely whatever came before: the output layer is all zeros."""
    model = tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_a_model_indifferent_to_the_slots_gives_about_one_bit():
    """All candidates tie: the secret shares their mean rank (|R| + 1) / 2, exposure ~ 1."""
    e = exposure(indifferent(), TOK, FMT, FMT.draw(seed=0))
    assert e.rank == pytest.approx((FMT.size + 1) / 2)
    assert e.exposure == pytest.approx(1.0, abs=0.01)
    sampled = exposure(indifferent(), TOK, FMT, FMT.draw(seed=0), max_exact=10, samples=500)
    assert sampled.method == "sampled" and sampled.exposure == pytest.approx(1.0, abs=0.01)


def test_ties_share_their_mean_rank():
    scores = torch.tensor([-1.0, -2.0, -2.0, -2.0, -5.0], dtype=torch.float64)
    assert rank_among(-1.0, scores) == 1
    assert rank_among(-2.0, scores) == 3  # ranks 2, 3, 4
    assert rank_among(-5.0, scores) == 5


def test_the_sampling_estimate_is_close_to_the_exact_exposure():
    model, secret = tiny(seed=1), FMT.draw(seed=5)
    exact = exposure(model, TOK, FMT, secret)
    sampled = exposure(model, TOK, FMT, secret, max_exact=10, samples=4000, min_hits=1)
    assert 1 < exact.rank < FMT.size / 2  # neither first nor last: the estimate has work to do
    assert sampled.method == "sampled"
    assert sampled.exposure == pytest.approx(exact.exposure, abs=0.25)


def test_the_secret_is_drawn_by_the_seed_not_picked():
    secrets = [FMT.draw(seed) for seed in range(200)]
    assert secrets[:5] == [FMT.draw(seed) for seed in range(5)]  # reproducible
    # 200 uniform draws from 216 candidates hit ~130 distinct ones; every slot takes every word
    assert len(set(secrets)) > 100
    for slot in range(FMT.slots):
        assert {FMT.choices(FMT.index(s))[slot] for s in secrets} == set(range(6))
    assert all(FMT.index(s) >= 0 for s in secrets)


def test_an_out_of_vocabulary_canary_is_refused_in_one_line():
    pin = CanaryFormat("my pin is _ _", ("one", "two"))
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \(pin\)") as info:
        ExposureProbe(pin, "my pin is one two")(tiny(), TOK)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"\(seven, eight\)"):
        check_vocabulary(TOK, ["one", "seven", "eight"], "the canary")


def test_a_malformed_format_or_secret_is_refused():
    with pytest.raises(ValueError, match="has no slot"):
        CanaryFormat("my secret is", ("one",))
    with pytest.raises(ValueError, match="repeats a word"):
        CanaryFormat.parse("_ _", "one, two, one")
    with pytest.raises(ValueError, match="does not fit"):
        ExposureProbe(FMT, "my pin is one two three")
    with pytest.raises(ValueError, match="not in the canary alphabet"):
        FMT.index("my secret is one two ten")


def test_the_probe_reports_exposure_and_rank_for_the_metrics_row():
    row = ExposureProbe(FMT, FMT.draw(seed=0))(indifferent(), TOK)
    assert set(row) == {"canary_exposure", "canary_rank"}
    assert row["canary_exposure"] == pytest.approx(1.0, abs=0.01)
