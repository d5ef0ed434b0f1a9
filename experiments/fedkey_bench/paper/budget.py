"""How long a bench run will take, judged from the runs already done, so that a bench with a time
limit (`fedkey-bench paper --hours H`: a cluster job's walltime, a machine lent for a session)
starts only the runs that will finish inside it, instead of spending its last hours on runs it
would have to kill.

A run's work is counted in passes over its dataset's training text: rounds x C x E for a
federated run (FedSGD: C 1; AdaFL: its mean fraction over the run), the epochs of a centralized
run, one pass for the n-gram. Evaluation (validation and test every round) is counted per round:
a run that records its rounds' own seconds (`train_seconds`, training and aggregation) splits its
time into seconds per pass and seconds of evaluation per round, so FedSGD (ten times the passes
of a run at C 0.1 for as many rounds) is not charged ten times the evaluation; a run from before
that field folds both into one rate per pass. Each rate, per byte of training
text, is the median of the latest RECENT of the preset's finished runs on this machine's device
(a GPU's runs say nothing of a CPU's pace) with the same verb (simulate, train-central, ngram) on
the same dataset (the latest: a faster trainer or a busier machine shows within two runs), else
of all those on the other datasets (WikiText-2's first runs are judged by PTB's, scaled by the
size of its training file). The demo corpus, where start-up costs outweigh its small text, is
judged by its own runs only. A resumed run counts with the time of all its attempts
(fedkey_bench.common.runs.run_seconds), or not at all when an earlier one was not timed; a run that can resume
here counts only its rounds still to do.

A run on a CPU counts by its CPU seconds (fedkey_bench.common.runs.run_cpu_seconds) where it recorded them,
else by its wall time: a run's wall time grows with whatever else shared the cores (a PTB run
took 2.7 h beside three others on 2 cores, under 1 h beside one), its CPU time hardly does. So
the pace is that of a run with a core of its own, and a bench running more runs at once than
there are cores (`crowd`, jobs per core) expects each to take that much longer.

When no run left fits in the time left, the bench uses its free slots to advance the runs that
can resume (fedkey_bench.paper.runner.run_bench's `advance`), if one round of theirs fits: stopped at the limit,
they keep their checkpoints, and the next bench continues them. So runs longer than any one
session (FedSGD: every phone every round) still finish, over several.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from pathlib import Path

from fedkey_bench.common.runs import can_resume, rounds_done, run_cpu_seconds, run_seconds
from fedkey_bench.paper.spec import command_flag

#: About how many bytes of training text one word of PTB or WikiText-2 takes (5.5 and 5.2).
BYTES_PER_WORD = 5.5
#: How many of the latest runs of a verb on a dataset set its pace.
RECENT = 3


def _flag(cmd: str, names: tuple[str, ...], default: float) -> float:
    """The number given in `cmd` under any of `names` (a flag and its short form), else
    `default`."""
    value = command_flag(cmd, *names)
    return default if value == "-" else float(value)


def passes(cmd: str) -> float | None:
    """Passes over the training text that the fedkey command line `cmd` makes (None: a verb the
    bench does not time)."""
    words = cmd.split()
    verb = words[1] if len(words) > 1 else ""
    if verb == "ngram":
        return 1.0
    if verb == "train-central":
        return _flag(cmd, ("--epochs",), 1)
    if verb not in ("simulate", "run"):
        return None
    from fedkey.server.settings import Settings  # the CLI's defaults are the Settings defaults

    defaults = Settings.model_fields
    rounds = int(_flag(cmd, ("--rounds", "-R"), defaults["rounds"].default))
    epochs = _flag(cmd, ("--local-epochs", "-E"), defaults["local_epochs"].default)
    if "--adafl" in words:
        fraction = _adafl_mean_fraction(rounds)
    elif command_flag(cmd, "--strategy") == "fedsgd":
        fraction = 1.0  # FedSGD takes every phone, whatever --fraction says
    else:
        fraction = _flag(cmd, ("--fraction", "-C"), defaults["fraction"].default)
    return rounds * fraction * epochs


def _adafl_mean_fraction(rounds: int) -> float:
    """AdaFL's dynamic fraction (0.1 -> 0.5 by default), averaged over a run of `rounds`."""
    from fedkey.federation.strategies.selection import AdaFLSelector

    selector = AdaFLSelector()
    selector.setup({}, rounds)
    return sum(selector.gamma(t) for t in range(rounds)) / rounds


def train_bytes(data_root: Path, dataset: str, cmd: str) -> float | None:
    """The training text a run reads, in bytes: its train.txt, or the --max-train-tokens cut of
    it (None: the demo corpus, or a dataset not on this machine)."""
    path = data_root / dataset / "train.txt"
    if dataset == "demo" or not path.is_file():
        return None
    size = float(path.stat().st_size)
    cap = command_flag(cmd, "--max-train-tokens")
    return size if cap == "-" else min(size, float(cap) * BYTES_PER_WORD)


def done_share(run_dir: Path, cmd: str) -> float:
    """The share of a run that an interrupted attempt left in RUN_DIR (0 to 1): the rounds (or
    epochs) of its metrics.jsonl, when the same command left it there (fedkey_bench.common.runs resumes it)."""
    if not can_resume(run_dir, cmd):
        return 0.0
    n = units(cmd)
    return min(1.0, rounds_done(run_dir) / n) if n > 0 else 0.0


def units(cmd: str) -> float:
    """The rounds of a federated command line, the epochs of a centralized one: the pieces it
    checkpoints after (0: not given)."""
    central = cmd.split()[1] == "train-central"
    return _flag(cmd, ("--epochs",) if central else ("--rounds", "-R"), 0)


def cores() -> int:
    """The CPU cores this process may run on (a container's or taskset's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Pace:
    """Seconds a run will take, from the preset's finished runs (results.json objects, in the
    order they finished) on `device` (fedkey_bench.common.runs.device_label; None: on any), when `crowd` runs
    share each core (the bench's jobs per core, 1 at most one each)."""

    def __init__(
        self, runs: Iterable[dict], data_root: Path, device: str | None = None, crowd: float = 1.0
    ):
        self.data_root, self.crowd = data_root, max(1.0, crowd)
        # (verb, dataset) -> per run: (seconds per pass, and split, where the run records its
        # rounds' own seconds: (seconds per pass, seconds of evaluation per round)), per byte
        # of training text (the demo corpus: per pass, per round)
        self.rates: dict[tuple[str, str], list[tuple[float, tuple[float, float] | None]]] = {}
        for r in runs:
            cmd = r.get("command", "")
            work, n = passes(cmd), units(cmd)
            untimed = r.get("resumed") and r.get("earlier_seconds") is None
            wall = run_seconds(r) if r.get("wall_seconds") and not untimed else None
            if not wall or not work:
                continue
            if device is not None and r.get("device") != device:
                continue
            cpu = run_cpu_seconds(r) if str(r.get("device", "")).startswith("cpu") else None
            # a core's time: the rounds' own seconds (train_seconds, wall) in the same share
            took = wall if not cpu else cpu
            scale = 1.0 if r["dataset"] == "demo" else train_bytes(data_root, r["dataset"], cmd)
            if not scale:
                continue
            train = r.get("train_seconds")
            split = None
            if train is not None and n > 0 and train <= wall:
                train *= took / wall
                split = (train / (work * scale), (took - train) / (n * scale))
            self.rates.setdefault((cmd.split()[1], r["dataset"]), []).append(
                (took / (work * scale), split)
            )

    def seconds(self, dataset: str, cmd: str, run_dir: Path | None = None) -> float | None:
        """The expected wall time of the run `cmd` on `dataset` (None: no finished run to judge it
        by), less the share an interrupted attempt in `run_dir` already did. Evaluation is
        charged per round where every run that judges it split its time, else per pass."""
        work, verb = passes(cmd), cmd.split()[1]
        if not work:
            return None
        scale = 1.0 if dataset == "demo" else train_bytes(self.data_root, dataset, cmd)
        rates = self._recent(verb, dataset)
        if not rates or not scale:
            return None
        left = 1.0 - (done_share(run_dir, cmd) if run_dir is not None else 0.0)
        splits = [split for _, split in rates if split is not None]
        if len(splits) < len(rates):
            return statistics.median(rate for rate, _ in rates) * work * scale * left * self.crowd
        per_pass = statistics.median(t for t, _ in splits)
        per_round = statistics.median(e for _, e in splits)
        return (per_pass * work + per_round * units(cmd)) * scale * left * self.crowd

    def _recent(self, verb: str, dataset: str) -> list[tuple[float, tuple[float, float] | None]]:
        """The latest RECENT runs of `verb` on `dataset`; none there, every one of `verb` on the
        other datasets (WikiText-2's first runs judged by PTB's); the demo corpus, where start-up
        costs outweigh its small text, by its own only."""
        mine = self.rates.get((verb, dataset), [])[-RECENT:]
        if mine or dataset == "demo":
            return mine
        return [x for (v, d), xs in self.rates.items() if v == verb and d != "demo" for x in xs]

    def step_seconds(self, dataset: str, cmd: str) -> float | None:
        """The expected seconds of one round (a centralized run: one epoch) of `cmd`: the least
        that a run stopped at a time limit keeps (None: nothing to judge it by)."""
        total, n = self.seconds(dataset, cmd), units(cmd)
        return total / n if total is not None and n > 0 else None


def duration(seconds: float) -> str:
    """A duration as a person reads it: 40 min, 2.5 h."""
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
