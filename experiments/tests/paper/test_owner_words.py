"""`python -m fedkey_bench.paper.owner_words`: held-out perplexity grouped by how many owners typed the word,
its last row the checkpoint's own test perplexity."""

import math

import pytest
import torch

from fedkey.corpora.loaders import load_corpus
from fedkey.models.checkpoint import load_checkpoint, model_state, save_checkpoint
from fedkey.models.config import ModelConfig
from fedkey.models.metrics import evaluate
from fedkey.models.model import LanguageModel
from fedkey.models.tokenizers import WordTokenizer
from fedkey_bench.paper.owner_words import bin_of, by_owners, main, owner_counts


def test_a_word_counts_the_owners_who_typed_it_and_sentence_ends_count_for_everyone():
    tok = WordTokenizer.build(["the cat", "the dog", "a cat"])
    counts = owner_counts(["the cat", "the dog", "a cat"], ["ann", "bob", "ann"], tok.encode)
    ids = tok.stoi
    assert counts[ids["the"]] == 2 and counts[ids["cat"]] == 1 and counts[ids["dog"]] == 1
    assert counts[tok.eos_id] == 2
    assert [bin_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 22)] == [
        "0", "1", "2-3", "2-3", "4-7", "4-7", "8-15", "16-31"
    ]  # fmt: skip
    groups = by_owners([(ids["cat"], 1.0), (ids["the"], 2.0), (ids["dog"], 3.0)], counts)
    assert groups == {"1": (2, 4.0), "2-3": (1, 2.0)}


def _checkpoint(tmp_path, name, tok, boost=None):
    cfg = ModelConfig(vocab_size=tok.vocab_size, emb_size=8, hidden_size=8)
    torch.manual_seed(0)
    model = LanguageModel(cfg)
    if boost is not None:
        with torch.no_grad():
            model.decoder.bias[boost] += 3.0
    return save_checkpoint(tmp_path / name / "checkpoints" / "round_0001.safetensors",
                           model_state(model), cfg, tok, round_idx=1, strategy="fedavg")  # fmt: skip


def test_the_table_splits_the_test_perplexity_by_owners(tmp_path, capsys):
    """The last row is the model's test perplexity as fedkey evaluates it; a model that favours
    the words typed by a single owner gets that group better and no other group better."""
    corpus = load_corpus("demo", paper_protocol=True)
    tok = WordTokenizer.build(corpus.train)
    counts = owner_counts(corpus.train, corpus.train_users, tok.encode)
    rare = [t for t, n in counts.items() if n == 1]
    plain = _checkpoint(tmp_path, "plain", tok)
    boosted = _checkpoint(tmp_path, "boosted", tok, boost=rare)
    assert main([str(plain), str(boosted), "--data", "demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "plain" in lines[0] and "boosted" in lines[0]
    rows = {
        r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    }
    model, _, _ = load_checkpoint(plain)
    want = evaluate(model, tok, corpus.test, accuracy=False)["ppl"]
    assert float(rows["all"][3]) == pytest.approx(want, rel=1e-3)
    assert sum(int(r[1]) for k, r in rows.items() if k != "all") == int(rows["all"][1])
    assert float(rows["1"][4]) < float(rows["1"][3])
    for k in rows.keys() - {"1", "all"}:
        assert float(rows[k][4]) >= float(rows[k][3]) or math.isclose(
            float(rows[k][4]), float(rows[k][3]), rel_tol=1e-3
        )


def test_a_missing_checkpoint_or_a_corpus_without_owners_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "none.safetensors"), "--data", "demo"])
    assert "no such checkpoint" in str(e.value.code)
    (tmp_path / "text").mkdir()
    for split in ("train", "valid", "test"):
        (tmp_path / "text" / f"{split}.txt").write_text("a b c\n")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "none.safetensors"), "--data", str(tmp_path / "text")])
    assert "has no owners" in str(e.value.code)
