"""`fedkey-bench peers`: one federated workload in fedkey, in Flower's Simulation Engine and in
pfl-research, head to head, each round the same work.

The workload (:class:`Workload`, three presets in :data:`PRESETS`) is the same in all three: a
corpus cut and partitioned by fedkey's own corpus code (``ptb``: PTB's training split cut to its
first ``max_train_tokens`` words, IID over 100 phones; ``irc``: the Ubuntu IRC population, one
phone per speaker, the ``clients`` most active ones, as `fedkey simulate --data ubuntu-irc
--partition user --clients K` makes them; ``irc5k``: its 5,000 most active speakers, 1,000 a
round) and written once to a shared .npz (each phone's encoded sentences, the validation and test
sentences, the initial weights of fedkey's round 0), so every framework reads identical shards and
starts from identical weights; a 1-layer GRU with tied embeddings of ``hidden_size`` units; C of
the phones a round, E local epochs of B-sentence SGD steps (lr, momentum, gradient clip as
fedkey's defaults), plain FedAvg weighted by the words each phone predicts (fedkey: ``--bound
off``, no server-side bounding); the global model scored on the validation and test sentences
before the first round and after each, as fedkey's server always does.

The same cohorts: fedkey without DP draws round r's cohort from (seed, r)
(fedkey.federation.plan.choose_cohort); :func:`fedkey_cohorts` draws it with that very code and
the .npz carries the list (``cohorts``: per round the phones' indices) and each phone's training
seed of that round (``cohort_seeds``: fedkey.federation.seeds.client_seed), so Flower and pfl
train exactly those phones, on batches in fedkey's order; after the fedkey run the bench checks
that its metrics rows' ``selected`` are that list (:func:`check_cohorts`: a row whose cohorts
differ is an error row, not a measurement).

Each framework runs as a child process: fedkey as ``python -m fedkey simulate`` (``--workers``
training processes of one torch thread each), Flower (experiments/peers/flower/run.py) and pfl
(experiments/peers/pfl/run.py) in their own venvs under .venv-peers/<name>, made from
experiments/peers/<name>/requirements.txt (exact pins; never fedkey's dependencies) the first
time. A peer script prints one JSON line: the time each round ended (after its evaluation) and
the perplexities. The bench samples the process tree (Flower's Ray workers and pfl's torchrun
workers are children: all counted) for its RSS and its CPU seconds (:class:`TreeMonitor`) and,
`repeats` times interleaved, writes one row per framework and workload into OUT/results.json
(the median repeat's seconds per round, their spread, CPU seconds per round: :func:`combine`),
then OUT/results.md. A peer that cannot be installed or fails gets a row with its error, and the
others go on.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import venv
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from fedkey.common.config import Scheme
from fedkey_bench.common.checkout import ROOT
from fedkey_bench.common.provenance import proc_kb
from fedkey_bench.load.watch import RssMonitor, _descendants
from fedkey_bench.peers.report import page

PEERS = ROOT / "experiments" / "peers"
VENVS = ROOT / ".venv-peers"
DATA = ROOT.parent / "shared" / "data"

#: What the peers' model computes in: fp32, or bf16 autocast (fedkey's `--precision bf16`;
#: Flower and pfl: the shared model's forward under torch.autocast, peers/workload.py).
PeerPrecision = Literal["fp32", "bf16"]
PRECISIONS: tuple[PeerPrecision, ...] = ("fp32", "bf16")


@dataclass(frozen=True)
class Workload:
    """What every framework runs; `name` keys the rows (another size: another name)."""

    name: str = "ptb-iid-100"
    data: str = str(DATA / "ptb")
    partition: Scheme = (
        "iid"  # fedkey.corpora.partition's scheme: "iid" or "user" (one phone a speaker)
    )
    max_train_tokens: int | None = 100_000  # None: the whole training split
    max_eval_sentences: int = 500
    vocab_size: int = 10_000
    hidden_size: int = 64
    clients: int = 100
    fraction: float = 0.1
    rounds: int = 5
    local_epochs: int = 1
    batch_size: int = 10
    lr: float = 1.0
    momentum: float = 0.5
    clip: float = 5.0
    max_len: int = 80
    seed: int = 0  # fedkey's --seed: the initial weights, the cohorts, the phones' training seeds
    workers: int = 2  # training processes (fedkey), Ray actors (Flower), torchrun workers (pfl)
    precision: PeerPrecision = "fp32"


_IRC = str(DATA / "ubuntu-irc")

#: The workloads the bench knows by a word (`--preset`): PTB IID over 100 phones (10 a round);
#: the Ubuntu IRC population with one phone per speaker, its 500 most active ones (52,825
#: messages, 651k words), 25 a round; and its 5,000 most active (127,875 messages, 1.67M words),
#: C 0.2: 1,000 phones a round, 3 rounds (a round is a minute or so per framework on 2 cores).
PRESETS = {
    "ptb": Workload(rounds=10, lr=0.5),
    "irc": Workload(data=_IRC, partition="user", max_train_tokens=None, clients=500,
                    fraction=0.05, rounds=10, lr=0.5),
    "irc5k": Workload(data=_IRC, partition="user", max_train_tokens=None, clients=5000,
                      fraction=0.2, rounds=3, lr=0.5),
}  # fmt: skip


def default_name(preset: str, w: Workload) -> str:
    """The rows' workload name from its sizes, e.g. ptb100k-h64-lr1-r10 or
    irc500u-c25-h64-lr0.5-r10 (a bf16 workload: -bf16 at the end)."""
    tail = f"h{w.hidden_size}-lr{w.lr:g}-r{w.rounds}" + ("-bf16" if w.precision == "bf16" else "")
    if w.partition == "user":
        return f"{preset.rstrip('0123456789k')}{w.clients}u-c{round(w.fraction * w.clients)}-{tail}"
    return f"{preset}{(w.max_train_tokens or 0) // 1000}k-{tail}"


def preset(key: str, **given: Any) -> Workload:
    """PRESETS[key] with the options given (those not None) in place of its own."""
    if key not in PRESETS:
        raise ValueError(f"--preset {key}: choose from {', '.join(PRESETS)}")
    w = replace(PRESETS[key], **{k: v for k, v in given.items() if v is not None})
    if w.precision not in PRECISIONS:
        raise ValueError(f"--precision {w.precision}: choose from {', '.join(PRECISIONS)}")
    return w if given.get("name") else replace(w, name=default_name(key, w))


# -- the cohorts -------------------------------------------------------------------------------


def fedkey_cohorts(w: Workload, sizes: dict[str, int]) -> list[list[str]]:
    """Rounds 1..R's cohorts as `fedkey simulate` with the workload's flags draws them (no DP:
    from (seed, round)), by fedkey's own selection code: its FedAvg strategy set up over the
    phones `sizes` (device id -> predicted words) and fedkey.federation.plan.choose_cohort, each
    round from every phone (simulate offers them all). Each cohort is sorted by device id."""
    from fedkey.federation.config import FederationConfig
    from fedkey.federation.plan import choose_cohort
    from fedkey.federation.privacy.round import RoundPrivacy
    from fedkey.federation.strategies import get_strategy

    config = FederationConfig(strategy="fedavg", fraction=w.fraction, rounds=w.rounds, seed=w.seed)
    strategy = get_strategy(config.strategy, fraction=config.fraction, **config.strategy_params)
    strategy.setup(sizes, config.rounds)
    privacy = RoundPrivacy(config, strategy)
    available = sorted(sizes)
    return [choose_cohort(config, strategy, privacy, r, available) for r in range(1, w.rounds + 1)]


def check_cohorts(rows: list[dict], cohorts: list[list[str]]) -> str | None:
    """Why fedkey's metrics rows (round 0 first) did not train `cohorts`, or None when every
    round's `selected` is that round's list."""
    trained = [r.get("selected") for r in rows[1:]]
    if len(trained) != len(cohorts):
        return f"fedkey ran {len(trained)} rounds, the cohort list has {len(cohorts)}"
    for r, (got, want) in enumerate(zip(trained, cohorts, strict=True), start=1):
        if sorted(got or []) != sorted(want):
            extra, missing = sorted(set(got or []) - set(want)), sorted(set(want) - set(got or []))
            return (f"COHORT MISMATCH: fedkey's round {r} selected other phones than the "
                    f"harness's list (extra {extra[:5]}, missing {missing[:5]}): the peers "
                    "trained other cohorts, so the rows do not compare")  # fmt: skip
    return None


# -- the shared shards -------------------------------------------------------------------------


def write_shards(w: Workload, path: Path) -> dict:
    """The .npz every framework reads, made by fedkey's own corpus, partition and model code
    exactly as `fedkey simulate` makes them for the same flags, with the rounds' cohorts
    (:func:`fedkey_cohorts`) and their training seeds; -> its meta, with the cohorts as device ids
    (`cohorts`) and as the phones' indices in the .npz (`cohort_phones`)."""
    import numpy as np
    import torch

    from fedkey.common.config import DataConfig
    from fedkey.corpora.dataset import prepare
    from fedkey.federation.seeds import client_seed
    from fedkey.models.checkpoint import build_model, model_state
    from fedkey.models.config import ModelConfig

    cfg = DataConfig(data=w.data, vocab_size=w.vocab_size, clients=w.clients,
                     partition=w.partition,
                     max_train_tokens=w.max_train_tokens,
                     max_eval_sentences=w.max_eval_sentences, seed=w.seed)  # fmt: skip
    prepared = prepare(cfg)
    tok = prepared.tokenizer
    devices = sorted(prepared.shards)
    phones = [prepared.shards[d] for d in devices]
    train = [s for p in phones for s in p]
    # A corpus with held-out senders (Ubuntu IRC) has fedkey score their messages every round
    # too (fedkey.runners.simulate.UnseenProbe): the peers score them as well, the same work.
    held = {k: [tok.encode(s) for s in getattr(prepared.corpus, k) or []]
            for k in ("valid", "test", "unseen_test")}  # fmt: skip
    sizes = {d: sum(len(s) - 1 for s in prepared.shards[d]) for d in devices}
    cohorts = fedkey_cohorts(w, sizes)
    index = {d: i for i, d in enumerate(devices)}
    torch.manual_seed(w.seed)  # as fedkey.federation.engine.Federation draws round 0's weights
    config = ModelConfig(vocab_size=tok.vocab_size, emb_size=w.hidden_size,
                         hidden_size=w.hidden_size)  # fmt: skip
    init = model_state(build_model(config))
    meta = {**asdict(w), "vocab_size": tok.vocab_size, "train_sentences": len(train),
            "train_words": sum(len(s) - 1 for s in train),
            "unseen_sentences": len(held["unseen_test"]), "cohort_seed": w.seed,
            "cohort_size": len(cohorts[0]),
            "cohort_words": [sum(sizes[d] for d in c) for c in cohorts]}  # fmt: skip

    def flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        return np.array([t for s in seqs for t in s], np.int64), np.array([len(s) for s in seqs])

    arrays = {f"init.{k}": v.numpy() for k, v in init.items()}
    sets = [("train", train), ("valid", held["valid"]), ("test", held["test"])]
    for name, seqs in sets + ([("unseen", held["unseen_test"])] if held["unseen_test"] else []):
        arrays[f"{name}_tokens"], arrays[f"{name}_lengths"] = flat(seqs)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays["meta"] = np.array(json.dumps(meta))
    arrays["phone_sentences"] = np.array([len(p) for p in phones])
    arrays["cohorts"] = np.array([[index[d] for d in c] for c in cohorts], np.int64)
    arrays["cohort_seeds"] = np.array(
        [[client_seed(w.seed, r, d) for d in c] for r, c in enumerate(cohorts, start=1)], np.int64
    )
    np.savez(path, allow_pickle=False, **arrays)
    return {**meta, "cohorts": cohorts, "cohort_phones": arrays["cohorts"].tolist()}


# -- the peers' venvs --------------------------------------------------------------------------


def peer_venv(name: str) -> Path:
    """.venv-peers/NAME, made from experiments/peers/NAME/requirements.txt if it is not there
    (pip, a few minutes: torch is the local CPU wheel); -> its bin folder. RuntimeError, with
    pip's last lines, when it cannot be installed."""
    env = VENVS / name
    requirements = PEERS / name / "requirements.txt"
    stamp = env / ".installed"
    if stamp.is_file() and stamp.read_text() == requirements.read_text():
        return env / "bin"
    print(f"peers: installing {name} into {env} from {requirements.relative_to(ROOT)} "
          "(once; a few minutes)", flush=True)  # fmt: skip
    venv.create(env, with_pip=True, clear=True)
    done = subprocess.run(
        [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(requirements)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if not ln.startswith("WARNING: Location")]
        raise RuntimeError(f"pip install -r {requirements.relative_to(ROOT)} failed: "
                           + " | ".join(lines[-6:]))  # fmt: skip
    stamp.write_text(requirements.read_text())
    return env / "bin"


def version_of(bin_dir: Path, module: str) -> str:
    code = f"from importlib.metadata import version; print(version({module!r}))"
    done = subprocess.run([str(bin_dir / "python"), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or "?"


# -- running one framework ---------------------------------------------------------------------


def fedkey_command(w: Workload, out: Path) -> list[str]:
    """`fedkey simulate` with the workload's flags (the model's size: FEDKEY_HIDDEN_SIZE)."""
    cut = [] if w.max_train_tokens is None else ["--max-train-tokens", str(w.max_train_tokens)]
    return [sys.executable, "-m", "fedkey", "simulate", "--data", w.data, *cut,
            "--max-eval-sentences", str(w.max_eval_sentences), "--vocab-size", str(w.vocab_size),
            "--clients", str(w.clients), "--partition", w.partition, "--fraction", str(w.fraction),
            "--rounds", str(w.rounds), "--local-epochs", str(w.local_epochs),
            "--batch-size", str(w.batch_size), "--lr", str(w.lr), "--momentum", str(w.momentum),
            "--clip", str(w.clip), "--seed", str(w.seed), "--strategy", "fedavg",
            "--bound", "off", "--ksr-sentences", "0", "--no-eval-topk", "--precision", w.precision,
            "--device", "cpu", "--workers", str(w.workers), "--keep-checkpoints", "1",
            "--out", str(out)]  # fmt: skip


def peer_command(name: str, bin_dir: Path, shards: Path, w: Workload) -> list[str]:
    script = str(PEERS / name / "run.py")
    if name == "pfl" and w.workers > 1:
        return [str(bin_dir / "torchrun"), "--standalone", f"--nproc_per_node={w.workers}",
                script, str(shards)]  # fmt: skip
    return [str(bin_dir / "python"), script, str(shards), "--workers", str(w.workers)]


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """A process's CPU seconds, user and system, its reaped children's included (a child's time
    moves to its parent's when the parent waits for it); 0 for one that is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
    return sum(int(f) for f in fields[11:15]) / _TICK  # utime stime cutime cstime


class TreeMonitor(RssMonitor):
    """RssMonitor's samples of a process tree's memory, and with each the CPU seconds the tree
    has used (`cpu`: (seconds since `t0`, CPU seconds), one a sample)."""

    def __init__(self, pid: int, interval: float = 0.2, t0: float | None = None) -> None:
        super().__init__(pid, interval)
        self.t0 = time.perf_counter() if t0 is None else t0
        self.cpu: list[tuple[float, float]] = []

    def sample(self) -> None:
        kids = _descendants(self.pid)
        self.children = max(self.children, len(kids))
        procs = [self.pid, *kids]
        cpu = sum(cpu_seconds(p) for p in procs)
        now = time.perf_counter() - self.t0
        tree = sum(proc_kb(f"{p}/status", "VmRSS") for p in procs)
        self.peak_tree = max(self.peak_tree, tree)
        self.peak_pss = max(self.peak_pss, sum(proc_kb(f"{p}/smaps_rollup", "Pss") for p in procs))
        self.hwm = max(self.hwm, proc_kb(f"{self.pid}/status", "VmHWM"))
        self.cpu.append((now, cpu))


def cpu_at(samples: list[tuple[float, float]], t: float) -> float:
    """The tree's CPU seconds at time t, interpolated between the samples around it (the first
    or last sample's outside them)."""
    if not samples:
        raise ValueError("no CPU samples")
    if t <= samples[0][0]:
        return samples[0][1]
    for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
        if t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
    return samples[-1][1]


def steady(round_ends: list[float]) -> list[float]:
    """The round ends a steady round is measured between: rounds 2..R (round 1 also pays for
    starting the workers), or round 1 alone when R = 1 (round_ends[0]: the initial model's)."""
    return round_ends[1:] if len(round_ends) > 2 else round_ends


def cpu_per_round(samples: list[tuple[float, float]], round_ends: list[float]) -> float | None:
    """The process tree's CPU seconds per steady round: (CPU at the last round's end - CPU at
    the first steady round's start) / the rounds between, the ends on the samples' clock."""
    ends = steady(round_ends)
    if len(samples) < 2 or len(ends) < 2:
        return None
    return (cpu_at(samples, ends[-1]) - cpu_at(samples, ends[0])) / (len(ends) - 1)


@dataclass
class Measured:
    stdout: str
    stderr: str
    returncode: int
    wall: float
    peak_rss: int  # bytes: the largest sum of VmRSS over the process and its descendants
    peak_pss: int  # the same in PSS (a page shared by several processes counted once)
    round_ends: list[float]  # fedkey: when each metrics row appeared, seconds from the start
    cpu: list[tuple[float, float]] = field(default_factory=list)  # TreeMonitor.cpu
    started_epoch: float = 0.0  # time.time() at the start: the peers' epoch times to seconds


def measure(
    cmd: list[str], cwd: Path, env: dict[str, str], rows: Path | None = None, timeout: float = 1800
) -> Measured:
    """Run CMD, sampling its process tree's memory and CPU seconds; with ROWS (a metrics.jsonl),
    the time each new row appears. Past `timeout` seconds its process group is killed (a Ray
    cluster whose processes someone else's `ray stop` ended leaves Flower's driver waiting for
    ever)."""
    import threading

    ends: list[float] = []
    start, started_epoch = time.perf_counter(), time.time()
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:  # fmt: skip
        tree = TreeMonitor(proc.pid, interval=0.2, t0=start)
        tree.start()
        got: dict[str, str] = {}
        readers = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read()))
                   for k, f in (("out", proc.stdout), ("err", proc.stderr))]  # fmt: skip
        for t in readers:
            t.start()
        while proc.poll() is None:
            time.sleep(0.1)
            if time.perf_counter() - start > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if rows is not None and rows.is_file():
                n = rows.read_text().count("\n")
                ends += [time.perf_counter() - start] * (n - len(ends))
        tree.stop()
        for t in readers:
            t.join(timeout=60)  # a grandchild in a session of its own may hold the pipe
    if proc.returncode == -signal.SIGKILL:  # with how far it got: its last line of log
        last = _last_line(got.get("err", ""))
        got["err"] = got.get("err", "") + f"\nkilled after {timeout:.0f} s (--timeout); {last}"
    return Measured(got.get("out", ""), got.get("err", ""), proc.returncode,
                    time.perf_counter() - start, tree.peak, tree.peak_pss, ends, tree.cpu,
                    started_epoch)  # fmt: skip


# -- rows (pure) -------------------------------------------------------------------------------


def make_row(framework: str, version: str, w: Workload, device: str, command: str,
             round_ends: list[float], test_ppl: list[float], wall: float, peak_rss: int,
             train_s: list[float], cpu_s: float | None = None, **extra: object) -> dict:  # fmt: skip
    """One repeat's row. `round_ends[r]`: when round r's evaluation ended (r = 0: the initial
    model's); `train_s[r - 1]`: round r's seconds before its evaluation (training, aggregation);
    `cpu_s`: the process tree's CPU seconds per steady round (:func:`cpu_per_round`).
    `seconds_per_round`: the mean of rounds 2..R (round 1 also pays for starting the workers or
    actors: `first_round_s`), or round 1 alone when R = 1; `train_s` the same mean of the part
    before the evaluation, `eval_s` the rest (evaluation, checkpoints, the metrics row)."""
    if len(round_ends) < 2 or len(test_ppl) != len(round_ends):
        raise ValueError(f"{framework}: {len(round_ends)} round ends and {len(test_ppl)} "
                         "perplexities; a run needs its initial and at least one round")  # fmt: skip
    rounds = len(round_ends) - 1
    ends = steady(round_ends)
    per_round = (ends[-1] - ends[0]) / (len(ends) - 1)
    training = train_s[1:] if rounds > 1 else train_s
    train = sum(training) / len(training)
    return {
        "framework": framework,
        "version": version,
        "workload": w.name,
        "device": device,
        "precision": w.precision,
        "cohort_seed": w.seed,
        "rounds": rounds,
        "seconds_per_round": round(per_round, 3),
        "cpu_seconds_per_round": None if cpu_s is None else round(cpu_s, 3),
        "train_s": round(train, 3),
        "eval_s": round(per_round - train, 3),
        "first_round_s": round(round_ends[1] - round_ends[0], 3),
        "wall_s": round(wall, 1),
        "initial_test_ppl": round(test_ppl[0], 3),
        "final_test_ppl": round(test_ppl[-1], 3),
        "test_ppl": [round(p, 3) for p in test_ppl],
        "peak_rss_mb": round(peak_rss / 2**20, 1),
        "command": command,
        **extra,
    }


def error_row(framework: str, w: Workload, device: str, command: str, error: str) -> dict:
    return {"framework": framework, "version": None, "workload": w.name, "device": device,
            "precision": w.precision, "cohort_seed": w.seed, "repeats": 1,
            "seconds_per_round": None, "seconds_per_round_spread": None,
            "cpu_seconds_per_round": None, "final_test_ppl": None, "peak_rss_mb": None,
            "command": command, "error": error}  # fmt: skip


#: What each repeat keeps in a combined row's `per_repeat`.
REPEAT_FIELDS = ("seconds_per_round", "cpu_seconds_per_round", "train_s", "eval_s",
                 "first_round_s", "wall_s", "final_test_ppl", "peak_rss_mb", "test_ppl")  # fmt: skip


def _median(values: list[float | None], digits: int = 3) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), digits) if known else None


def combine(repeats: list[dict]) -> dict:
    """One framework's repeats (in the order run) as one row: the median of their seconds per
    round (of an even count the mean of the middle two) with its spread [min, max], the median
    CPU seconds per round (and spread), training and evaluation seconds and final test
    perplexity, the largest peak RSS and PSS, and each repeat's figures and perplexity curve in
    `per_repeat`; the first error, with the repeats counted, when none ran."""
    done = [r for r in repeats if not r.get("error")]
    if not done:
        return {**repeats[0], "repeats": len(repeats)}
    s = [r["seconds_per_round"] for r in done]
    cpu = [r.get("cpu_seconds_per_round") for r in done]
    known_cpu = [c for c in cpu if c is not None]
    row = dict(done[0])
    row.update(
        repeats=len(repeats),
        seconds_per_round=_median(s),
        seconds_per_round_spread=[min(s), max(s)],
        cpu_seconds_per_round=_median(cpu),
        cpu_seconds_per_round_spread=[min(known_cpu), max(known_cpu)] if known_cpu else None,
        train_s=_median([r["train_s"] for r in done]),
        eval_s=_median([r["eval_s"] for r in done]),
        first_round_s=_median([r["first_round_s"] for r in done]),
        wall_s=_median([r["wall_s"] for r in done], 1),
        final_test_ppl=_median([r["final_test_ppl"] for r in done]),
        peak_rss_mb=max(r["peak_rss_mb"] for r in done),
        per_repeat=[{k: r.get(k) for k in REPEAT_FIELDS} for r in done],
    )
    if any(r.get("peak_pss_mb") is not None for r in done):
        row["peak_pss_mb"] = max(r.get("peak_pss_mb") or 0 for r in done)
    if len(done) < len(repeats):
        row["failed_repeats"] = [r["error"] for r in repeats if r.get("error")]
    return row


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """results.json's rows with NEW's replacing those of the same framework and workload."""
    keys = {(r["framework"], r["workload"]) for r in new}
    return [r for r in old if (r["framework"], r["workload"]) not in keys] + new


# -- the bench ---------------------------------------------------------------------------------


def run_one(name: str, w: Workload, shards: Path, work: Path, tree: Path, device: str,
            timeout: float, cohorts: list[list[str]], phones: list[list[int]]) -> dict:  # fmt: skip
    """One repeat of framework NAME. fedkey's rows are checked against `cohorts` (device ids),
    the cohorts a peer reports it trained against `phones` (the same, as the .npz's indices)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if name == "fedkey":
        run_dir = work / "fedkey"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        cmd = fedkey_command(w, run_dir)
        env["FEDKEY_HIDDEN_SIZE"] = str(w.hidden_size)
        command = f"FEDKEY_HIDDEN_SIZE={w.hidden_size} " + shlex.join(["fedkey", *cmd[3:]])
        m = measure(cmd, tree, env, rows=run_dir / "metrics.jsonl", timeout=timeout)
        if m.returncode != 0:
            return error_row(name, w, device, command, _last_line(m.stderr))
        rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        mismatch = check_cohorts(rows, cohorts)
        if mismatch:
            print(f"peers: fedkey: {mismatch}", file=sys.stderr, flush=True)
            return error_row(name, w, device, command, mismatch)
        from importlib.metadata import version

        return make_row(name, version("fedkey"), w, device, command, m.round_ends,
                        [r["test_ppl"] for r in rows], m.wall, m.peak_rss,
                        [r["seconds"] for r in rows[1:]], cpu_per_round(m.cpu, m.round_ends),
                        peak_pss_mb=round(m.peak_pss / 2**20, 1), workers=w.workers,
                        cohorts_checked=True)  # fmt: skip
    command = f"experiments/peers/{name}/run.py"
    try:
        bin_dir = peer_venv(name)
    except (RuntimeError, OSError) as e:
        return error_row(name, w, device, command, str(e))
    cmd = peer_command(name, bin_dir, shards, w)
    command = shlex.join([str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c
                          for c in cmd])  # fmt: skip
    m = measure(cmd, ROOT, env, timeout=timeout)
    line = next((ln for ln in m.stdout.splitlines() if ln.startswith('{"framework"')), None)
    if m.returncode != 0 or line is None:
        return error_row(name, w, device, command, _last_line(m.stderr))
    got = json.loads(line)
    # The script's round ends by the wall clock, on the samples' clock (seconds from the start).
    ends = [t - m.started_epoch for t in got.get("round_ends_epoch", [])]
    trained = got.get("cohorts")
    if trained is not None and [sorted(c) for c in trained] != [sorted(c) for c in phones]:
        return error_row(name, w, device, command,
                         f"COHORT MISMATCH: {name} trained other phones than the list")  # fmt: skip
    return make_row(name, got["version"], w, device, command, got["round_ends"], got["test_ppl"],
                    m.wall, m.peak_rss, got["train_s"],
                    cpu_per_round(m.cpu, ends) if ends else None,
                    peak_pss_mb=round(m.peak_pss / 2**20, 1), workers=got.get("workers"),
                    torch=got.get("torch"), cohorts_checked=trained is not None)  # fmt: skip


def _last_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "exited without a result"


def run_peers(w: Workload, frameworks: list[str], out: Path, work: Path, tree: Path,
              bench_command: str, repeats: int = 3, timeout: float = 1800) -> list[dict]:  # fmt: skip
    """Write the shards (with the rounds' cohorts), run the frameworks in turn, `repeats` times
    interleaved (a busy machine's load then weighs on each alike), record one row each (the
    repeats combined), rebuild the page."""
    from fedkey_bench.common.provenance import machine_line

    device = f"cpu: {machine_line()}"
    shards = work / f"{w.name}.npz"
    print(f"peers: writing the shards {shards}", flush=True)
    meta = write_shards(w, shards)
    cohorts, phones = meta.pop("cohorts"), meta.pop("cohort_phones")
    runs: dict[str, list[dict]] = {name: [] for name in frameworks}
    for i in range(repeats):
        for name in frameworks:
            print(f"peers: {name} ({i + 1} of {repeats}) ...", flush=True)
            row = run_one(name, w, shards, work, tree, device, timeout, cohorts, phones)
            runs[name].append(row)
            print(f"peers: {name}: " + (row.get("error") or f"{row['seconds_per_round']} s/round, "
                  f"{row['cpu_seconds_per_round']} CPU s/round, test ppl "
                  f"{row['final_test_ppl']}, peak RSS {row['peak_rss_mb']} MB"),
                  flush=True)  # fmt: skip
    new = [combine(rs) for rs in runs.values()]
    path = out / "results.json"
    old = json.loads(path.read_text()) if path.is_file() else {"workloads": {}, "rows": []}
    from fedkey_bench.common.provenance import git

    meta.update(bench_command=bench_command, repeats=repeats, device=device,
                fedkey_tree="." if tree == ROOT else str(tree),
                git_commit=git("rev-parse", "HEAD"), date=time.strftime("%Y-%m-%d"))  # fmt: skip
    workloads = {k: v for k, v in old["workloads"].items() if k != w.name}
    data = {"workloads": {**workloads, w.name: meta}, "rows": merge(old["rows"], new)}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    (out / "results.md").write_text(page(data))
    return new
