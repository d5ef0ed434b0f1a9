"""experiments/peers/workload.py, the peers' side, against fedkey's own code: it reads the shards
fedkey wrote, with the rounds' cohorts and seeds, and trains and scores as fedkey does."""

import torch

from fedkey_bench.peers.report import page
from fedkey_bench.peers.runner import Workload, write_shards
from tests.peers.helpers import DEMO, peers_workload

workload = peers_workload()


def test_the_peers_read_the_shards_and_train_as_fedkey_trains(tmp_path):
    from fedkey.common.config import TrainConfig
    from fedkey.device_sim.training.trainer import train_local
    from fedkey.federation.seeds import client_seed
    from fedkey.models.checkpoint import build_model
    from fedkey.models.config import ModelConfig

    w = Workload(data="demo", clients=10, max_train_tokens=3000, max_eval_sentences=20,
                 hidden_size=16, vocab_size=500)  # fmt: skip
    meta = write_shards(w, tmp_path / "s.npz")
    shards = workload.Shards(str(tmp_path / "s.npz"))
    assert len(shards.phones) == 10 and len(shards.test) == 20 == len(shards.valid)
    assert sum(len(p) for p in shards.phones) == meta["train_sentences"]
    assert shards.cohorts == meta["cohort_phones"] and len(shards.cohorts) == w.rounds
    phone = shards.cohorts[1][0]
    assert shards.seed(2, phone) == client_seed(w.seed, 2, f"device-{phone}")

    config = ModelConfig(vocab_size=meta["vocab_size"], emb_size=16, hidden_size=16)
    state = {k: torch.tensor(v) for k, v in shards.init.items()}
    ours = shards.model()
    theirs = build_model(config, state)
    tokens = torch.tensor([shards.test[0][:-1]])
    keep = torch.ones_like(tokens, dtype=torch.bool)
    assert torch.equal(ours.logits_at(tokens, keep), theirs.logits_at(tokens, keep))

    train = TrainConfig(epochs=1, batch_size=w.batch_size, lr=w.lr, momentum=w.momentum,
                        clip=w.clip, max_len=w.max_len, precision="fp32")  # fmt: skip
    seed = shards.seed(2, phone)
    fedkey_state = train_local(config, state, shards.phones[phone], train, seed=seed,
                               device="cpu").state  # fmt: skip
    workload.train_local(ours, shards.phones[phone], meta, seed=seed)
    for k, v in workload.federated_state(ours).items():
        torch.testing.assert_close(v, fedkey_state[k], rtol=1e-5, atol=1e-6)


def test_bf16_runs_the_forward_under_autocast_and_the_loss_in_fp32(tmp_path):
    w = Workload(**{**DEMO.__dict__, "precision": "bf16"})
    write_shards(w, tmp_path / "s.npz")
    shards = workload.Shards(str(tmp_path / "s.npz"))
    model = shards.model()
    assert model.precision == "bf16"
    inputs, targets = workload.pad_batch(shards.test[:4])
    with torch.no_grad():
        loss, n = model.nll(inputs, targets)
        model.precision = "fp32"
        exact, _ = model.nll(inputs, targets)
    assert loss.dtype == torch.float32 and n > 0
    assert abs(float(loss) / float(exact) - 1) < 0.02 and float(loss) != float(exact)


def test_one_phone_per_speaker_holds_that_speakers_messages_only(tmp_path):
    from fedkey.common.config import DataConfig
    from fedkey.corpora.dataset import load_cut

    w = Workload(data="demo", partition="user", clients=4, max_train_tokens=None,
                 max_eval_sentences=30, hidden_size=8, vocab_size=300)  # fmt: skip
    meta = write_shards(w, tmp_path / "s.npz")
    shards = workload.Shards(str(tmp_path / "s.npz"))
    corpus, _ = load_cut(
        DataConfig(data="demo", partition="user", clients=4, max_eval_sentences=30)
    )
    counts = sorted((corpus.train_users or []).count(u) for u in set(corpus.train_users or []))
    assert [len(p) for p in shards.phones] == sorted(counts, reverse=True)[:4]
    assert meta["partition"] == "user" and len(shards.test) == len(corpus.test)
    assert "one phone per speaker, the 4 with the most" in page(
        {"workloads": {w.name: {**meta, "bench_command": "b", "repeats": 1, "device": "cpu",
                                "fedkey_tree": ".", "git_commit": "abc", "date": "d"}},
         "rows": []}
    )  # fmt: skip


def test_held_out_senders_are_scored_by_the_peers_as_by_fedkey(tmp_path, monkeypatch):
    # fedkey's server scores the messages of senders who never trained every round on a corpus
    # that has them (Ubuntu IRC): the shards carry them and the peers' clock scores them too.
    import fedkey.corpora.dataset

    real = fedkey.corpora.dataset.prepare

    def with_unseen(cfg):
        prepared = real(cfg)
        prepared.corpus.unseen_test = prepared.corpus.test[:7]
        return prepared

    monkeypatch.setattr(fedkey.corpora.dataset, "prepare", with_unseen)
    w = Workload(data="demo", clients=4, max_train_tokens=2000, max_eval_sentences=20,
                 hidden_size=8, vocab_size=300)  # fmt: skip
    meta = write_shards(w, tmp_path / "s.npz")
    shards = workload.Shards(str(tmp_path / "s.npz"))
    assert meta["unseen_sentences"] == 7 and shards.unseen == shards.test[:7]
    model = shards.model()
    clock = workload.Clock(shards)
    got = clock.evaluate(model)
    assert got["unseen_ppl"] == workload.perplexity(model, shards.test[:7])
    assert set(got) == {"val_ppl", "test_ppl", "unseen_ppl"}
    line = clock.line("x", "1", clock.ends[0] - 1.0)
    assert '"round_ends_epoch"' in line and '"precision": "fp32"' in line
