"""fedkey_bench.peers (runner and report) without the peers' venvs: the rows, the agreement check, the table, and that the
peer side (experiments/peers/workload.py) reads the shards fedkey wrote and computes what fedkey
computes."""

import importlib.util

import pytest
import torch

from fedkey_bench.peers.report import agreement, final_swing, page, table
from fedkey_bench.peers.runner import (
    PEERS,
    Workload,
    combine,
    error_row,
    make_row,
    merge,
    write_shards,
)

# The peers' side is no package (its scripts run in other venvs): loaded by its path.
_spec = importlib.util.spec_from_file_location("peers_workload", PEERS / "workload.py")
assert _spec is not None and _spec.loader is not None
workload = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workload)

W = Workload(rounds=3)


def _row(framework: str, ends: list[float], ppl: float, rss: int = 2**30) -> dict:
    return make_row(framework, "1.0", W, "cpu", f"{framework} run", ends,
                    [9000.0, 3000.0, 2000.0, ppl], 60.0, rss, [5.0, 3.0, 3.5])  # fmt: skip


def test_a_row_times_the_rounds_after_the_first():
    row = _row("flower", [10.0, 30.0, 34.0, 38.5], 1500.0)
    assert row["seconds_per_round"] == pytest.approx(4.25)  # (38.5 - 30) / 2: rounds 2 and 3
    assert row["first_round_s"] == pytest.approx(20.0)
    assert row["train_s"] == pytest.approx(3.25) and row["eval_s"] == pytest.approx(1.0)
    assert row["final_test_ppl"] == 1500.0 and row["initial_test_ppl"] == 9000.0
    assert row["peak_rss_mb"] == 1024.0 and row["rounds"] == 3
    with pytest.raises(ValueError, match="round ends"):
        make_row("pfl", "0.6", W, "cpu", "x", [1.0], [9000.0], 1.0, 0, [])


def test_one_round_is_timed_alone():
    row = make_row("pfl", "0.6", W, "cpu", "x", [2.0, 7.0], [9000.0, 5000.0], 9.0, 0, [4.0])
    assert row["seconds_per_round"] == 5.0 and row["train_s"] == 4.0


def test_a_perplexity_past_the_tolerance_voids_the_row():
    rows = [_row("fedkey", [0, 10, 14, 18], 1000.0), _row("flower", [0, 30, 36, 42], 1040.0),
            _row("pfl", [0, 5, 8, 11], 1100.0), error_row("x", W, "cpu", "c", "no pip")]  # fmt: skip
    assert agreement(rows) == {"fedkey": "reference", "flower": "agrees", "pfl": "void",
                               "x": "no result"}  # fmt: skip
    assert agreement(rows, tolerance=0.2)["pfl"] == "agrees"


def test_the_table_leads_with_fedkey_and_gives_the_ratios():
    rows = [_row("pfl", [0, 5, 8, 11], 1100.0), _row("fedkey", [0, 10, 14, 18], 1000.0),
            error_row("flower", W, "cpu", "c", "pip install failed")]  # fmt: skip
    lines = table(rows).splitlines()
    assert lines[0].startswith("| framework | version | s/round | ratio to fedkey |")
    assert lines[2] == "| fedkey | 1.0 | 4.00 | 1.00x | 1000.00 | 1024 MB |"
    assert "| flower | - | not run: pip install failed |" in lines[3]
    assert lines[4] == ("| pfl | 1.0 | 3.00 | 0.75x (void: perplexity disagrees) "
                        "| 1100.00 (+10.0%) | 1024 MB |")  # fmt: skip


def test_repeats_give_the_median_one_and_keep_every_figure():
    runs = [_row("flower", [0, 30, 36, 42], 1040.0, rss=2**31), error_row("flower", W, "c", "c", "x"),
            _row("flower", [0, 30, 34, 38], 1030.0), _row("flower", [0, 30, 38, 46], 1050.0)]  # fmt: skip
    row = combine(runs)
    assert row["seconds_per_round"] == 6.0 and row["final_test_ppl"] == 1040.0
    assert row["seconds_per_round_all"] == [4.0, 6.0, 8.0] and row["repeats"] == 4
    assert row["final_test_ppl_all"] == [1030.0, 1040.0, 1050.0]
    assert row["peak_rss_mb"] == 2048.0 and row["failed_repeats"] == ["x"]
    assert combine([runs[1]]) == runs[1]


def test_a_curve_still_swinging_at_its_end_is_flagged():
    lr1 = [9957.1, 8023.8, 2939.8, 2080.6, 1508.2, 1351.9, 1516.4, 1164.3, 1555.0, 1075.5, 1003.1]
    assert final_swing(lr1) == pytest.approx(1555.0 / 1164.3 - 1)
    assert final_swing([9957.1, 9090.3, 4997.7, 1938.6, 1511.3, 1289.1, 1218.5]) == 0.0
    assert final_swing([9957.0]) == 0.0


def test_the_page_leads_with_the_table_and_says_which_rows_are_void():
    from dataclasses import asdict

    meta = {**asdict(W), "vocab_size": 10_000, "train_sentences": 4500, "train_words": 99_443,
            "bench_command": "fedkey-bench peers", "repeats": 1, "device": "cpu: test",
            "fedkey_tree": ".", "git_commit": "abc", "date": "2026-01-01"}  # fmt: skip
    rows = [_row("fedkey", [0, 10, 14, 18], 1000.0), _row("pfl", [0, 5, 8, 11], 1100.0)]
    md = page({"workloads": {W.name: meta}, "rows": rows})
    assert md.index("| fedkey | 1.0 | 4.00 | 1.00x |") < md.index("**Void:** pfl")
    assert md.index("**Void:** pfl") < md.index("## How it was run")
    assert "`fedkey-bench peers` on cpu: test" in md


def test_a_new_run_replaces_the_rows_of_its_framework_and_workload():
    old = [{"framework": "fedkey", "workload": "a", "v": 1},
           {"framework": "fedkey", "workload": "b", "v": 1}]  # fmt: skip
    new = [{"framework": "fedkey", "workload": "a", "v": 2}]
    assert merge(old, new) == [old[1], new[0]]


def test_the_peers_read_the_shards_and_train_as_fedkey_trains(tmp_path):
    from fedkey.common.config import TrainConfig
    from fedkey.device_sim.training.trainer import train_local
    from fedkey.models.checkpoint import build_model
    from fedkey.models.config import ModelConfig

    w = Workload(data="demo", clients=10, max_train_tokens=3000, max_eval_sentences=20,
                 hidden_size=16, vocab_size=500)  # fmt: skip
    meta = write_shards(w, tmp_path / "s.npz")
    shards = workload.Shards(str(tmp_path / "s.npz"))
    assert len(shards.phones) == 10 and len(shards.test) == 20 == len(shards.valid)
    assert sum(len(p) for p in shards.phones) == meta["train_sentences"]

    config = ModelConfig(vocab_size=meta["vocab_size"], emb_size=16, hidden_size=16)
    state = {k: torch.tensor(v) for k, v in shards.init.items()}
    ours = shards.model()
    theirs = build_model(config, state)
    tokens = torch.tensor([shards.test[0][:-1]])
    keep = torch.ones_like(tokens, dtype=torch.bool)
    assert torch.equal(ours.logits_at(tokens, keep), theirs.logits_at(tokens, keep))

    train = TrainConfig(epochs=1, batch_size=w.batch_size, lr=w.lr, momentum=w.momentum,
                        clip=w.clip, max_len=w.max_len, precision="fp32")  # fmt: skip
    fedkey_state = train_local(config, state, shards.phones[0], train, seed=7, device="cpu").state
    workload.train_local(ours, shards.phones[0], meta, seed=7)
    for k, v in workload.federated_state(ours).items():
        torch.testing.assert_close(v, fedkey_state[k], rtol=1e-5, atol=1e-6)


def test_an_unknown_framework_is_one_error_line():
    from typer.testing import CliRunner

    from fedkey_bench.cli import app

    result = CliRunner().invoke(app, ["peers", "--framework", "tff"])
    assert (
        result.exit_code != 0
        and "--framework tff: choose from fedkey, flower, pfl" in result.output
    )


def test_the_presets_name_their_workload_from_its_sizes():
    from fedkey_bench.peers.runner import preset

    irc = preset("irc", rounds=10, lr=0.5)
    assert irc.name == "irc500u-c25-h64-lr0.5-r10"
    assert irc.partition == "user" and irc.max_train_tokens is None
    assert preset("ptb", rounds=10).name == "ptb100k-h64-lr1-r10"
    assert preset("irc", name="mine").name == "mine"
    with pytest.raises(ValueError, match="--preset tff: choose from ptb, irc"):
        preset("tff")


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
    got = workload.Clock(shards).evaluate(model)
    assert got["unseen_ppl"] == workload.perplexity(model, shards.test[:7])
    assert set(got) == {"val_ppl", "test_ppl", "unseen_ppl"}
