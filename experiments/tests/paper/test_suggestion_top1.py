"""`python -m fedkey_bench.paper.suggestion_top1`: top-1 / top-3 ranked over every token and over the words a
suggestion bar shows, for checkpoints and the 3-gram."""

import torch

from fedkey.corpora.loaders import load_corpus
from fedkey.models.checkpoint import model_state, save_checkpoint
from fedkey.models.config import ModelConfig
from fedkey.models.model import LanguageModel
from fedkey.models.tokenizers import WordTokenizer
from fedkey_bench.paper.suggestion_top1 import label, main


def test_the_bars_ranking_never_scores_below_the_models_own(tmp_path, capsys):
    """Leaving out tokens that are never a scored target can only move the targets up."""
    tok = WordTokenizer.build(load_corpus("demo").train)
    cfg = ModelConfig(vocab_size=tok.vocab_size, emb_size=8, hidden_size=8)
    torch.manual_seed(0)
    model = LanguageModel(cfg)
    with torch.no_grad():
        model.decoder.bias[tok.special_ids] = 10.0  # <unk> and </s> the likeliest everywhere,
        model.decoder.bias[3] = 5.0  # then the commonest word (words come by frequency)
    path = save_checkpoint(tmp_path / "run" / "checkpoints" / "round_0003.safetensors",
                           model_state(model), cfg, tok, round_idx=0, strategy="fedavg")  # fmt: skip
    assert main([str(path), "--data", "demo"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 2 * 2 + 2  # bf16 / fp32 x both rankings, and the 3-gram's two
    by = {(r[0].strip("| "), r[1], r[2].startswith("the bar")): float(r[3]) for r in rows}
    for (name, precision, bar), top1 in by.items():
        if not bar:
            assert by[(name, precision, True)] >= top1
    assert label(str(path)) == "run, round_0003"
    assert by[("run, round_0003", "fp32", False)] == 0.0  # the specials always came first
    assert by[("run, round_0003", "fp32", True)] > 0.0


def test_a_missing_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "none.safetensors"), "--data", "demo", "--no-ngram"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
