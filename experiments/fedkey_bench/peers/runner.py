"""`fedkey-bench peers`: one federated workload in fedkey, in Flower's Simulation Engine and in
pfl-research, head to head.

The workload (:class:`Workload`, two presets in :data:`PRESETS`) is the same in all three: a
corpus cut and partitioned by fedkey's own corpus code (``ptb``: PTB's training split cut to its
first ``max_train_tokens`` words, IID over 100 phones; ``irc``: the Ubuntu IRC population, one
phone per speaker, the ``clients`` most active ones, as `fedkey simulate --data ubuntu-irc
--partition user --clients K` makes them) and written once to a shared .npz (each phone's encoded
sentences, the validation and test sentences, the initial weights of fedkey's round 0), so every
framework reads identical shards and starts from identical weights; a 1-layer GRU with tied
embeddings of ``hidden_size`` units; C of the phones a round, E local epochs of B-sentence SGD
steps (lr, momentum, gradient clip as fedkey's defaults), plain FedAvg weighted by the words each
phone predicts (fedkey: ``--bound off``, no server-side bounding); the global model scored on the
validation and test sentences before the first round and after each, as fedkey's server always
does.

Each framework runs as a child process: fedkey as ``python -m fedkey simulate`` (``--workers``
training processes of one torch thread each), Flower (experiments/peers/flower/run.py) and pfl
(experiments/peers/pfl/run.py) in their own venvs under .venv-peers/<name>, made from
experiments/peers/<name>/requirements.txt (exact pins; never fedkey's dependencies) the first
time. A peer script prints one JSON line: the time each round ended (after its evaluation) and
the perplexities. The bench samples the process tree's RSS (Flower's Ray workers and pfl's
torchrun workers are children: all counted) and writes one row per framework and workload into
OUT/results.json, then OUT/results.md. A peer that cannot be installed or fails gets a row with
its error, and the others go on.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import venv
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fedkey.common.config import Scheme
from fedkey_bench.common.checkout import ROOT
from fedkey_bench.peers.report import page

PEERS = ROOT / "experiments" / "peers"
VENVS = ROOT / ".venv-peers"
DATA = ROOT.parent / "shared" / "data"


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
    seed: int = 0
    workers: int = 2  # training processes (fedkey), Ray actors (Flower), torchrun workers (pfl)


#: The workloads the bench knows by a word (`--preset`): PTB IID, and the Ubuntu IRC population
#: with one phone per speaker, its 500 most active ones (52,825 messages, 651k words), 25 a round.
PRESETS = {
    "ptb": Workload(),
    "irc": Workload(
        data=str(DATA / "ubuntu-irc"),
        partition="user",
        max_train_tokens=None,
        clients=500,
        fraction=0.05,
    ),  # fmt: skip
}


def default_name(preset: str, w: Workload) -> str:
    """The rows' workload name from its sizes, e.g. ptb100k-h64-lr1-r10 or irc500u-c25-h64-lr0.5-r10."""
    tail = f"h{w.hidden_size}-lr{w.lr:g}-r{w.rounds}"
    if w.partition == "user":
        return f"{preset}{w.clients}u-c{round(w.fraction * w.clients)}-{tail}"
    return f"{preset}{(w.max_train_tokens or 0) // 1000}k-{tail}"


def preset(key: str, **given: Any) -> Workload:
    """PRESETS[key] with the options given (those not None) in place of its own."""
    if key not in PRESETS:
        raise ValueError(f"--preset {key}: choose from {', '.join(PRESETS)}")
    w = replace(PRESETS[key], **{k: v for k, v in given.items() if v is not None})
    return w if given.get("name") else replace(w, name=default_name(key, w))


# -- the shared shards -------------------------------------------------------------------------


def write_shards(w: Workload, path: Path) -> dict:
    """The .npz every framework reads, made by fedkey's own corpus, partition and model code
    exactly as `fedkey simulate` makes them for the same flags; -> its meta."""
    import numpy as np
    import torch

    from fedkey.common.config import DataConfig
    from fedkey.corpora.dataset import prepare
    from fedkey.models.checkpoint import build_model, model_state
    from fedkey.models.config import ModelConfig

    cfg = DataConfig(data=w.data, vocab_size=w.vocab_size, clients=w.clients,
                     partition=w.partition,
                     max_train_tokens=w.max_train_tokens,
                     max_eval_sentences=w.max_eval_sentences, seed=w.seed)  # fmt: skip
    prepared = prepare(cfg)
    tok = prepared.tokenizer
    phones = [prepared.shards[d] for d in sorted(prepared.shards)]
    train = [s for p in phones for s in p]
    # A corpus with held-out senders (Ubuntu IRC) has fedkey score their messages every round
    # too (fedkey.runners.simulate.UnseenProbe): the peers score them as well, the same work.
    held = {k: [tok.encode(s) for s in getattr(prepared.corpus, k) or []]
            for k in ("valid", "test", "unseen_test")}  # fmt: skip
    torch.manual_seed(w.seed)  # as fedkey.federation.engine.Federation draws round 0's weights
    config = ModelConfig(vocab_size=tok.vocab_size, emb_size=w.hidden_size,
                         hidden_size=w.hidden_size)  # fmt: skip
    init = model_state(build_model(config))
    meta = {**asdict(w), "vocab_size": tok.vocab_size, "train_sentences": len(train),
            "train_words": sum(len(s) - 1 for s in train),
            "unseen_sentences": len(held["unseen_test"])}  # fmt: skip

    def flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        return np.array([t for s in seqs for t in s], np.int64), np.array([len(s) for s in seqs])

    arrays = {f"init.{k}": v.numpy() for k, v in init.items()}
    sets = [("train", train), ("valid", held["valid"]), ("test", held["test"])]
    for name, seqs in sets + ([("unseen", held["unseen_test"])] if held["unseen_test"] else []):
        arrays[f"{name}_tokens"], arrays[f"{name}_lengths"] = flat(seqs)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays["meta"] = np.array(json.dumps(meta))
    arrays["phone_sentences"] = np.array([len(p) for p in phones])
    np.savez(path, allow_pickle=False, **arrays)
    return meta


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
            "--bound", "off", "--ksr-sentences", "0", "--precision", "fp32", "--device", "cpu",
            "--workers", str(w.workers), "--keep-checkpoints", "1", "--out", str(out)]  # fmt: skip


def peer_command(name: str, bin_dir: Path, shards: Path, w: Workload) -> list[str]:
    script = str(PEERS / name / "run.py")
    if name == "pfl" and w.workers > 1:
        return [str(bin_dir / "torchrun"), "--standalone", f"--nproc_per_node={w.workers}",
                script, str(shards)]  # fmt: skip
    return [str(bin_dir / "python"), script, str(shards), "--workers", str(w.workers)]


@dataclass
class Measured:
    stdout: str
    stderr: str
    returncode: int
    wall: float
    peak_rss: int  # bytes: the largest sum of VmRSS over the process and its descendants
    peak_pss: int  # the same in PSS (a page shared by several processes counted once)
    round_ends: list[float]  # fedkey: when each metrics row appeared, seconds from the start


def measure(
    cmd: list[str], cwd: Path, env: dict[str, str], rows: Path | None = None, timeout: float = 1800
) -> Measured:
    """Run CMD, sampling its process tree's memory; with ROWS (a metrics.jsonl), the time each
    new row appears. Past `timeout` seconds its process group is killed (a Ray cluster whose
    processes someone else's `ray stop` ended leaves Flower's driver waiting for ever)."""
    import threading

    from fedkey_bench.load.watch import RssMonitor

    ends: list[float] = []
    start = time.perf_counter()
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:  # fmt: skip
        rss = RssMonitor(proc.pid, interval=0.2)
        rss.start()
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
        rss.stop()
        for t in readers:
            t.join(timeout=60)  # a grandchild in a session of its own may hold the pipe
    if proc.returncode == -signal.SIGKILL:
        got["err"] = got.get("err", "") + f"\nkilled after {timeout:.0f} s (--timeout)"
    return Measured(got.get("out", ""), got.get("err", ""), proc.returncode,
                    time.perf_counter() - start, rss.peak, rss.peak_pss, ends)  # fmt: skip


# -- rows (pure) -------------------------------------------------------------------------------


def make_row(framework: str, version: str, w: Workload, device: str, command: str,
             round_ends: list[float], test_ppl: list[float], wall: float, peak_rss: int,
             train_s: list[float], **extra: object) -> dict:  # fmt: skip
    """One results.json row. `round_ends[r]`: when round r's evaluation ended (r = 0: the initial
    model's); `train_s[r - 1]`: round r's seconds before its evaluation (training, aggregation).
    `seconds_per_round`: the mean of rounds 2..R (round 1 also pays for starting the workers or
    actors: `first_round_s`), or round 1 alone when R = 1; `train_s` the same mean of the part
    before the evaluation, `eval_s` the rest (evaluation, checkpoints, the metrics row)."""
    if len(round_ends) < 2 or len(test_ppl) != len(round_ends):
        raise ValueError(f"{framework}: {len(round_ends)} round ends and {len(test_ppl)} "
                         "perplexities; a run needs its initial and at least one round")  # fmt: skip
    rounds = len(round_ends) - 1
    steady = round_ends[1:] if rounds > 1 else round_ends
    per_round = (steady[-1] - steady[0]) / (len(steady) - 1)
    training = train_s[1:] if rounds > 1 else train_s
    train = sum(training) / len(training)
    return {
        "framework": framework,
        "version": version,
        "workload": w.name,
        "device": device,
        "rounds": rounds,
        "seconds_per_round": round(per_round, 3),
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
            "seconds_per_round": None, "final_test_ppl": None, "peak_rss_mb": None,
            "command": command, "error": error}  # fmt: skip


def combine(repeats: list[dict]) -> dict:
    """One framework's repeats as one row: the repeat of the median seconds per round (the
    lower of the middle two for an even count), with every repeat's seconds and final
    perplexity beside it and the largest peak RSS; the first error when none ran."""
    done = sorted((r for r in repeats if not r.get("error")), key=lambda r: r["seconds_per_round"])
    if not done:
        return repeats[0]
    row = dict(done[(len(done) - 1) // 2])
    row.update(
        repeats=len(repeats),
        seconds_per_round_all=[r["seconds_per_round"] for r in done],
        final_test_ppl_all=[r["final_test_ppl"] for r in done],
        peak_rss_mb=max(r["peak_rss_mb"] for r in done),
    )
    if len(done) < len(repeats):
        row["failed_repeats"] = [r["error"] for r in repeats if r.get("error")]
    return row


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """results.json's rows with NEW's replacing those of the same framework and workload."""
    keys = {(r["framework"], r["workload"]) for r in new}
    return [r for r in old if (r["framework"], r["workload"]) not in keys] + new


# -- the bench ---------------------------------------------------------------------------------


def run_one(
    name: str, w: Workload, shards: Path, work: Path, tree: Path, device: str, timeout: float
) -> dict:
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
        from importlib.metadata import version

        return make_row(name, version("fedkey"), w, device, command, m.round_ends,
                        [r["test_ppl"] for r in rows], m.wall, m.peak_rss,
                        [r["seconds"] for r in rows[1:]], peak_pss_mb=round(m.peak_pss / 2**20, 1), workers=w.workers)  # fmt: skip
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
    return make_row(name, got["version"], w, device, command, got["round_ends"], got["test_ppl"],
                    m.wall, m.peak_rss, got["train_s"], peak_pss_mb=round(m.peak_pss / 2**20, 1),
                    workers=got.get("workers"), torch=got.get("torch"))  # fmt: skip


def _last_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "exited without a result"


def run_peers(w: Workload, frameworks: list[str], out: Path, work: Path, tree: Path,
              bench_command: str, repeats: int = 1, timeout: float = 1800) -> list[dict]:  # fmt: skip
    """Write the shards, run the frameworks in turn, `repeats` times interleaved (a busy
    machine's load then weighs on each alike), record one row each, rebuild the page."""
    from fedkey_bench.common.provenance import machine_line

    device = f"cpu: {machine_line()}"
    shards = work / f"{w.name}.npz"
    print(f"peers: writing the shards {shards}", flush=True)
    meta = write_shards(w, shards)
    runs: dict[str, list[dict]] = {name: [] for name in frameworks}
    for i in range(repeats):
        for name in frameworks:
            print(f"peers: {name} ({i + 1} of {repeats}) ...", flush=True)
            row = run_one(name, w, shards, work, tree, device, timeout)
            runs[name].append(row)
            print(f"peers: {name}: " + (row.get("error") or f"{row['seconds_per_round']} s/round, "
                  f"test ppl {row['final_test_ppl']}, peak RSS {row['peak_rss_mb']} MB"),
                  flush=True)  # fmt: skip
    new = [combine(rs) for rs in runs.values()]
    path = out / "results.json"
    old = json.loads(path.read_text()) if path.is_file() else {"workloads": {}, "rows": []}
    from fedkey_bench.common.provenance import git

    meta.update(bench_command=bench_command, repeats=repeats, device=device,
                fedkey_tree="." if tree == ROOT else str(tree),
                git_commit=git("rev-parse", "HEAD"), date=time.strftime("%Y-%m-%d"))  # fmt: skip
    data = {"workloads": {**old["workloads"], w.name: meta}, "rows": merge(old["rows"], new)}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    (out / "results.md").write_text(page(data))
    return new
