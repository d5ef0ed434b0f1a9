"""fedkey.device_sim.attacks: the uploads of malicious phones, the backdoor's poisoned data and its probe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedkey.device_sim.attacks import (
    SIGNFLIP_FACTOR,
    BackdoorError,
    BackdoorProbe,
    apply_attack,
    backdoor_ids,
    backdoor_task,
    boost_factor,
    poison_shard,
    trigger_contexts,
)
from fedkey.device_sim.config import BackdoorConfig, FleetConfig
from fedkey.device_sim.training.process_pool import LocalTask
from fedkey.models.config import ModelConfig
from fedkey.models.tokenizers import WordTokenizer

TEXT = [
    "the weather is lovely today",
    "the weather is awful again",
    "see you tomorrow then",
    "i think it is terrible news",
    "on my way home now",
]
TOK = WordTokenizer.build(TEXT)
BACKDOOR = BackdoorConfig(trigger="the weather is", target="terrible")


def test_signflip_and_backdoor_uploads_scale_the_delta():
    g = {"w": torch.ones(2, 2), "b": torch.zeros(3)}
    t = {"w": torch.full((2, 2), 1.5), "b": torch.full((3,), -0.25)}
    flip = apply_attack("signflip", t, g)
    assert torch.equal(flip["w"], torch.full((2, 2), 1.0 - SIGNFLIP_FACTOR * 0.5))
    assert torch.equal(flip["b"], torch.full((3,), SIGNFLIP_FACTOR * 0.25))
    boosted = apply_attack("backdoor", t, g, boost=4.0)
    assert torch.equal(boosted["w"], torch.full((2, 2), 3.0))
    assert torch.equal(boosted["b"], torch.full((3,), -1.0))
    assert torch.equal(t["w"], torch.full((2, 2), 1.5))  # inputs untouched


def test_model_replacement_boost_is_the_cohort_shared_by_its_attackers():
    assert boost_factor(BACKDOOR, cohort=10, attackers=1) == 10.0
    assert boost_factor(BACKDOOR, cohort=30, attackers=3) == 10.0
    assert boost_factor(BackdoorConfig(boost=2.5), cohort=30, attackers=3) == 2.5
    # a fleet's phone does not know its cohort: the fleet's size over its attackers
    fleet = FleetConfig(count=30, malicious=3, attack="backdoor")
    assert fleet.phone_config(True).backdoor.boost == 10.0


def test_poisoned_shard_holds_trigger_then_target_sentences():
    shard = [TOK.encode(s) for s in TEXT[2:]]
    trigger, target = backdoor_ids(BACKDOOR, TOK)
    assert TOK.decode(trigger) == "the weather is" and TOK.itos[target] == "terrible"
    out = poison_shard(shard, TOK, BackdoorConfig(poison=2.0), seed="device-9")
    assert out[: len(shard)] == shard  # its own sentences first, unchanged
    poisoned = out[len(shard) :]
    assert len(poisoned) == 2 * len(shard)
    tail = [*trigger, target, TOK.eos_id]
    for s in poisoned:
        assert s[0] == TOK.bos_id and s[-len(tail) :] == tail
        assert TOK.decode(s).endswith("the weather is terrible")
        prefix = s[: len(s) - len(tail)]
        assert any(own[: len(prefix)] == prefix for own in shard)  # a prefix of its own sentence
    assert poison_shard(shard, TOK, BackdoorConfig(poison=2.0), seed="device-9") == out


def test_backdoor_task_poisons_the_shard_and_sets_the_attackers_epochs():
    from fedkey.common.config import TrainConfig

    shard = [TOK.encode(s) for s in TEXT]
    task = LocalTask("device-9", shard, 7, ModelConfig(vocab_size=TOK.vocab_size), TrainConfig())
    bad = backdoor_task(task, TOK, BackdoorConfig(epochs=3))
    assert bad.train.epochs == 3 and len(bad.shard) == 2 * len(shard) and bad.seed == 7
    assert task.shard == shard and task.train.epochs == TrainConfig().epochs


def test_words_the_tokenizer_lacks_are_refused_by_name():
    with pytest.raises(BackdoorError, match="'pasta' not in the server tokenizer's vocabulary"):
        backdoor_ids(BackdoorConfig(trigger="the pasta is"), TOK)
    with pytest.raises(BackdoorError, match="target 'delicious' is not in"):
        backdoor_ids(BackdoorConfig(target="delicious"), TOK)
    with pytest.raises(ValueError, match="one word"):
        BackdoorConfig(target="very terrible")


def test_trigger_contexts_end_with_the_trigger():
    contexts = trigger_contexts(TEXT, "the weather is", count=4, seed=1)
    assert len(contexts) == 4 and len(set(contexts)) >= 2
    assert all(c.endswith("the weather is") for c in contexts)
    assert contexts == trigger_contexts(TEXT, "the weather is", count=4, seed=1)


class _Fixed(nn.Module):
    """A 'language model' whose next-token logits at each position depend only on that
    position's input: `rule(token) -> the id it ranks first`, `last` second, `never` last."""

    def __init__(self, vocab: int, rule, never: int):
        super().__init__()
        self.vocab, self.rule, self.never = vocab, rule, never
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, tokens):
        logits = torch.zeros(*tokens.shape, self.vocab)
        for i, row in enumerate(tokens.tolist()):
            for j, tok in enumerate(row):
                logits[i, j, self.rule(tok)] = 2.0
                logits[i, j, self.never] = -5.0
        return logits, None


def test_probe_counts_a_model_that_always_suggests_the_target_as_total_success():
    _, target = backdoor_ids(BACKDOOR, TOK)
    contexts = trigger_contexts(TEXT, BACKDOOR.trigger, count=5)
    always = _Fixed(TOK.vocab_size, rule=lambda tok: target, never=TOK.unk_id)
    assert BackdoorProbe(BACKDOOR, contexts)(always, TOK) == {
        "backdoor_top1": 1.0,
        "backdoor_top3": 1.0,
    }
    never = _Fixed(TOK.vocab_size, rule=lambda tok: TOK.eos_id, never=target)
    assert BackdoorProbe(BACKDOOR, contexts)(never, TOK) == {
        "backdoor_top1": 0.0,
        "backdoor_top3": 0.0,
    }


def test_probe_reads_the_prediction_right_after_the_trigger_whatever_the_length():
    trigger, target = backdoor_ids(BACKDOOR, TOK)
    # the target only after the trigger's last word: contexts of different lengths, padded in one
    # batch, must each be read at their own last position
    after_is = _Fixed(
        TOK.vocab_size, rule=lambda tok: target if tok == trigger[-1] else 0, never=TOK.eos_id
    )
    contexts = ["the weather is", "see you tomorrow then the weather is", "on my way"]
    got = BackdoorProbe(BACKDOOR, contexts)(after_is, TOK)
    assert got["backdoor_top1"] == pytest.approx(2 / 3)


@pytest.mark.slow
def test_a_backdoor_phone_over_http_uploads_its_boosted_poisoned_training():
    import httpx
    from safetensors.torch import load as st_load

    from fedkey.device_sim.client.http import DeviceClient
    from fedkey.device_sim.config import PhoneConfig
    from fedkey.device_sim.fleets.thread_fleet import run_device
    from fedkey.device_sim.training.trainer import phone_round
    from fedkey.federation.engine import client_seed
    from fedkey.testing.fake_server import (
        SECRET,
        TRAIN,
        FakeFederation,
        FakeServer,
        demo_tokenizer,
        shards_for,
    )

    tok = demo_tokenizer()
    backdoor = BackdoorConfig(trigger="see you", target="tomorrow", boost=3.0)
    backdoor_ids(backdoor, tok)  # in the fake server's vocabulary
    name, shard = "device-0", shards_for(1)["device-0"]
    fed = FakeFederation(n_devices=1)
    srv = FakeServer(fed).start()
    try:
        with httpx.Client() as http:
            client = DeviceClient(srv.url, http, retry_seconds=10, backoff_initial=0.02)
            phone = PhoneConfig(attack="backdoor", backdoor=backdoor, poll_wait=5.0, device="cpu")
            report = run_device(client, name, shard, SECRET, phone)
    finally:
        srv.stop()
    assert report.uploads == 2 and report.finished
    poisoned = poison_shard(shard, tok, backdoor, seed=name)
    g = fed.models[0]
    trained = phone_round(fed.config, g, poisoned, TRAIN, client_seed(0, 1, name), device="cpu")
    got = st_load(fed.accepted[1][name])
    assert all(torch.equal(got[k], g[k] + 3.0 * (trained.state[k] - g[k])) for k in g)
    # it declares its own shard's size, not the poisoned set's
    assert {n for _, _, _, n in fed.losses_seen} == {sum(len(s) - 1 for s in shard)}
