"""`fedkey-bench typing` (fedkey_bench.typing) on a tiny in-memory setup: the demo corpus by owner,
a 40-word vocabulary, an 8-unit model, a 3-gram. A row with the cache off is the keyboard scored
as fedkey scores it without one (fedkey.models.metrics, KneserNey.evaluate); the mixture weight
is chosen on the validation text; the runs are the ones the issue asks for; the page leads with
the multiples of row (a)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fedkey.models.checkpoint import build_model, model_state, save_checkpoint
from fedkey.models.config import ModelConfig
from fedkey.models.metrics import evaluate, keystroke_savings
from fedkey.models.mixture import choose_weight, ngram_rows
from fedkey.models.ngram import KneserNey
from fedkey.models.personal_eval import by_sender
from fedkey.models.tokenizers import WordTokenizer
from fedkey_bench.typing import report, runner
from fedkey_bench.typing import score as scoring
from fedkey_bench.typing.score import HeldOut, Keyboard, model_log_probs, score_keyboards


@pytest.fixture(scope="module")
def tiny():
    """(tokenizer, 3-gram, model, held-out text): the demo corpus's first 1,500 messages train the
    3-gram; 80 later ones, by owner, are the held-out set; 60 more the validation text."""
    from fedkey.corpora.loaders import load_corpus

    demo = load_corpus("demo")
    train = demo.train[:1500]
    tok = WordTokenizer.build(train, max_size=40)
    ngram = KneserNey(tok, 3).fit(tok.encode(s) for s in train)
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=tok.vocab_size, emb_size=8, hidden_size=8))
    later, owners = demo.train[1500:1580], demo.train_users[1500:1580]
    held = HeldOut(valid=demo.valid[:60], sets={"phones": by_sender(later, owners)},
                   pooled=train)  # fmt: skip
    return tok, ngram, model, held


def _rows(keyboard: Keyboard, held: HeldOut) -> dict[bool, dict]:
    return {r["cache"]: r for r in score_keyboards([keyboard], held)}


def _messages(held: HeldOut) -> list[str]:
    return [m for msgs in held.sets["phones"].values() for m in msgs]


def test_the_cache_off_row_is_the_model_scored_without_a_cache(tiny):
    tok, _, model, held = tiny
    rows = _rows(Keyboard("base", "base", "base", tok, model=model_log_probs(model)), held)
    messages = _messages(held)
    plain = evaluate(model, tok, messages, precision="fp32")
    off = rows[False]
    for field in ("all_top1", "all_top3", "bar_top1", "bar_top3", "oov"):
        assert off[field] == pytest.approx(plain[field], abs=1e-12), field  # type: ignore[literal-required]
    assert off["ppl"] == pytest.approx(plain["ppl"], rel=1e-4)
    assert off["ksr"] == pytest.approx(keystroke_savings(model, tok, messages), abs=1e-9)
    on = rows[True]  # the same words, the cache mixed in: no perplexity of its own
    assert on["ppl"] is None and on["words"] == off["words"] and on["oov"] == off["oov"]
    assert on["seconds"] == off["seconds"]  # one pass scored both


def test_a_3gram_row_is_its_own_evaluate(tiny):
    tok, ngram, _, held = tiny
    off = _rows(Keyboard("kn", "3-gram", "public", tok, ngram=ngram), held)[False]
    own = ngram.evaluate(_messages(held))
    for field in ("all_top1", "all_top3", "bar_top1", "bar_top3", "oov"):
        assert off[field] == pytest.approx(own[field], abs=1e-12), field  # type: ignore[literal-required]
    assert off["ppl"] == pytest.approx(own["ppl"], rel=1e-9)
    assert off["ngram_weight"] is None


def _uniform(vocab: int):
    return lambda ids: np.full((len(ids) - 1, vocab), -math.log(vocab), dtype=np.float32)


def test_the_mixture_weight_is_chosen_on_the_validation_text(tiny):
    """A uniform 'model' against the 3-gram: on the 3-gram's own training text the 3-gram is
    weighted up, on random words the uniform model; the held-out messages scored are the same,
    so only the validation text decides, and the weight is choose_weight's on it."""
    tok, ngram, _, held = tiny
    rng = np.random.default_rng(0)
    words = tok.itos[3:]
    salad = [" ".join(rng.choice(words, size=8)) for _ in range(60)]
    uniform = _uniform(tok.vocab_size)
    keyboard = Keyboard("mix", "mix", "federated", tok, model=uniform, ngram=ngram)
    weights = {}
    for name, valid in (("own", held.pooled[:60]), ("salad", salad)):
        text = HeldOut(valid=valid, sets=held.sets, pooled=held.pooled)
        row = _rows(keyboard, text)[False]
        ids = [tok.encode(s) for s in valid]
        kn = np.concatenate([ngram_rows(ngram, i)[np.arange(len(i) - 1), i[1:]] for i in ids])
        model = np.full(len(kn), -math.log(tok.vocab_size))
        assert row["ngram_weight"] == choose_weight(model, kn, len(kn))[0]
        weights[name] = row["ngram_weight"]
    assert weights["own"] < weights["salad"]


def test_every_row_is_a_multiple_of_row_a_on_the_same_messages_and_cache():
    rows = [{"id": report.REFERENCE, "set": s, "cache": c, "all_top1": 0.2 if c else 0.1,
             "ksr": 0.4} for s in ("phones", "unseen") for c in (False, True)]  # fmt: skip
    rows.append({"id": "fedavg", "set": "phones", "cache": True, "all_top1": 0.3, "ksr": 0.5})
    got = scoring.with_ratios(rows)[-1]
    assert got["x_all_top1"] == pytest.approx(1.5) and got["x_ksr"] == pytest.approx(1.25)


def _row(id_: str, kind: str, run: str | None, top1: float, ksr: float, cache: bool = False,
         set_name: str = "phones") -> dict:  # fmt: skip
    return {"id": id_, "label": id_, "kind": kind, "run": run, "round": None, "set": set_name,
            "cache": cache, "ngram_weight": None, "ppl": 100.0, "all_top1": top1,
            "all_top3": top1, "bar_top1": top1, "bar_top3": top1, "ksr": ksr, "oov": 0.05,
            "words": 10, "seconds": 1.0}  # fmt: skip


def test_the_page_leads_with_the_multiples_against_the_targets(tmp_path):
    rows = scoring.with_ratios([
        _row(report.REFERENCE, "collected", None, 0.16, 0.30),
        _row("base", "base", None, 0.10, 0.20),
        _row("fedavg+kn3", "federated", "fedavg", 0.20, 0.36),
        _row("fedatt", "federated", "fedatt", 0.176, 0.33),
    ])  # fmt: skip
    line = "fedkey simulate --out /home/someone/fedkey/runs/x --data nus-sms"
    results = {"populations": {"nus-sms": {
        "label": "NUS SMS", "clients": 30, "rows": rows, "command": "fedkey-bench typing",
        "held_out": {"phones": {"senders": 2, "messages": 3, "words": 10}},
        "runs": {"fedavg": {"label": "FedAvg", "command": line, "rounds": 10, "rounds_done": 10,
                            "best_round": 7}},
        "settings": {"init": "/tmp/somewhere/base.safetensors", "ngram": "base"}}}}  # fmt: skip
    page = report.save(tmp_path, results).read_text()
    lead = page.split("\n\n")[1]
    assert "fedavg+kn3, has 1.25x the top-1" in lead and "target 1.30x: not met" in lead
    assert "1.20x its keystroke savings (target 1.15x: met)" in lead
    assert "FedAtt's best, fedatt, 1.10x (target 1.25x: not met)" in lead
    assert page.index(lead) < page.index("### NUS SMS: the phones' later messages")
    assert "/home/" not in page and "/tmp/" not in page and "[results.json](results.json)" in page
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert report.rebuild(tmp_path).read_text() == page  # from results.json alone


def test_the_lead_says_how_far_the_best_federated_perplexity_is_from_the_centralized():
    def ppl(id_: str, kind: str, value: float, **kw) -> dict:
        return {**_row(id_, kind, id_.split("+")[0] if kind != "collected" else None, 0.1, 0.3,
                       **kw), "ppl": value}  # fmt: skip

    rows = [ppl("fedavg", "federated", 104.0), ppl("fedatt", "federated", 110.0),
            ppl("fedavg+kn3", "federated", 90.0),  # a mixture: not the fine-tune alone
            ppl("fedadam", "federated", 80.0, set_name="unseen"),  # another held-out set
            ppl("central", "central", 100.0)]  # fmt: skip
    line = report.ppl_gap({"label": "Ubuntu IRC", "rows": rows})
    assert line is not None and "fine-tune, fedavg, 104.00 against" in line
    assert "1.04x (target at most 1.05x: met)" in line
    rows[0]["ppl"] = 106.0
    assert "1.06x (target at most 1.05x: not met)" in report.ppl_gap({"label": "x", "rows": rows})
    assert report.ppl_gap({"label": "x", "rows": rows[:2]}) is None  # no centralized run


def test_the_runs_are_the_issues(tmp_path):
    pop, p = runner.POPULATIONS["nus-sms"], runner.Protocol()
    specs = {s.name: s for s in runner.run_specs(pop, p)}
    assert list(specs) == ["fedavg", "fedadam", "fedatt", "central"]
    fedatt = " ".join(specs["fedatt"].argv)
    for part in ("fedkey simulate --init base", "--ngram base", "--data nus-sms",
                 "--partition user --clients 30", "--fraction 0.3 --rounds 10 --local-epochs 1",
                 "--lr 0.5 --lr-decay 0.95 --precision fp32", "--workers 2",
                 "--strategy fedatt --epsilon 0.4"):  # fmt: skip
        assert part in fedatt
    assert "--server-opt adam --server-momentum 0.9 --server-lr 0.01" in " ".join(
        specs["fedadam"].argv
    )
    central = " ".join(specs["central"].argv)
    assert central.startswith("fedkey train-central --init base") and "--epochs 3 " in central
    assert specs["central"].rounds == 3 and "--ngram" not in central


def test_a_run_is_scored_by_its_best_validation_checkpoint_and_done_once(tmp_path):
    pop, p = runner.POPULATIONS["nus-sms"], runner.Protocol(rounds=2)
    spec = runner.run_specs(pop, p)[0]
    run_dir = tmp_path / "fedavg"
    assert runner.best_checkpoint(spec, run_dir) is None
    (run_dir / "checkpoints").mkdir(parents=True)
    rows = [{"round": r, "val_ppl": v, "best_round": b} for r, v, b in ((0, 9, 0), (1, 5, 1),
                                                                       (2, 7, 1))]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "checkpoints" / "round_0001.safetensors").write_bytes(b"x")
    assert runner.best_checkpoint(spec, run_dir) == (
        run_dir / "checkpoints" / "round_0001.safetensors", 1)  # fmt: skip
    line = " ".join(runner.command_line(spec, run_dir)).replace("--workers 2", "--workers 8")
    assert runner.is_done(spec, run_dir, {"command": line})  # where it ran aside
    other = line.replace("--lr 0.5", "--lr 1")
    assert not runner.is_done(spec, run_dir, {"command": other})


def test_score_only_writes_the_table_of_the_runs_there_are(tiny, tmp_path, monkeypatch):
    """A base and its 3-gram on disk, one FedAvg checkpoint: --score-only scores rows (a) to (e)
    (a run without a checkpoint marked missing) and writes results.json and the page."""
    tok, ngram, model, held = tiny
    base = save_checkpoint(tmp_path / "base.safetensors", model_state(model), model.config, tok,
                           round_idx=0, strategy="central")  # fmt: skip
    public = ngram.save(tmp_path / "ngram.safetensors", "demo")
    p = runner.Protocol(init=str(base), ngram=str(public), rounds=1)
    out = tmp_path / "out"
    run_dir = out / "runs" / "nus-sms" / "fedavg"
    (run_dir / "checkpoints").mkdir(parents=True)
    save_checkpoint(run_dir / "checkpoints" / "round_0001.safetensors", model_state(model),
                    model.config, tok, round_idx=1, strategy="fedavg")  # fmt: skip
    (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 1, "best_round": 1}) + "\n")
    few = HeldOut(valid=held.valid[:20], sets={"phones": scoring.first_senders(
        held.sets["phones"], 3)}, pooled=held.pooled)  # fmt: skip
    monkeypatch.setattr(scoring, "load_held_out", lambda *a, **k: few)
    monkeypatch.setattr(scoring, "COLLECTED_VOCAB", 40)  # row (a)'s vocabulary, as small
    page = runner.run_typing(["nus-sms"], p, out, "fedkey-bench typing --score-only", True)
    entry = json.loads((out / "results.json").read_text())["populations"]["nus-sms"]
    ids = [r["id"] for r in entry["rows"] if r["set"] == "phones" and not r["cache"]]
    assert ids == ["kn3-phones", "kn3-public", "base", "base+kn3", "fedavg", "fedavg+kn3"]
    assert entry["runs"]["fedavg"]["best_round"] == 1 and entry["runs"]["fedatt"]["missing"]
    text = page.read_text()
    assert "the best federated keyboard, FedAvg" in text.split("\n\n")[1]
    assert str(tmp_path) not in text
