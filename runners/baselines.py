"""`fedkey train-central` and `fedkey ngram`: the baselines a federation is measured against, each
trained on the union of every phone's data. train_central is the ceiling (the same model, one
epoch a round of fedkey.runners.simulate's round engine, so its rows and checkpoints are a run's);
train_ngram the model a keyboard would otherwise ship (a Kneser-Ney n-gram, or a unigram by
position in the sentence), scored as round 0."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from tqdm import tqdm

from fedkey.common.config import DataConfig, TrainConfig
from fedkey.corpora.dataset import prepare
from fedkey.device_sim.ray_cluster import RayOptions
from fedkey.device_sim.training.backends import Backend, TrainingBackend, make_backend
from fedkey.device_sim.training.process_pool import LocalTask, run_task
from fedkey.federation.config import FederationConfig
from fedkey.federation.engine import client_seed
from fedkey.federation.storage import RunStorage
from fedkey.federation.strategies import ClientUpdate
from fedkey.runners.simulate import make_federation, start_or_resume

if TYPE_CHECKING:
    from fedkey.models.ngram import KneserNey
    from fedkey.models.positional import PositionalUnigram


def train_central(
    data: DataConfig,
    train: TrainConfig,
    model_config_for,
    out_dir: str,
    epochs: int,
    seed: int = 0,
    device: str = "auto",
    progress: bool = True,
    ksr_sentences: int = 100,
    backend: Backend = "local",
    ray: RayOptions | None = None,
    resume: bool = False,
    lr_decay: float = 1.0,
) -> list[dict]:
    """The ceiling: the same model trained on the union of every phone's data, one row per epoch.
    Epoch e trains with lr * lr_decay^(e-1), as round r of a federation with lr * lr_decay^(r-1).

    With `resume`, a run directory that already holds checkpoints continues after its last epoch
    (each epoch's seed depends on the epoch alone, so the weights are those of a run never
    stopped).

    Under `backend` "ray" each epoch is one task on one trainer actor of the cluster (e.g. on its
    GPU node: --ray-gpus-per-worker 1), the union put in the object store once; the server side
    (evaluation, checkpoints) stays here. Same seed, same weights as in this process."""
    trainer = (
        make_backend("ray", ray=replace(ray or RayOptions(), workers=1))
        if backend == "ray"
        else None
    )
    try:
        return _train_central(
            data,
            train,
            model_config_for,
            out_dir,
            epochs,
            seed,
            device,
            progress,
            ksr_sentences,
            trainer,
            resume,
            lr_decay,
        )
    finally:
        if trainer is not None:
            trainer.close()


def _train_central(
    data: DataConfig,
    train: TrainConfig,
    model_config_for,
    out_dir: str,
    epochs: int,
    seed: int,
    device: str,
    progress: bool,
    ksr_sentences: int,
    trainer: TrainingBackend | None,
    resume: bool,
    lr_decay: float,
) -> list[dict]:
    prepared = prepare(data)
    model_config = model_config_for(prepared.tokenizer.vocab_size)
    union = [s for shard in prepared.shards.values() for s in shard]
    fed = FederationConfig(
        strategy="fedavg",
        label="central",
        fraction=1.0,
        rounds=epochs,
        seed=seed,
        train=train,
        ksr_sentences=ksr_sentences,
        lr_decay=lr_decay,
        init=data.init,
    )
    federation = make_federation(fed, model_config, prepared, {"central": union}, out_dir, device)
    storage = federation.storage
    rows, resumed = start_or_resume(federation, resume)
    if resumed and progress:
        print(f"resumed after epoch {federation.round} of {epochs}", flush=True)
    for epoch in tqdm(
        range(federation.round + 1, epochs + 1),
        initial=federation.round,
        total=epochs,
        desc=f"central on {prepared.corpus.name}",
        disable=not progress,
        unit="epoch",
    ):
        plan = federation.plan_round(["central"])  # its train: this epoch's lr (lr_decay)
        plan.train = one_epoch = replace(plan.train, epochs=1)
        task = LocalTask(
            "central",
            union,
            client_seed(seed, epoch, "central"),
            model_config,
            one_epoch,
            device=device,
        )  # beta 0: phone_round is train_local
        if trainer is None:
            res = run_task(task, federation.global_state)
        else:
            res = trainer.train(task, federation.global_state)
        update = ClientUpdate(
            state=res.state,
            num_samples=res.num_tokens,
            train_loss=res.train_loss,
            device_id="central",
        )
        rows.append(federation.complete_round(plan, [update]))
    storage.plot(f"central on {prepared.corpus.name}")
    return rows


def _ngram_test_scores(
    lm: KneserNey | PositionalUnigram, sentences: list[str], ksr_sentences: int
) -> dict:
    """fedkey.models.metrics.TEST_FIELDS of an n-gram on held-out sentences, as a round records
    them (all_top1, all_top3 and oov included: the same counts as the model's)."""
    from fedkey.models.metrics import keystroke_savings_of, test_fields_of

    ksr = None
    if ksr_sentences > 0:
        ksr = keystroke_savings_of(lm.sentence_log_probs, lm.tokenizer, sentences[:ksr_sentences])
    return test_fields_of(lm.evaluate(sentences), ksr)


def train_ngram(
    data: DataConfig,
    order: int,
    out_dir: str,
    ksr_sentences: int = 100,
    positional: bool = False,
) -> list[dict]:
    """The baseline: a Kneser-Ney n-gram on the union of every phone's data, scored as a round.
    `positional`: a unigram by position in the sentence instead, with the seed papers'
    column perplexity (fedkey.models.positional.PositionalUnigram)."""
    from fedkey.models.ngram import KneserNey
    from fedkey.models.positional import PositionalUnigram
    from fedkey.models.tokenizers import WordTokenizer

    prepared = prepare(data)
    tokenizer = prepared.tokenizer
    if not isinstance(tokenizer, WordTokenizer):
        raise ValueError(
            f"the n-gram baselines need a word vocabulary (tokenizer 'word'), not {data.tokenizer!r}"
        )
    start = time.perf_counter()
    union = [s for shard in prepared.shards.values() for s in shard]
    lm: KneserNey | PositionalUnigram
    if positional:
        lm = PositionalUnigram(tokenizer).fit(union).choose_prior(prepared.corpus.valid)
        name = f"positional-unigram-prior-{lm.prior:.0f}"
        columns = {
            "col_val_ppl": lm.column_perplexity(prepared.corpus.valid),
            "col_test_ppl": lm.column_perplexity(prepared.corpus.test),
        }
    else:
        lm = KneserNey(tokenizer, order).fit(union)
        name, columns = f"kneser-ney-{order}", {}
    val = lm.evaluate(prepared.corpus.valid)
    test = _ngram_test_scores(lm, prepared.corpus.test, ksr_sentences)
    unseen: dict[str, object] = {}
    if prepared.corpus.unseen_test:  # the held-out senders' messages, as simulate scores them
        held = _ngram_test_scores(lm, prepared.corpus.unseen_test, ksr_sentences)
        unseen = {f"unseen_{k}": v for k, v in held.items()}
    row: dict[str, object] = {
        "round": 0,
        "strategy": name,
        "data": prepared.corpus.name,
        "selected": [],
        "aggregated": [],
        "val_ppl": val["ppl"],
        **test,
        **columns,
        **unseen,
        "best_round": 0,
        "best_val_ppl": val["ppl"],
        "best_test_ppl": test["test_ppl"],
        **{f"best_{k}": v for k, v in columns.items()},
        "bytes_up": 0,
        "bytes_down": 0,
        "epsilon": None,
        "seconds": round(time.perf_counter() - start, 3),
        "info": {"train_sentences": len(union)},
    }
    storage = RunStorage(out_dir)
    storage.reset()
    storage.append_metrics(row)
    return [row]
