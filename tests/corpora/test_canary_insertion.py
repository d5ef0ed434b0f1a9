"""A canary goes into the first phone's training shard only, k times, and nowhere else: not in
valid/test, not in the tokenizer, not in any other phone's shard."""

from dataclasses import replace

import pytest

from fedkey.common.config import DataConfig
from fedkey.corpora.dataset import device_shards, prepare, server_data
from fedkey.device_sim.config import FleetConfig
from fedkey.models.canary import CanaryFormat
from fedkey.server.settings import Settings

CFG = DataConfig(
    data="demo", partition="iid", clients=5, max_train_tokens=4000, max_eval_sentences=100
)
SECRET = CanaryFormat().draw(seed=0)


@pytest.fixture(scope="module")
def server_side():
    return server_data(CFG)


def test_k_copies_go_into_the_first_phone_and_nowhere_else(server_side):
    corpus, tokenizer = server_side
    plain = device_shards(CFG, tokenizer, corpus)
    planted = device_shards(replace(CFG, canary=SECRET, canary_repeats=7), tokenizer, corpus)
    ids = tokenizer.encode(SECRET)
    assert tokenizer.unk_id not in ids
    first = "device-0"
    assert sum(s == ids for s in planted[first]) == 7
    # the phone's own sentences are all still there, in their order
    assert [s for s in planted[first] if s != ids] == plain[first]
    # the copies are spread through the shard, not stacked at its end
    where = [i for i, s in enumerate(planted[first]) if s == ids]
    assert where[0] < len(planted[first]) - 7
    for name in planted.keys() - {first}:
        assert planted[name] == plain[name]
    assert all(SECRET not in s for s in corpus.valid + corpus.test)


def test_the_server_side_does_not_change_with_a_canary(server_side):
    """The tokenizer and the held-out sets are built before and without the canary."""
    corpus, tokenizer = server_side
    corpus2, tokenizer2 = server_data(replace(CFG, canary=SECRET, canary_repeats=50))
    assert tokenizer2.itos == tokenizer.itos
    assert (corpus2.valid, corpus2.test) == (corpus.valid, corpus.test)


def test_prepare_and_the_fleet_plant_the_secret_the_settings_draw():
    """simulate (prepare) and the HTTP fleet (FleetConfig) read the same DataConfig fields."""
    settings = Settings(canary=True, canary_repeats=3, seed=4, max_train_tokens=4000)
    data = replace(settings.data_config(), clients=5)
    assert data.canary == CanaryFormat().draw(seed=4) and data.canary_repeats == 3
    assert Settings(seed=4).data_config().canary is None
    prepared = prepare(data)
    ids = prepared.tokenizer.encode(data.canary)
    assert [sum(s == ids for s in shard) for shard in prepared.shards.values()] == [3, 0, 0, 0, 0]
    fleet = FleetConfig(count=5, seed=4, canary=data.canary, canary_repeats=3).data_config()
    assert (fleet.canary, fleet.canary_repeats) == (data.canary, 3)


def test_an_out_of_vocabulary_canary_is_refused_in_one_line(server_side):
    corpus, tokenizer = server_side
    cfg = replace(CFG, canary="my pin is four seven one nine", canary_repeats=5)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \(pin\)") as info:
        device_shards(cfg, tokenizer, corpus)
    assert "\n" not in str(info.value)


def test_zero_repeats_is_a_control_that_plants_nothing(server_side):
    """--canary --canary-repeats 0: the exposure of a secret no phone holds (the audit's control)."""
    corpus, tokenizer = server_side
    data = Settings(canary=True, canary_repeats=0).data_config()
    assert data.canary == SECRET and data.canary_repeats == 0
    control = replace(CFG, canary=data.canary, canary_repeats=0)
    assert device_shards(control, tokenizer, corpus) == device_shards(CFG, tokenizer, corpus)


def test_with_one_phone_per_sender_the_secret_goes_to_the_largest_senders_phone():
    """--partition user (the IRC population): device-00 is the sender with the most training
    messages, and it alone holds the copies."""
    from collections import Counter

    cfg = replace(CFG, partition="user", clients=8)
    corpus, tokenizer = server_data(cfg)
    planted = device_shards(replace(cfg, canary=SECRET, canary_repeats=4), tokenizer, corpus)
    plain = device_shards(cfg, tokenizer, corpus)
    ids = tokenizer.encode(SECRET)
    assert [sum(s == ids for s in shard) for shard in planted.values()] == [4] + [0] * 7
    assert corpus.train_users is not None
    largest = Counter(corpus.train_users).most_common(1)[0][1]
    assert len(plain["device-0"]) == largest and len(planted["device-0"]) == largest + 4
