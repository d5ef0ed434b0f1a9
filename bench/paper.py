"""`fedkey bench paper`: the seed papers' experiments, run by the project's own commands.

Every run is one `fedkey simulate` (in-process) or `fedkey run` (server + phones over HTTP)
command line, executed as a child process; its metrics.jsonl is summarized into one object of
results.json with the command, the git commit and the device beside the numbers. Then
results.md puts our numbers beside the seed papers' table (FedAtt, Ji et al. 2019, Table II;
FedAttOpt, Jiang et al. 2020, Table 2; FedMed, Wu et al. 2020, Table 2) and curves_*.png show
perplexity per round.

Suites:
  paper    the seed papers' table: FedSGD, FedAvg, FedAtt, FedAttOpt, FedMed (+ topK 0.8),
           AdaFL + FedAvg / FedAtt, at C = 0.1 and 0.5, on PTB and WikiText-2
  privacy  the seed papers' randomization sweep (FedAtt, Ji et al. 2019, Table III) and DP-FedAvg
           at a few noise levels
  beyond   server optimizers, a learning-rate schedule, dropout, an LSTM cell, the centralized
           ceiling and a Kneser-Ney 3-gram baseline
  lr       evidence for the gap to the seed papers: their local optimizer (SGD lr 0.01, momentum
           0.5, B 10) trained centrally on all of PTB for 2 epochs (80% of the steps one
           client takes in their 50 rounds), beside the lr fedkey uses
  full     evidence too: FedAvg and FedAtt at C 0.1 with the preset's rounds, E and lr but all
           of the training data (presets that cut the data only)
  code     the seed papers' published code as it ran: their whole protocol (all data, 50 rounds,
           E 5, lr 0.01, no clipping) with the column batches of models.batching.column_batches,
           scored by their column perplexity, for FedAvg and FedAtt at C 0.1, whatever the preset

Presets: `gpu` is the seed papers' full protocol; `cpu` cuts rounds, local epochs and data so that
the paper suite fits an hour on two cores (the cut is written at the top of results.md). A run
whose command is already in results.json is not run again, so an interrupted bench resumes.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import re
import shlex
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bench.runs import run_fedkey
from common.files import atomic_write

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
DATASETS = ("ptb", "wikitext-2")
SUITES = ("paper", "privacy", "beyond", "lr", "full", "code")


@dataclass(frozen=True)
class Preset:
    """How much of the seed papers' protocol a preset runs."""

    name: str
    rounds: int
    local_epochs: int
    lr: float
    max_train_tokens: int | None  # None: all of the training split
    max_eval_sentences: int | None  # validation and test sentences each
    vocab_size: int  # the cap on the paper protocol's vocabulary (PTB has 10k words)
    ksr_sentences: int
    central_epochs: int
    transport: str  # "inprocess" (fedkey simulate) or "http" (fedkey run)
    note: str

    def flags(self, full_train: bool = False, full_eval: bool = False) -> list[str]:
        """The protocol's flags, shared by every federated run (``full_train`` / ``full_eval``:
        without the preset's cut of the training / evaluation data)."""
        f = ["--paper-protocol", "--clients", "100", "--rounds", str(self.rounds)]
        f += ["--local-epochs", str(self.local_epochs), "--batch-size", "10"]
        f += ["--lr", str(self.lr), "--momentum", "0.5", "--vocab-size", str(self.vocab_size)]
        f += ["--ksr-sentences", str(self.ksr_sentences), "--seed", "0"]
        if self.max_train_tokens and not full_train:
            f += ["--max-train-tokens", str(self.max_train_tokens)]
        if self.max_eval_sentences and not full_eval:
            f += ["--max-eval-sentences", str(self.max_eval_sentences)]
        return f


PRESETS = {
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
        transport="http",
        note="The seed papers' protocol: 100 IID clients, small tied GRU, E 5, B 10, SGD lr "
        "0.01 momentum 0.5, 50 rounds, vocabulary from all splits, full validation and test sets; "
        "every run through the real server and phone fleet over HTTP.",
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
    ),
    "cpu": Preset(
        name="cpu",
        rounds=8,
        local_epochs=1,
        lr=1.0,
        max_train_tokens=30_000,
        max_eval_sentences=300,
        vocab_size=10_000,
        ksr_sentences=20,
        central_epochs=10,
        transport="inprocess",
        note="Cut to fit an hour on 2 CPU cores: 8 rounds (not 50), E 1 (not 5), the first 30k "
        "training words of each dataset (3.4% of PTB's, 1.4% of WikiText-2's; 100 clients of ~300 "
        "words, 1-2 local steps a round), the first 300 validation and test sentences, WikiText-2's vocabulary capped at "
        "10k words, and local lr 1.0 instead of the seed papers' 0.01 (with 1-2 local steps a "
        "round lr 0.01 leaves the model at its initial perplexity; the 'lr 0.01' row shows it). "
        "Runs in-process (`fedkey simulate`), which gives the same weights as the HTTP path "
        "(`fedkey run`, the gpu preset's) bit for bit (tests/test_e2e_http.py).",
    ),
}


@dataclass(frozen=True)
class RunSpec:
    """One run of a suite: the command it is and where its number goes in the tables."""

    suite: str
    dataset: str
    method: str  # the label of the table row
    fraction: float | None  # C; None where the method picks its own (AdaFL)
    args: tuple[str, ...] = ()  # flags beyond the preset's
    kind: str = "federated"  # federated | central | ngram
    group: str = ""  # a column or sweep key inside a suite (privacy: beta / z)
    full_train: bool = False  # all of the training split, whatever the preset's cut
    full_eval: bool = False  # all of the validation and test splits, whatever the preset's cut

    @property
    def id(self) -> str:
        c = "auto" if self.fraction is None else f"c{self.fraction:g}"
        slug = re.sub(r"[^a-z0-9]+", "-", self.method.lower()).strip("-")
        return f"{self.suite}-{self.dataset}-{slug}-{c}"


def _fed(suite, dataset, method, fraction, *args, group="", full_train=False):
    return RunSpec(
        suite, dataset, method, fraction, tuple(args), group=group, full_train=full_train
    )


def paper_suite(datasets=DATASETS) -> list[RunSpec]:
    runs = []
    for ds in datasets:
        runs.append(_fed("paper", ds, "FedSGD", 1.0, "--strategy", "fedsgd"))
        for c in (0.1, 0.5):
            runs += [
                _fed("paper", ds, "FedAvg", c, "--strategy", "fedavg"),
                _fed("paper", ds, "FedAtt", c, "--strategy", "fedatt"),
                _fed("paper", ds, "FedAttOpt", c, "--strategy", "fedattopt"),
                _fed("paper", ds, "FedMed", c, "--strategy", "fedmed"),
                _fed(
                    "paper", ds, "FedMed topK 0.8", c, "--strategy", "fedmed", "--topk-beta", "0.8"
                ),
            ]
        # AdaFL's dynamic fraction (0.1 -> 0.5) replaces C: one run per aggregator.
        runs += [
            _fed("paper", ds, "AdaFL + FedAvg", None, "--strategy", "fedavg", "--adafl"),
            _fed("paper", ds, "AdaFL + FedAtt", None, "--strategy", "fedatt", "--adafl"),
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
            runs.append(_fed("paper", ds, "FedAvg, seeds' lr 0.01", 0.1,
                             "--strategy", "fedavg", "--lr", "0.01"))  # fmt: skip
        eps = f"{ATTOPT_EPSILON_C05:g}"
        runs.append(_fed("paper", ds, f"FedAttOpt, epsilon {eps}", 0.5,
                         "--strategy", "fedattopt", "--epsilon", eps))  # fmt: skip
    return runs


def privacy_suite(dataset: str = "wikitext-2") -> list[RunSpec]:
    runs = []
    for method, strategy in (("FedAvg", "fedavg"), ("FedAtt", "fedatt")):
        for beta in SEEDS_DP:
            runs.append(
                _fed(
                    "privacy",
                    dataset,
                    f"{method} beta {beta:g}",
                    0.1,
                    "--strategy",
                    strategy,
                    "--dp-beta",
                    f"{beta:g}",
                    group=f"beta={beta:g}",
                )  # fmt: skip
            )
    # DP-FedAvg (McMahan et al. 2018): half the clients per round, so the noise is split 50 ways.
    for z in (0.1, 0.3, 1.0):
        runs.append(
            _fed(
                "privacy",
                dataset,
                f"DP-FedAvg z {z:g}",
                0.5,
                "--strategy",
                "fedavg",
                "--dp-clip",
                "1.0",
                "--dp-noise-multiplier",
                f"{z:g}",
                group=f"z={z:g}",
            )  # fmt: skip
        )
    return runs


#: The server optimizers of Reddi et al. 2021 on any strategy's aggregate: (label suffix, flags).
SERVER_OPTS = (
    (" + server momentum 0.9", ("--server-opt", "momentum", "--server-lr", "1.0")),
    (" + FedAdam", ("--server-opt", "adam", "--server-lr", "0.01")),
)


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
        runs += [_fed("beyond", ds, m, 0.1, "--strategy", base, *a) for m, a in rows]
        runs.append(RunSpec("beyond", ds, "centralized (ceiling)", None, kind="central"))
        runs.append(RunSpec("beyond", ds, "Kneser-Ney 3-gram", None, kind="ngram"))
    return runs


#: SGD steps one client takes in the seed papers' protocol: 50 rounds x E 5 x 42 batches of 10 of
#: its ~420 PTB sentences. FedAvg of IID clients at a small lr moves about as far as one of them.
SEEDS_CLIENT_STEPS = 50 * 5 * 42


def lr_suite(preset: Preset) -> list[RunSpec]:
    """The seed papers' optimizer against ours, centrally on all of PTB for 2 epochs (~8.4k steps of
    B 10, 80% of SEEDS_CLIENT_STEPS; two hours of CPU would cover it all, the curve shows the
    trend): how far can lr 0.01 get in the steps the seed papers' protocol gives it?"""
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
    data: how much of the gap to the seed papers is the preset's cut of the data? And the server
    optimizers on FedAvg, where the preset's cut leaves too few steps to rank them."""
    if preset.max_train_tokens is None:
        return []  # the paper suite has these runs already
    runs = [
        _fed("full", ds, name, 0.1, "--strategy", strategy, full_train=True)
        for ds in datasets
        for name, strategy in (("FedAvg", "fedavg"), ("FedAtt", "fedatt"))
    ]
    return runs + [
        _fed("full", ds, "FedAvg" + suffix, 0.1, "--strategy", "fedavg", *flags, full_train=True)
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
        # FedAtt with their code's own defaults (options.py): step 1 and scipy's matrix 2-norm,
        # where fedkey's FedAtt (Plato's) takes 1.2 and the flattened L2 norm.
        args = ("--strategy", "fedatt", "--epsilon", "1", "--norm", "spectral", *SEEDS_CODE_FLAGS)
        runs.append(RunSpec("code", ds, "FedAtt, epsilon 1, spectral norm", 0.1, args,
                            full_train=True, full_eval=True))  # fmt: skip
        args = ("--positional", "--vocab-size", "50000")
        runs.append(RunSpec("code", ds, "position-only unigram", None, args, kind="ngram",
                            full_train=True, full_eval=True))  # fmt: skip
    return runs


def suite_runs(suite: str, preset: Preset) -> list[RunSpec]:
    if suite == "paper":
        return paper_suite() + paper_suite_extra(preset)
    if suite == "privacy":
        return privacy_suite()
    if suite == "beyond":
        return beyond_suite()
    if suite == "lr":
        return lr_suite(preset)
    if suite == "full":
        return full_suite(preset)
    if suite == "code":
        return code_suite()
    raise ValueError(f"unknown suite {suite!r}; valid: {', '.join(SUITES)}")


# -- running --------------------------------------------------------------------------------------


def command(spec: RunSpec, preset: Preset, data_root: Path, run_dir: Path) -> list[str]:
    """The fedkey command line of one run (without the interpreter)."""
    data = ["--data", str(data_root / spec.dataset)]
    if spec.kind == "ngram":
        return [
            "fedkey",
            "ngram",
            *data,
            "--order",
            "3",
            *_data_flags(preset, spec.full_train, spec.full_eval),
            "--out",
            str(run_dir),
            *spec.args,
        ]
    if spec.kind == "central":
        # The preset's lr and epochs unless the spec names its own.
        own = {"--lr": str(preset.lr), "--epochs": str(preset.central_epochs)}
        own.update(zip(spec.args[::2], spec.args[1::2], strict=True))
        return ["fedkey", "train-central", *data, *_data_flags(preset, spec.full_train),
                "--clients", "100", "--lr", own["--lr"], "--momentum", "0.5", "--batch-size",
                "10", "--epochs", own["--epochs"], "--out", str(run_dir)]  # fmt: skip
    verb = "simulate" if preset.transport == "inprocess" else "run"
    flags = preset.flags(spec.full_train, spec.full_eval)
    cmd = ["fedkey", verb, *data, *flags, "--out", str(run_dir)]
    if spec.fraction is not None:
        cmd += ["--fraction", f"{spec.fraction:g}"]
    # The papers' methods as published: no server-side bounding (fedkey's default since issue 15),
    # except under DP, whose analysis needs the clip.
    unbounded = [] if "--dp-clip" in spec.args else ["--bound", "off"]
    return cmd + list(spec.args) + unbounded


def _data_flags(preset: Preset, full_train: bool = False, full_eval: bool = False) -> list[str]:
    f = ["--paper-protocol", "--vocab-size", str(preset.vocab_size), "--seed", "0"]
    if preset.max_train_tokens and not full_train:
        f += ["--max-train-tokens", str(preset.max_train_tokens)]
    if preset.max_eval_sentences and not full_eval:
        f += ["--max-eval-sentences", str(preset.max_eval_sentences)]
    return f + ["--ksr-sentences", str(preset.ksr_sentences)]


def summarize(rows: list[dict], spec: RunSpec) -> dict:
    """One results.json object from a run's metrics rows (round 0 = the initial model)."""
    # Column-batched runs (the code suite) choose their best model by the seed papers' measure.
    key = "col_val_ppl" if "col_val_ppl" in rows[-1] else "val_ppl"
    best = min(rows, key=lambda r: r[key])
    below_90 = [r["round"] for r in rows if r["round"] > 0 and r["test_ppl"] < 90]
    return {
        "suite": spec.suite,
        "dataset": spec.dataset,
        "method": spec.method,
        "fraction": spec.fraction,
        "group": spec.group,
        "kind": spec.kind,
        "test_ppl": best["test_ppl"],  # of the best-validation model, as the seed papers report
        "best_val_ppl": best["val_ppl"],
        "best_round": best["round"],
        "final_test_ppl": rows[-1]["test_ppl"],
        "top1": best.get("top1"),
        "top3": best.get("top3"),
        "ksr": best.get("ksr"),
        "rounds": rows[-1]["round"],
        "rounds_to_ppl_90": below_90[0] if below_90 else None,
        "uplink_bytes": sum(r.get("bytes_up", 0) for r in rows),
        "downlink_bytes": sum(r.get("bytes_down", 0) for r in rows),
        "updates": sum(len(r.get("aggregated", [])) for r in rows),
        "epsilon": rows[-1].get("epsilon"),
        "curve": [[r["round"], r["val_ppl"], r["test_ppl"]] for r in rows],
        **(
            {
                "col_test_ppl": best["col_test_ppl"],
                "col_best_val_ppl": best["col_val_ppl"],
                "col_curve": [[r["round"], r["col_val_ppl"], r["col_test_ppl"]] for r in rows],
            }
            if key == "col_val_ppl"
            else {}
        ),
    }


def run_one(spec: RunSpec, preset: Preset, data_root: Path, runs_dir: Path) -> dict:
    """Run one spec as a child process; its summary, with the command and where it ran."""
    run_dir = runs_dir / spec.id
    cmd = command(spec, preset, data_root, run_dir)
    rows, provenance = run_fedkey(spec.id, cmd, run_dir)
    return {
        "id": spec.id,
        **summarize(rows, spec),
        **provenance,
        "preset": preset.name,
        "seed_ppl": seed_number(spec.suite, spec.dataset, spec.method, spec.fraction, spec.group),
    }


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


T = TypeVar("T")


class Bench:
    """results.json of a preset, updated one run at a time under a file lock (two suites may run
    side by side) and replaced atomically, so an interrupted bench loses at most its current run."""

    def __init__(self, out: Path):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "results.json"

    def read(self) -> list[dict]:
        return self._data()["runs"]

    def commands(self) -> list[str]:
        """The bench command lines that produced these results."""
        return self._data()["bench_commands"]

    def _data(self) -> dict:
        if not self.path.exists():
            return {"bench_commands": [], "runs": []}
        return json.loads(self.path.read_text())

    def done(self, spec_id: str, cmd: str) -> bool:
        return any(r["id"] == spec_id and r["command"] == cmd for r in self.read())

    def pending(
        self, items: Iterable[T], run: Callable[[T], tuple[str, list[str]]], dry_run: bool = False
    ) -> list[T]:
        """The items whose run (``run(item)``: its id and command line) is not in results.json
        with the same command: an interrupted bench resumes. With ``dry_run``, print every
        item's command line and return none."""
        todo = []
        for item in items:
            spec_id, argv = run(item)
            cmd = shlex.join(argv)
            if dry_run:
                print(cmd)
            elif not self.done(spec_id, cmd):
                todo.append(item)
        return todo

    def add(self, result: dict, bench_command: str) -> list[dict]:
        with (self.out / ".results.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._data()
            runs = [r for r in data["runs"] if r["id"] != result["id"]] + [result]
            cmds = data["bench_commands"] + [
                c for c in [bench_command] if c not in data["bench_commands"]
            ]
            atomic_write(self.path, json.dumps({"bench_commands": cmds, "runs": runs}, indent=1))
        return runs


def run_bench(
    preset_name: str,
    suites: list[str],
    data_root: Path,
    out: Path,
    runs_dir: Path,
    only: list[str] | None = None,
    dry_run: bool = False,
    bench_command: str = "",
    jobs: int = 1,
) -> list[dict]:
    """Run every selected spec not yet in OUT/<preset>/results.json, then write the report."""
    from tqdm import tqdm

    preset = PRESETS[preset_name]
    bench = Bench(out / preset.name)
    specs = [s for suite in suites for s in suite_runs(suite, preset)]
    if only:
        specs = [s for s in specs if any(fnmatch.fnmatch(s.id, pat) for pat in only)]
    missing = [d for d in {s.dataset for s in specs} if not (data_root / d).is_dir()]
    if missing:
        raise FileNotFoundError(f"no dataset {', '.join(missing)} under {data_root}")
    run_root = runs_dir / preset.name
    todo = bench.pending(
        specs, lambda s: (s.id, command(s, preset, data_root, run_root / s.id)), dry_run
    )
    if dry_run:
        return bench.read()
    # Runs are child processes, so threads are enough to keep `jobs` of them going at once: a
    # run's evaluation uses one core while its training pool waits, and another run fills the gap.
    bar = tqdm(total=len(todo), desc=f"bench paper --preset {preset.name}", unit="run")
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        futures = {pool.submit(run_one, s, preset, data_root, run_root): s for s in todo}
        for future in as_completed(futures):
            result = future.result()
            bench.add(result, bench_command)
            bar.update()
            bar.write(
                f"{result['id']}: test ppl {result['test_ppl']:.2f} "
                f"(best round {result['best_round']}), {result['wall_seconds']:.0f} s"
            )
    bar.close()
    from bench.paper_report import write_report

    runs = bench.read()
    for r in runs:  # the seed papers' numbers are this file's constants, as they are now
        r["seed_ppl"] = seed_number(
            r["suite"], r["dataset"], r["method"], r["fraction"], r["group"]
        )
    write_report(runs, preset, out / preset.name, bench.commands())
    return runs
