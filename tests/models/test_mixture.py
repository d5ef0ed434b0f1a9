"""fedkey.models.mixture: the model mixed with a Kneser-Ney n-gram, scored as the model is."""

import pytest
import torch

from fedkey.models.config import ModelConfig
from fedkey.models.metrics import Taps, evaluate, held_out_scores, keystroke_savings
from fedkey.models.mixture import (
    GRID,
    MIX_FIELDS,
    NgramMixture,
    choose_weight,
    evaluate_mixture,
    mixture_keystroke_savings,
)
from fedkey.models.model import LanguageModel
from fedkey.models.ngram import KneserNey
from fedkey.models.tokenizers import WordTokenizer

TRAIN = [
    "see you at the station",
    "see you soon",
    "are you at the office",
    "i am at the station now",
    "call me when you are at home",
    "i will see you at home",
] * 3
VALID = ["you are at the station soon", "i am home now", "see me at the office", "call you at home"]
TEST = ["see you at the station soon", "i am at home now", "are you at the zoo", "call me"]
ACCURACY = ("top1", "top3", "bar_top1", "bar_top3", "all_top1", "all_top3", "oov")


@pytest.fixture(scope="module")
def parts():
    tok = WordTokenizer.build(TRAIN, max_size=14)  # some words out of the vocabulary
    kn = KneserNey(tok, 3).fit(tok.encode(s) for s in TRAIN)
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, emb_size=8, hidden_size=8))
    return tok, kn, model


def same(a: dict, b: dict) -> None:
    assert a["words"] == b["words"]
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6)
    assert {k: a[k] for k in ACCURACY} == {k: b[k] for k in ACCURACY}


def test_lam_1_is_the_model_and_lam_0_the_ngram(parts):
    tok, kn, model = parts
    same(evaluate_mixture(model, kn, TEST, 1.0), evaluate(model, tok, TEST))
    same(evaluate_mixture(model, kn, TEST, 0.0), kn.evaluate(TEST))
    assert evaluate(model, tok, TEST)["oov"] > 0  # "zoo" is out of the vocabulary
    assert mixture_keystroke_savings(model, kn, TEST, 1.0) == pytest.approx(
        keystroke_savings(model, tok, TEST)
    )


def test_the_weight_is_the_grids_lowest_validation_perplexity(parts):
    tok, kn, model = parts
    rnd = NgramMixture(kn, tok, VALID, TEST).round()
    held_out_scores(model, tok, VALID, TEST, taps=rnd.taps)
    lam = rnd.weight()
    ppl = {w: evaluate_mixture(model, kn, VALID, w)["ppl"] for w in GRID}
    assert ppl[lam] == pytest.approx(min(ppl.values()), rel=1e-9)
    assert 0.0 < lam < 1.0  # an untrained (near uniform) model smooths the 3-gram: 0.15
    assert rnd.val_ppl == pytest.approx(ppl[lam], rel=1e-6)
    # choose_weight reads nothing but the targets' probabilities
    assert choose_weight([0.0, 0.0], [0.5, 0.5], 2) == (1.0, 1.0)


@pytest.mark.parametrize("kept", [1, 3, 16])
def test_a_rounds_fields_are_the_mixtures_evaluation(parts, kept):
    """However few of the n-gram's words a round keeps per position, its top-1 is the exact one
    (`kept` 1: most positions fall back to the full row)."""
    tok, kn, model = parts
    rnd = NgramMixture(kn, tok, VALID, TEST, ksr_sentences=2, kept=kept).round()
    own = held_out_scores(model, tok, VALID, TEST, taps=rnd.taps)
    assert own == held_out_scores(model, tok, VALID, TEST)  # the taps change nothing
    row = rnd.fields(model)
    assert list(row) == list(MIX_FIELDS)
    full = evaluate_mixture(model, kn, TEST, row["ngram_weight"])
    assert row["mix_test_ppl"] == pytest.approx(full["ppl"], rel=1e-6)
    assert (row["mix_bar_top1"], row["mix_all_top1"]) == (full["bar_top1"], full["all_top1"])
    lam = row["ngram_weight"]
    assert row["mix_ksr"] == mixture_keystroke_savings(model, kn, TEST[:2], lam)


def test_an_ngram_of_another_vocabulary_is_refused_in_one_line(parts):
    tok, kn, _ = parts
    other = WordTokenizer.build(TRAIN, max_size=10)
    with pytest.raises(
        ValueError, match=r"^the n-gram's vocabulary \(14 words\) is not the model's \(10 words\)"
    ) as e:
        NgramMixture(kn, other, VALID, TEST)
    assert "\n" not in str(e.value)


def test_taps_see_every_batch_once(parts):
    tok, _, model = parts
    seen = {"valid": 0, "test": 0}

    def count(name):
        return lambda targets, logp: seen.__setitem__(name, seen[name] + len(targets))

    held_out_scores(model, tok, VALID, TEST, taps=Taps([count("valid")], [count("test")]))
    assert seen == {"valid": sum(len(s.split()) + 1 for s in VALID),
                    "test": sum(len(s.split()) + 1 for s in TEST)}  # fmt: skip
