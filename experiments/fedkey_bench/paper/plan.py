"""What `fedkey-bench paper` runs: the runs a preset's suites make from the results so far, in
the order they run, each one's fedkey command line, and the recorded runs whose command the
preset no longer makes."""

from __future__ import annotations

import fnmatch
import shlex
from dataclasses import replace
from pathlib import Path

from fedkey_bench.common.runs import what_it_computes
from fedkey_bench.paper.presets import Preset
from fedkey_bench.paper.spec import DATASETS, RunSpec
from fedkey_bench.paper.suites import PLANNED, suite_runs


def command(spec: RunSpec, preset: Preset, data_root: Path, run_dir: Path) -> list[str]:
    """The fedkey command line of one run (without the interpreter)."""
    cmd = _command(spec, preset, data_root, run_dir)
    return cmd if spec.paper_protocol else [w for w in cmd if w != "--paper-protocol"]


def _command(spec: RunSpec, preset: Preset, data_root: Path, run_dir: Path) -> list[str]:
    data = ["--data", "demo" if spec.dataset == "demo" else str(data_root / spec.dataset)]
    workers = [] if preset.workers is None else ["--workers", str(preset.workers)]
    if spec.kind == "ngram":
        clients = ["--clients", str(spec.clients)] if spec.clients != 100 else []
        return ["fedkey", "ngram", *data, "--order", "3",
                *_data_flags(preset, spec.full_train, spec.full_eval, spec.seed), "--out",
                str(run_dir), *clients, *spec.args]  # fmt: skip
    if spec.kind == "central":
        # The preset's lr and epochs unless the spec names its own.
        own = {"--lr": str(preset.lr), "--epochs": str(preset.central_epochs)}
        if spec.lr is not None:
            own["--lr"] = f"{spec.lr:g}"
        own.update(zip(spec.args[::2], spec.args[1::2], strict=True))
        lr, epochs = own.pop("--lr"), own.pop("--epochs")
        return ["fedkey", "train-central", *data,
                *_data_flags(preset, spec.full_train, spec.full_eval, spec.seed),
                "--clients", str(spec.clients), "--lr", lr, "--momentum", "0.5",
                "--batch-size", "10", "--epochs", epochs, "--out", str(run_dir),
                *workers, *(w for flag in own.items() for w in flag)]  # fmt: skip
    verb = "simulate" if preset.transport == "inprocess" else "run"
    flags = preset.flags(
        spec.full_train, spec.full_eval, spec.lr, spec.rounds, spec.clients, spec.seed
    )
    cmd = ["fedkey", verb, *data, *flags, "--out", str(run_dir)]
    if spec.partition != "iid":
        cmd += ["--partition", spec.partition]
    if spec.fraction is not None:
        cmd += ["--fraction", f"{spec.fraction:g}"]
    # The papers' methods as published: no server-side bounding (fedkey's default),
    # except under DP, whose analysis needs the clip, and where a spec names its own bound.
    unbounded = [] if {"--dp-clip", "--bound"} & set(spec.args) else ["--bound", "off"]
    return cmd + list(spec.args) + unbounded


def _data_flags(
    preset: Preset, full_train: bool = False, full_eval: bool = False, seed: int = 0
) -> list[str]:
    f = ["--paper-protocol", "--vocab-size", str(preset.vocab_size), "--seed", str(seed)]
    if preset.max_train_tokens and not full_train:
        f += ["--max-train-tokens", str(preset.max_train_tokens)]
    if preset.max_eval_sentences and not full_eval:
        f += ["--max-eval-sentences", str(preset.max_eval_sentences)]
    return f + ["--ksr-sentences", str(preset.ksr_sentences)]


def select(
    preset: Preset, suites: list[str], results: list[dict], only: list[str] | None = None
) -> list[RunSpec]:
    """The runs of `suites` decidable from `results`, in the order they run: the demo corpus
    first, all of it (its runs take a minute or two, its costliest a quarter of an hour, so the
    question of the noniid suite is answered on it days before WikiText-2 by article), then the
    datasets in DATASETS' order, each dataset's suites in the order given (PTB's sweep, then
    PTB's ranking, then WikiText-2's...), except that the ranking suites' costliest runs (LATE:
    FedSGD trains every phone every round, AdaFL up to half of them) wait until every other run
    is done, so the main methods' ranking comes days sooner. `only`: globs over the run ids."""
    unknown = [s for s in suites if s not in preset.suites]
    if unknown:
        raise ValueError(f"preset {preset.name} has no suite {', '.join(unknown)}; its suites: "
                         f"{', '.join(preset.suites)}")  # fmt: skip
    mine = [r for r in results if r.get("preset") == preset.name]
    specs = [s for suite in suites for s in suite_runs(suite, preset, mine)]
    if only:
        specs = [s for s in specs if any(fnmatch.fnmatch(s.id, pat) for pat in only)]
    order = {d: i for i, d in enumerate(("demo", *DATASETS))}

    def key(s: RunSpec) -> tuple[bool, int]:
        late = s.suite in ("rank", "noniid") and s.method in LATE and s.dataset != "demo"
        return late, order.get(s.dataset, 9)

    return sorted(specs, key=key)  # stable: the suites' order inside a dataset


def placed(preset: Preset, backend: str | None) -> Preset:
    """`preset` with its simulate runs trained on `backend` (fedkey.device_sim.training.backends; None: as the
    preset says): `stacked` trains a round's phones as one stacked model, so a GPU lent for a
    session can take a cpu preset's costliest runs (FedSGD trains every phone every round).
    Where a run ran is not what it computes (fedkey_bench.common.runs.what_it_computes): the runs are the
    preset's, done whichever way they ran, and each records its device."""
    if backend is None or backend == (preset.backend or "local"):
        return preset
    # the preset's --workers are the local backend's; another backend takes none
    return replace(preset, backend=None if backend == "local" else backend, workers=None)


def superseded(preset: Preset, runs: list[dict]) -> list[str]:
    """The ids of the preset's ranking-suite runs in `runs` whose command is not the one the
    preset makes for that id now (its protocol or the sweep's choice changed since they ran):
    kept in results.json until run again, not counted as done. A run's own --data and --out
    are taken as they were."""
    mine = [r for r in runs if r.get("preset") == preset.name]
    suites = [s for s in preset.suites if s in PLANNED]
    specs = {s.id: s for s in select(preset, suites, mine)} if suites else {}
    stale = []
    for r in mine:
        words = shlex.split(r.get("command", ""))
        if r["suite"] not in suites or "--data" not in words or "--out" not in words:
            continue  # not a command line of this bench's: nothing to compare it with
        spec = specs.get(r["id"])
        if spec is not None:
            data = Path(words[words.index("--data") + 1]).parent
            out = Path(words[words.index("--out") + 1])
            now = shlex.join(command(spec, preset, data, out))
            if what_it_computes(now) == what_it_computes(r["command"]):  # where it ran aside
                continue
        stale.append(r["id"])
    return stale


#: The ranking suites' runs that cost several times a run at C 0.1 (see select).
LATE = ("FedSGD", "AdaFL + FedAvg", "AdaFL + FedAtt")
