"""The old suites of `fedkey-bench paper` (preset `cpu-8round`, and any preset that names them):
the seed papers' table at the preset's cut and its evidence (paper, privacy, beyond, lr, full,
code), with the seed papers' published numbers they are held against. `code` is the evidence about
the seed papers' column measure.
"""

from __future__ import annotations

from bench.paper_spec import DATASETS, RunSpec, fed
from bench.presets import Preset

#: The seed papers' test perplexity (FedAtt, Ji et al. 2019, Table II; FedAttOpt, Jiang et al.
#: 2020, Table 2; FedMed, Wu et al. 2020, Table 2): (method, C) -> {dataset: ppl}.
SEEDS: dict[tuple[str, float], dict[str, float]] = {
    ("FedSGD", 1.0): {"wikitext-2": 112.45, "ptb": 155.27},
    ("FedAvg", 0.1): {"wikitext-2": 95.27, "ptb": 138.13},
    ("FedAtt", 0.1): {"wikitext-2": 91.82, "ptb": 115.43},
    ("FedAttOpt", 0.1): {"wikitext-2": 72.25, "ptb": 116.49},
    ("FedMed", 0.1): {"wikitext-2": 80.32, "ptb": 113.03},
    ("FedAvg", 0.5): {"wikitext-2": 79.75, "ptb": 128.24},
    ("FedAtt", 0.5): {"wikitext-2": 69.38, "ptb": 123.00},
    ("FedAttOpt", 0.5): {"wikitext-2": 75.58, "ptb": 117.82},
    ("FedMed", 0.5): {"wikitext-2": 68.42, "ptb": 122.23},
}
#: FedAtt, Ji et al. 2019, Table III (the paper does not name the dataset):
#: beta -> (FedAvg, FedAtt).
SEEDS_DP = {0.0: (88.21, 77.66), 0.001: (88.17, 77.76), 0.005: (88.36, 78.59),
            0.01: (89.74, 79.51), 0.05: (103.17, 101.82)}  # fmt: skip

#: The server optimizers of Reddi et al. 2021 on any strategy's aggregate: (label suffix, flags).
SERVER_OPTS = (
    (" + server momentum 0.9", ("--server-opt", "momentum", "--server-lr", "1.0")),
    (" + FedAdam", ("--server-opt", "adam", "--server-lr", "0.01")),
)


def paper_suite(datasets=DATASETS) -> list[RunSpec]:
    runs = []
    for ds in datasets:
        runs.append(fed("paper", ds, "FedSGD", 1.0, "--strategy", "fedsgd"))
        for c in (0.1, 0.5):
            runs += [
                fed("paper", ds, "FedAvg", c, "--strategy", "fedavg"),
                fed("paper", ds, "FedAtt", c, "--strategy", "fedatt"),
                fed("paper", ds, "FedAttOpt", c, "--strategy", "fedattopt"),
                fed("paper", ds, "FedMed", c, "--strategy", "fedmed"),
                fed(
                    "paper", ds, "FedMed topK 0.8", c, "--strategy", "fedmed", "--topk-beta", "0.8"
                ),
            ]
        runs += [
            fed("paper", ds, "AdaFL + FedAvg", None, "--strategy", "fedavg", "--adafl"),
            fed("paper", ds, "AdaFL + FedAtt", None, "--strategy", "fedatt", "--adafl"),
        ]
    return runs


#: FedAttOpt's server step at C 0.5: the paper (Jiang et al. 2020) gives no epsilon, and its
#: gradient is a sum over the m clients of terms of norm ~1/d_k, so the step grows with m. 1.2
#: (FedAtt's default, in its published code and the FedAtt/Plato summary) x 10/50
#: takes the step 1.2 takes at C 0.1.
ATTOPT_EPSILON_C05 = 0.24


def paper_suite_extra(preset: Preset, datasets=DATASETS) -> list[RunSpec]:
    """Evidence rows: FedAvg with the seed papers' lr where the preset changed it, and FedAttOpt at
    C 0.5 with its step scaled to the number of clients."""
    runs = []
    for ds in datasets:
        if preset.lr != 0.01:
            runs.append(fed("paper", ds, "FedAvg, seeds' lr 0.01", 0.1,
                             "--strategy", "fedavg", "--lr", "0.01"))  # fmt: skip
        eps = f"{ATTOPT_EPSILON_C05:g}"
        runs.append(fed("paper", ds, f"FedAttOpt, epsilon {eps}", 0.5,
                         "--strategy", "fedattopt", "--epsilon", eps))  # fmt: skip
    return runs


def privacy_suite(dataset: str = "wikitext-2") -> list[RunSpec]:
    runs = []
    for method, strategy in (("FedAvg", "fedavg"), ("FedAtt", "fedatt")):
        for beta in SEEDS_DP:
            runs.append(fed("privacy", dataset, f"{method} beta {beta:g}", 0.1, "--strategy",
                             strategy, "--dp-beta", f"{beta:g}", group=f"beta={beta:g}"))  # fmt: skip
    # DP-FedAvg (McMahan et al. 2018): half the clients per round, so the noise is split 50 ways.
    for z in (0.1, 0.3, 1.0):
        runs.append(fed("privacy", dataset, f"DP-FedAvg z {z:g}", 0.5, "--strategy", "fedavg",
                         "--dp-clip", "1.0", "--dp-noise-multiplier", f"{z:g}", group=f"z={z:g}"))  # fmt: skip
    return runs


def beyond_suite(datasets=DATASETS, base: str = "fedavg") -> list[RunSpec]:
    """Each known improvement as its own row on `base` at C = 0.1, plus ceiling and baseline."""
    name = {"fedavg": "FedAvg", "fedatt": "FedAtt"}[base]
    rows = (
        *((name + suffix, flags) for suffix, flags in SERVER_OPTS),
        (f"{name} + lr decay 0.8/round", ("--lr-decay", "0.8")),
        (f"{name} + dropout 0.1", ("--dropout", "0.1")),
        (f"{name}, LSTM cell", ("--cell", "lstm")),
    )
    runs = []
    for ds in datasets:
        runs += [fed("beyond", ds, m, 0.1, "--strategy", base, *a) for m, a in rows]
        runs.append(RunSpec("beyond", ds, "centralized (ceiling)", None, kind="central"))
        runs.append(RunSpec("beyond", ds, "Kneser-Ney 3-gram", None, kind="ngram"))
    return runs


#: SGD steps one client takes in the seed papers' protocol: 50 rounds x E 5 x 42 batches of 10 of
#: its ~420 PTB sentences. FedAvg of IID clients at a small lr moves about as far as one of them.
SEEDS_CLIENT_STEPS = 50 * 5 * 42


def lr_suite(preset: Preset) -> list[RunSpec]:
    """The seed papers' optimizer against ours, centrally on all of PTB for 2 epochs: how far can
    lr 0.01 get in the steps the seed papers' protocol gives it?"""
    epochs = str(min(2, preset.central_epochs))
    return [
        RunSpec(
            "lr",
            "ptb",
            f"centralized, SGD lr {lr:g} momentum 0.5",
            None,
            ("--lr", f"{lr:g}", "--epochs", epochs),
            kind="central",
            group=f"lr={lr:g}",
            full_train=True,
        )  # fmt: skip
        for lr in (0.01, 1.0)
    ]


def full_suite(preset: Preset, datasets=DATASETS) -> list[RunSpec]:
    """The seed papers' two headline methods at the preset's rounds, E and lr on all of the training
    data, and the server optimizers on FedAvg (presets that cut the data only)."""
    if preset.max_train_tokens is None:
        return []
    runs = [
        fed("full", ds, name, 0.1, "--strategy", strategy, full_train=True)
        for ds in datasets
        for name, strategy in (("FedAvg", "fedavg"), ("FedAtt", "fedatt"))
    ]
    return runs + [
        fed("full", ds, "FedAvg" + suffix, 0.1, "--strategy", "fedavg", *flags, full_train=True)
        for ds in datasets
        for suffix, flags in SERVER_OPTS
    ]


#: The seed papers' local training as their code ran it (fed-att src/utils/options.py, Update.py):
#: 50 rounds, E 5, SGD lr 0.01, no gradient clipping, every word in the vocabulary, batches of
#: columns. The preset's rounds, E and lr come first on the command line; these win.
SEEDS_CODE_FLAGS = ("--rounds", "50", "--local-epochs", "5", "--lr", "0.01", "--clip", "0",
                    "--vocab-size", "50000", "--batching", "columns")  # fmt: skip


def code_suite(datasets=DATASETS) -> list[RunSpec]:
    """FedAvg and FedAtt at C 0.1 as the seed papers' published code ran them, and a unigram by
    position in the sentence on the same measure: is the gap to their table the measure
    (column perplexity) rather than the methods?"""
    runs = []
    for ds in datasets:
        for name, strategy in (("FedAvg", "fedavg"), ("FedAtt", "fedatt")):
            args: tuple[str, ...] = ("--strategy", strategy, *SEEDS_CODE_FLAGS)
            runs.append(RunSpec("code", ds, name, 0.1, args, full_train=True, full_eval=True))
        args = ("--strategy", "fedatt", "--epsilon", "1", "--norm", "spectral", *SEEDS_CODE_FLAGS)
        runs.append(RunSpec("code", ds, "FedAtt, epsilon 1, spectral norm", 0.1, args,
                            full_train=True, full_eval=True))  # fmt: skip
        args = ("--positional", "--vocab-size", "50000")
        runs.append(RunSpec("code", ds, "position-only unigram", None, args, kind="ngram",
                            full_train=True, full_eval=True))  # fmt: skip
    return runs


def seed_number(
    suite: str, dataset: str, method: str, fraction: float | None, group: str = ""
) -> float | None:
    """The seed papers' number for the same experiment, where they published one (a code-suite
    variant, "FedAtt, ...", is held against the seed papers' row of its method)."""
    if suite == "code" and fraction is not None:
        method = method.split(",")[0]
    if suite in ("paper", "code") and fraction is not None:
        return SEEDS.get((method, fraction), {}).get(dataset)
    if suite == "privacy" and group.startswith("beta="):
        pair = SEEDS_DP.get(float(group.split("=")[1]))
        return pair and pair[0 if method.startswith("FedAvg") else 1]
    return None
