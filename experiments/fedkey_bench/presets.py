"""The presets of `fedkey-bench paper`: how much of the seed papers' protocol a bench runs.

`cpu` and `gpu` rank the methods (issue 18, item 3): all of the training data, 50 rounds, the
papers' 100 IID phones, learning rates chosen on the validation set by the bench's own sweep
(Reddi et al. 2021, "Adaptive Federated Optimization", Section 5 and Appendix D: a grid over the
client and server learning rates, the best average validation metric chosen; the attentive
methods' server step epsilon likewise). `cpu` runs E = 1 at
C = 0.1 (days of background runs on two cores, resumable); `gpu` the papers' exact protocol,
E = 5 at C = 0.1 and 0.5; `smoke` is for tests and a first look.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """How much of the seed papers' protocol a preset runs."""

    name: str
    rounds: int
    local_epochs: int
    lr: float  # the local lr of a run whose suite does not choose it
    max_train_tokens: int | None  # None: all of the training split
    max_eval_sentences: int | None  # validation and test sentences each
    vocab_size: int  # the cap on the paper protocol's vocabulary (PTB has 10k words)
    ksr_sentences: int
    central_epochs: int  # a centralized run's epochs where its suite names none
    transport: str  # "inprocess" (fedkey simulate) or "http" (fedkey run)
    note: str
    suites: tuple[str, ...]  # the suites this preset runs
    fractions: tuple[float, ...] = (0.1,)  # the C of the ranking suites
    sweep_rounds: int = 10  # rounds of one short run of the learning-rate sweep
    client_lrs: tuple[float, ...] = ()  # the sweep's grid of local lrs (FedAvg)
    momentum_server_lrs: tuple[float, ...] = ()  # FedAvgM's server lrs (momentum 0.9)
    adam_server_lrs: tuple[float, ...] = ()  # FedAdam's server lrs
    # FedAtt's server step epsilon: the papers' 1.2 and two smaller ones (a step past the
    # farthest phone overshoots once the softmax of distances is one-hot).
    fedatt_steps: tuple[float, ...] = (0.1, 0.3, 1.2)
    # FedAttOpt's epsilon: its step moves each delta by epsilon / d_k^2 (d_k: the phone's
    # distance, 100-150 at the cpu preset's lr), so its useful values are far above the 1.2
    # published for client lr 0.01.
    fedattopt_steps: tuple[float, ...] = (10.0, 100.0, 1000.0)
    workers: int | None = None  # --workers of every simulate (None: the CLI's default)
    backend: str | None = None  # --backend of every simulate (None: the CLI's default, local)
    # --keep-checkpoints of every federated run (0: every round's). The bench keeps a finished
    # run's best and last rounds' either way; this bounds a run still going.
    keep_checkpoints: int = 0

    @property
    def results_folder(self) -> str:
        """Results go to OUT/<this>/, runs to RUNS/<this>/<id>: the preset's name."""
        return self.name

    def central_epochs_for(self, fraction: float) -> int:
        """Epochs of the centralized model that sees as many examples as a federated run at C:
        rounds x C x E passes over the training data (each selected phone trains E epochs of its
        1/100 of it). 50 x 0.1 x 1 = 5 for `cpu`."""
        return max(1, round(self.rounds * fraction * self.local_epochs))

    def flags(
        self,
        full_train: bool = False,
        full_eval: bool = False,
        lr: float | None = None,
        rounds: int | None = None,
        clients: int = 100,
        seed: int = 0,
    ) -> list[str]:
        """The protocol's flags, shared by every federated run (``full_train`` / ``full_eval``:
        without the preset's cut of the training / evaluation data; ``lr`` / ``rounds``: other
        than the preset's; ``seed``: --seed)."""
        f = ["--paper-protocol", "--clients", str(clients), "--rounds", str(rounds or self.rounds)]
        f += ["--local-epochs", str(self.local_epochs), "--batch-size", "10"]
        f += ["--lr", f"{lr:g}" if lr is not None else str(self.lr), "--momentum", "0.5"]
        f += ["--vocab-size", str(self.vocab_size), "--ksr-sentences", str(self.ksr_sentences)]
        f += ["--seed", str(seed)]  # here: the order of the old presets' commands (runs stay done)
        if self.max_train_tokens and not full_train:
            f += ["--max-train-tokens", str(self.max_train_tokens)]
        if self.max_eval_sentences and not full_eval:
            f += ["--max-eval-sentences", str(self.max_eval_sentences)]
        if self.keep_checkpoints:
            f += ["--keep-checkpoints", str(self.keep_checkpoints)]
        if self.workers is not None:
            f += ["--workers", str(self.workers)]
        if self.backend is not None:
            f += ["--backend", self.backend]
        return f


#: The suites of the presets that rank methods.
RANKING_SUITES = ("sweep", "rank", "noniid", "seeds", "code")

PRESETS = {
    "cpu": Preset(
        name="cpu",
        rounds=50,
        local_epochs=1,
        lr=1.0,
        max_train_tokens=None,
        max_eval_sentences=None,
        vocab_size=10_000,
        ksr_sentences=100,
        central_epochs=5,
        transport="inprocess",
        note="Issue 18's CPU ranking protocol: all of the training data, the papers' 100 IID "
        "phones, C 0.1, E 1, B 10, local SGD momentum 0.5, 50 rounds, full validation and test "
        "sets; the vocabulary capped at 10k words (PTB's own size; WikiText-2 has 33k, and the "
        "softmax is most of a step's work); client and server learning rates chosen on the "
        "validation set by the sweep suite. One process, one thread (`--workers 0`); runs "
        "in-process (`fedkey simulate`), which gives the HTTP path's weights bit for bit "
        "(tests/test_e2e_http.py). Days of background runs on 2 cores; the bench resumes.",
        suites=("real", "sweep", "rank", "noniid", "seeds", "decay", "dropout", "confirm"),
        fractions=(0.1,),
        sweep_rounds=10,
        client_lrs=(0.3, 1.0, 3.0),
        momentum_server_lrs=(0.1, 0.3, 1.0),
        adam_server_lrs=(0.003, 0.01, 0.03),
        workers=0,
    ),
    "gpu": Preset(
        name="gpu",
        rounds=50,
        local_epochs=5,
        lr=0.01,
        max_train_tokens=None,
        max_eval_sentences=None,
        vocab_size=50_000,  # WikiText-2's whole vocabulary (33k), as the seed papers built it
        ksr_sentences=200,
        central_epochs=20,
        # In-process, as `cpu`: its weights are the HTTP path's bit for bit, and an interrupted
        # run resumes, where a `fedkey run` started again. A GPU session's calls last 10
        # minutes: a 50-round run cut by one went on in the next.
        transport="inprocess",
        note="The seed papers' protocol: 100 IID clients, small tied GRU, E 5, B 10, SGD "
        "momentum 0.5, 50 rounds, C 0.1 and 0.5, vocabulary from all splits, full validation "
        "and test sets; a round's phones trained at once as one stacked model (`--backend "
        "stacked`: one process a run, its steps CUDA graphs; `--jobs N` runs N at once on the "
        "GPU). The learning rates are chosen on the validation set by the sweep suite "
        "(the papers' 0.01 is in its grid), each with a whole 50-round run: at E 5 a 10-round "
        "sweep chose lr 1, whose validation perplexity was best at round 7 and then rose "
        "(overfitting each phone's 420 sentences).",
        suites=(*RANKING_SUITES, "dropout"),
        # A GPU machine's disk is 64 GB, and 8 runs go at once: at WikiText-2's 33k words a
        # round's model is 45 MB, FedAdam's buffers 180 MB more. A resume needs only the latest.
        keep_checkpoints=2,
        fractions=(0.1, 0.5),
        sweep_rounds=50,
        # Its first runs went with 4 trainer processes (`--workers 4`); where a run ran is not
        # what it computes (fedkey_bench.runs.what_it_computes), so they stay done.
        backend="stacked",
        client_lrs=(0.01, 0.1, 1.0),
        momentum_server_lrs=(0.1, 0.3, 1.0),
        adam_server_lrs=(0.003, 0.01, 0.03),
    ),
    # For tests and a first look: minutes, numbers near the initial model's.
    "smoke": Preset(
        name="smoke",
        rounds=2,
        local_epochs=1,
        lr=1.0,
        max_train_tokens=3_000,
        max_eval_sentences=20,
        vocab_size=2_000,
        ksr_sentences=5,
        central_epochs=2,
        transport="inprocess",
        note="A smoke test of the pipeline: 2 rounds, 3k training words, 20 evaluation "
        "sentences, 2k-word vocabulary. Its numbers mean nothing.",
        suites=RANKING_SUITES,
        sweep_rounds=1,
        client_lrs=(0.5, 1.0),
        momentum_server_lrs=(1.0,),
        adam_server_lrs=(0.01,),
        fedatt_steps=(1.2,),
        fedattopt_steps=(1.2,),
    ),
}
