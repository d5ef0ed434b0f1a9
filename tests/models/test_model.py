import pytest
import torch

from fedkey.models.config import ModelConfig
from fedkey.models.model import LanguageModel, num_parameters


@pytest.mark.parametrize("cell", ["gru", "lstm"])
@pytest.mark.parametrize("layers", [1, 2])
def test_forward_shapes_and_state_carry(cell, layers):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, cell=cell, emb_size=16, hidden_size=16, num_layers=layers)
    model = LanguageModel(cfg).eval()
    tokens = torch.randint(0, 50, (3, 7))
    logits, state = model(tokens)
    assert logits.shape == (3, 7, 50)
    # Feeding the sequence one token at a time with the state gives the same logits:
    # what the keyboard relies on to pay one step per word.
    s = model.init_state(3)
    steps = []
    for t in range(7):
        out, s = model(tokens[:, t : t + 1], s)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_logits_at_the_kept_positions_are_the_forwards(cell):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=50, cell=cell, emb_size=16, hidden_size=16))
    tokens = torch.randint(0, 50, (3, 7))
    keep = torch.rand(3, 7) < 0.5
    logits, _ = model(tokens)
    torch.testing.assert_close(model.logits_at(tokens, keep), logits[keep])
    assert model.logits_at(tokens, torch.zeros(3, 7, dtype=torch.bool)).shape == (0, 50)


def test_tied_shares_the_embedding():
    tied = LanguageModel(ModelConfig(vocab_size=100, emb_size=8, hidden_size=8, tied=True))
    untied = LanguageModel(ModelConfig(vocab_size=100, emb_size=8, hidden_size=8, tied=False))
    assert tied.decoder.weight is tied.embedding.weight
    assert num_parameters(untied) - num_parameters(tied) == 100 * 8


def test_presets_and_bad_configs():
    cfg = ModelConfig.preset("medium", 1000, cell="lstm")
    assert (cfg.emb_size, cfg.hidden_size, cfg.cell) == (650, 650, "lstm")
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("huge", 10)
    with pytest.raises(ValueError, match="tied embeddings need"):
        ModelConfig(vocab_size=10, emb_size=8, hidden_size=16, tied=True)
    with pytest.raises(ValueError, match="cell must be"):
        ModelConfig(vocab_size=10, cell="rnn")
