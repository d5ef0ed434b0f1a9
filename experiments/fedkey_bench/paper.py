"""`fedkey-bench paper`: the seed papers' experiments and issue 18's ranking of the methods, run
by the project's own commands.

Every run is one `fedkey simulate` (in-process), `fedkey run` (server + phones over HTTP),
`fedkey train-central` or `fedkey ngram` command line, executed as a child process; its
metrics.jsonl is summarized into one object of results.json with the command, the git commit and
the device beside the numbers (and, for the federated runs, the spread of the server's per-phone
weights each round: fedkey_bench.spread). results.md (fedkey_bench.paper_report) leads with the language-model
perplexity and keyboard metrics of each method beside the centralized ceiling and the n-gram.

The presets are in fedkey_bench.presets, the suites in fedkey_bench.paper_suites. A run whose command is already in results.json is not run again, so an
interrupted bench resumes; the suites that depend on the learning-rate sweep's choices (rank,
noniid) are rebuilt after every run, so one command runs the sweep and then the runs that use
what it chose.
"""

from __future__ import annotations

import fnmatch
import math
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

from fedkey.federation.storage import prune_checkpoints
from fedkey_bench.attopt_step import step_scales, update_norms
from fedkey_bench.paper_budget import Pace, cores, duration, units
from fedkey_bench.paper_results import Bench
from fedkey_bench.paper_spec import DATASETS, RunSpec
from fedkey_bench.paper_suites import PLANNED, SEEDS, SUITES, seed_number, suite_runs
from fedkey_bench.presets import PRESETS, Preset
from fedkey_bench.runs import (
    Stopped,
    best_so_far,
    can_resume,
    device_label,
    rounds_done,
    run_fedkey,
    twins,
    what_it_computes,
)
from fedkey_bench.spread import round_spreads

__all__ = [
    "DATASETS", "PRESETS", "SEEDS", "SUITES", "Bench", "Preset", "RunSpec", "command",
    "run_bench", "seed_number", "suite_runs", "summarize",
]  # fmt: skip


# -- running --------------------------------------------------------------------------------------


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
    # The papers' methods as published: no server-side bounding (fedkey's default since issue 15),
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


def summarize(rows: list[dict], spec: RunSpec) -> dict:
    """One results.json object from a run's metrics rows (round 0 = the initial model)."""
    # Column-batched runs (the code suite) choose their best model by the seed papers' measure.
    key = "col_val_ppl" if "col_val_ppl" in rows[-1] else "val_ppl"
    # A diverged round (NaN, inf, or None) is never the best one.
    best = min(rows, key=lambda r: _finite(r[key]))
    below_90 = [r["round"] for r in rows if r["round"] > 0 and _finite(r["test_ppl"]) < 90]
    return {
        **spec.fields(),
        "test_ppl": best["test_ppl"],  # of the best-validation model, as the seed papers report
        "best_val_ppl": best["val_ppl"],
        "best_round": best["round"],
        "final_test_ppl": rows[-1]["test_ppl"],
        "top1": best.get("top1"),
        "top3": best.get("top3"),
        # the suggestion bar's ranking (no </s>, <unk>): recorded by runs since issue 51
        **{k: best[k] for k in ("bar_top1", "bar_top3") if k in best},
        "ksr": best.get("ksr"),
        # a corpus with held-out senders (NUS SMS, Ubuntu IRC): the best model on their messages
        **{k: best.get(k) for k in UNSEEN if k in best},
        "rounds": rows[-1]["round"],
        "rounds_to_ppl_90": below_90[0] if below_90 else None,
        # the rounds' own seconds (training and aggregation, no evaluation): fedkey_bench.paper_budget
        "train_seconds": round(sum(r.get("seconds") or 0.0 for r in rows), 1),
        "uplink_bytes": sum(r.get("bytes_up", 0) for r in rows),
        "downlink_bytes": sum(r.get("bytes_down", 0) for r in rows),
        "updates": sum(len(r.get("aggregated", [])) for r in rows),
        "epsilon": rows[-1].get("epsilon"),
        "curve": [[r["round"], r["val_ppl"], r["test_ppl"]] for r in rows],
        "weight_spread": round_spreads(rows) if spec.kind == "federated" else [],
        "update_norms": update_norms(
            rows
        ),  # fedkey_bench.attopt_step: FedAttOpt's reach against them
        "step_scale": step_scales(rows),
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


#: The metrics of the held-out senders' messages (fedkey.federation.metrics_row), where a run has them.
UNSEEN = ("unseen_test_ppl", "unseen_top1", "unseen_top3", "unseen_bar_top1", "unseen_bar_top3",
          "unseen_ksr")  # fmt: skip


def reused(twin: dict, spec: RunSpec, cmd: str) -> dict:
    """The results.json object of `spec` from a done run of the same command but for its --out
    (fedkey_bench.runs.twins): its numbers, the spec's own place and command, and `same_run_as`
    naming the run that ran (its folder holds the checkpoints)."""
    return {**twin, **spec.fields(), "id": spec.id, "command": cmd,
            "same_run_as": twin.get("same_run_as") or twin["id"],
            "seed_ppl": seed_number(spec.suite, spec.dataset, spec.method, spec.fraction,
                                    spec.group)}  # fmt: skip


def _finite(value) -> float:
    """A perplexity, or infinity for a diverged round's NaN, inf or None."""
    return value if isinstance(value, float | int) and math.isfinite(value) else math.inf


def resumable(cmd: list[str]) -> bool:
    """Whether a run of `cmd` cut off in the middle continues after its last checkpoint: a
    simulate or train-central (hours on the cpu preset) does; a `fedkey run` (transport "http",
    which no preset uses now) or an n-gram starts again."""
    return cmd[1] in ("simulate", "train-central")


def run_one(
    spec: RunSpec,
    preset: Preset,
    data_root: Path,
    runs_dir: Path,
    stop: Callable[[], bool] | None = None,
) -> dict:
    """Run one spec as a child process; its summary, with the command and where it ran. Once
    `stop()` says True a run still going is stopped: fedkey_bench.runs.Stopped. Of a run that ends,
    only the checkpoints of its best and last rounds are kept (:func:`keep_what_matters`)."""
    run_dir = runs_dir / spec.id
    cmd = command(spec, preset, data_root, run_dir)
    rows, provenance = run_fedkey(spec.id, cmd, run_dir, resumable=resumable(cmd), stop=stop)
    summary = summarize(rows, spec)
    keep_what_matters(run_dir, summary)
    return {
        "id": spec.id,
        **summary,
        **provenance,
        "preset": preset.name,
        "seed_ppl": seed_number(spec.suite, spec.dataset, spec.method, spec.fraction, spec.group),
    }


def keep_what_matters(run_dir: Path, result: dict) -> tuple[int, int]:
    """Delete a finished run's checkpoints but those of its best round (the model the tables
    score) and its last: the others, 13.5 MB a round at a 10k vocabulary and 4x that again for
    FedAdam's buffers, filled gigabytes a run. (files, bytes) deleted."""
    return prune_checkpoints(run_dir, {result["best_round"], result["rounds"]})


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
    Where a run ran is not what it computes (fedkey_bench.runs.what_it_computes): the runs are the
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
    hours: float | None = None,
    advance: bool = True,
    backend: str | None = None,
) -> list[dict]:
    """Run every selected spec not yet in OUT/<folder>/results.json, `jobs` at a time, then
    write the report. The specs are rebuilt after every run: the sweep's choices open the
    ranking suites' runs. With `hours`, only the runs expected to end within that many hours
    from now are started (fedkey_bench.paper_budget), and a run still going then is stopped; the
    others are listed at the end. With `advance`, the slots that none of them fits go to the
    runs that resume: stopped at the limit, the next bench continues them. `backend`: where
    the runs train in place of the preset's (:func:`placed`)."""
    from tqdm import tqdm

    preset = placed(PRESETS[preset_name], backend)
    bench = Bench(out / preset.results_folder)
    run_root = runs_dir / preset.results_folder

    def argv(spec: RunSpec) -> list[str]:
        """The spec's fedkey command line, its folder under this preset's runs."""
        return command(spec, preset, data_root, run_root / spec.id)

    def computes(spec: RunSpec) -> tuple[str, ...]:
        """What the spec's run computes (its command but for where it runs: its twins')."""
        return what_it_computes(shlex.join(argv(spec)))

    def firsts(specs: list[RunSpec]) -> dict[str, str]:
        """Spec id -> the id of the spec before it in `specs` that computes the same (its twin:
        recorded from that run once it ends, never run itself)."""
        first: dict[tuple[str, ...], str] = {}
        return {s.id: first.setdefault(computes(s), s.id) for s in specs}

    def todo_now(dry_run: bool = False) -> list[RunSpec]:
        """The selected runs not done yet (`dry_run`: every selected command line printed)."""
        specs = select(preset, suites, bench.read(), only)
        missing = [d for d in {s.dataset for s in specs} - {"demo"} if not (data_root / d).is_dir()]
        if missing:
            raise FileNotFoundError(f"no dataset {', '.join(missing)} under {data_root}")
        if dry_run:
            print("\n".join(shlex.join(argv(s)) for s in specs))
        pending = bench.pending(specs, lambda s: (s.id, argv(s)), same=what_it_computes)
        done = twins(r for r in bench.read() if r.get("preset") == preset.name)
        return [s for s in pending if not adopt(s, done, dry_run)]

    def adopt(spec: RunSpec, done: dict, dry_run: bool) -> bool:
        """Whether a done run of the preset computed `spec` already (its command but for its
        --out and where it ran: fedkey_bench.runs.twins); unless `dry_run`, recorded from it, not run
        again."""
        cmd = shlex.join(argv(spec))
        twin = done.get(what_it_computes(cmd))
        if twin is not None and not dry_run:
            bench.add(reused(dict(twin), spec, cmd), bench_command)
            tqdm.write(f"{spec.id}: the same command as {twin['id']} but for --out (and where it "
                       f"ran); recorded from it, not run again")  # fmt: skip
        return twin is not None

    def pace() -> Pace:
        mine = [r for r in bench.read() if r.get("preset") == preset.name]
        return Pace(mine, data_root, device_label(), crowd=max(jobs, 1) / cores())

    def expected(spec: RunSpec, pace: Pace) -> float | None:
        """The run's expected seconds (fedkey_bench.paper_budget; None: nothing to judge it by)."""
        return pace.seconds(spec.dataset, shlex.join(argv(spec)), run_root / spec.id)

    if dry_run:
        todo, judged = todo_now(dry_run=True), pace()  # every command line, done or not
        twin_of = firsts(todo)
        needs = [expected(s, judged) for s in todo if twin_of[s.id] == s.id]
        known = [x for x in needs if x is not None]
        # The pace is per device: runs done elsewhere (a lent GPU's) judge nothing here.
        elsewhere = sorted({r.get("device") or "?" for r in bench.read() if r.get("preset")
                            == preset.name and r.get("device") != device_label()})  # fmt: skip
        where = (f"; the pace is this machine's ({device_label()}), and runs done on "
                 f"{', '.join(elsewhere)} do not set it" if elsewhere and not known else "")  # fmt: skip
        left = (f"about {duration(sum(known))} of run time at the pace of those done "
                f"({len(needs) - len(known)} with nothing to judge it by{where})" if known
                else f"no run time to tell: no run done judges them{where}")  # fmt: skip
        print(f"# {len(todo)} of them not done: {left}; the ranking suites add runs as the sweep "
              "decides")  # fmt: skip
        return bench.read()
    todo = todo_now()
    # The runs done before checkpoints were pruned at the end of a run: pruned now, those of the
    # selected specs done with their command as it is (a run begun again keeps all of its).
    finished = {s.id for s in select(preset, suites, bench.read(), only)} - {s.id for s in todo}
    files, size = 0, 0
    for r in bench.read():
        if (
            r.get("preset") == preset.name
            and r["id"] in finished
            and {"best_round", "rounds"} <= r.keys()
        ):
            deleted = keep_what_matters(run_root / r["id"], r)
            files, size = files + deleted[0], size + deleted[1]
    if files:
        print(f"deleted {files} checkpoints ({size / 2**30:.1f} GB) of finished runs: each keeps "
              f"its best and last rounds'")  # fmt: skip
    choosing = [s for s in suites if s in PLANNED and s != "sweep"]
    if choosing and "sweep" not in suites and not bench.lr_choices().get(preset.name):
        raise RuntimeError(f"the {', '.join(choosing)} suites use the learning rates the sweep "
                           f"chooses, and results.json has none for preset {preset.name}: add "
                           f"--suite sweep (it runs first)")  # fmt: skip
    # Runs are child processes, so threads are enough to keep `jobs` of them going at once. A
    # finished run's slot is refilled at once (a batch would wait for its slowest run), from the
    # specs rebuilt with every result: the sweep's choices open the ranking suites' runs.
    # With a time limit, a run starts only if the pace of the runs done says it ends in time
    # (fedkey_bench.paper_budget); a run with none to judge it by starts. The limit is hard: a run
    # still going then is stopped (fedkey_bench.runs.Stopped), and one that resumes goes on next time.
    deadline = None if hours is None else time.monotonic() + hours * 3600

    def time_left() -> float:
        return math.inf if deadline is None else deadline - time.monotonic()

    # The runs stop at the time limit, and when the bench itself is interrupted (Ctrl-C, or a
    # kill: fedkey_bench.cli makes SIGTERM one), so that no child goes on writing its folder unseen.
    interrupted = threading.Event()

    def stop_for(spec: RunSpec) -> Callable[[], bool]:
        """When to stop `spec`'s run: at the time limit, or once the bench is interrupted. A run
        whose metrics hold its last round (or epoch) is let end at the time limit: writing its
        results takes seconds, and stopped there it would be lost on a lent machine."""
        planned = units(shlex.join(argv(spec)))

        def ended() -> bool:
            return planned > 0 and rounds_done(run_root / spec.id) >= planned

        return lambda: interrupted.is_set() or (time_left() <= 0 and not ended())

    def too_long(spec: RunSpec, pace: Pace | None) -> float | None:
        """The run's expected seconds if they are more than the time left, else None."""
        if pace is None or deadline is None:
            return None
        need = expected(spec, pace)
        return need if need is not None and need > time_left() else None

    def can_advance(spec: RunSpec, pace: Pace | None) -> bool:
        """Whether a run too long for the time left is worth starting to stop at the limit: it
        resumes, and at least one of its rounds (or epochs) ends in time, so it keeps a
        checkpoint (fedkey_bench.paper_budget)."""
        if not advance or pace is None:
            return False
        cmd = argv(spec)
        step = pace.step_seconds(spec.dataset, shlex.join(cmd))
        return resumable(cmd) and step is not None and step < time_left()

    def started(spec: RunSpec) -> bool:
        """Whether an earlier, stopped attempt left the run a checkpoint to continue after."""
        return can_resume(run_root / spec.id, shlex.join(argv(spec)))

    # A run noted begun whose folder here holds no checkpoint to continue after (a new machine:
    # run folders stay on the one that ran them) starts again from its first round: say so.
    noted = bench.begun()  # results.json read once, not once per run
    lost = [s.id for s in todo if f"{preset.name}/{s.id}" in noted and not started(s)]
    if lost:
        print(f"{len(lost)} runs noted as begun have no checkpoint under {run_root} (a run's "
              f"folder stays on the machine that ran it): they start again from their first "
              f"round: {', '.join(lost)}")  # fmt: skip
    bar = tqdm(total=len(todo), desc=f"bench paper --preset {preset.name}", unit="run")
    running: dict[Future, RunSpec] = {}
    stopped: dict[str, int | None] = {}  # run id -> rounds kept (None: none), of those stopped
    failed: dict[str, str] = {}  # run id -> why, of the runs that failed (the others go on)

    def to_start(slots: int) -> list[RunSpec]:
        """The next runs for `slots` free slots: those that fit in the time left, in order; then
        the ones that resume (those already begun first) if `advance`. A run that computes what
        one going (or chosen before it) does waits: once that one is done, it is recorded from
        it (`adopt`: confirm's row at the sweep's lr is its rank run, under another id)."""
        if slots <= 0 or time_left() <= 0:
            return []
        busy = {s.id for s in running.values()} | stopped.keys() | failed.keys()
        free = [s for s in todo if s.id not in busy]
        paced = None if deadline is None else pace()
        fits = [s for s in free if too_long(s, paced) is None]
        ahead = [s for s in free if s not in fits and can_advance(s, paced)]
        ahead.sort(key=lambda s: not started(s))
        going = {computes(s) for s in running.values()}
        chosen: list[RunSpec] = []
        for spec in fits + ahead:
            if len(chosen) < slots and computes(spec) not in going:
                going.add(computes(spec))
                chosen.append(spec)
        return chosen

    def settle(spec: RunSpec, future: Future) -> None:
        """Record a finished run in results.json, or why it did not finish."""
        try:
            result = future.result()
        except Stopped as halt:
            cmd = argv(spec)
            why = "" if interrupted.is_set() else " at the time limit"
            if not resumable(cmd):  # an n-gram: minutes, and nothing kept
                stopped[spec.id] = None
                bar.write(f"{spec.id}: stopped{why}; the next bench starts it again")
                return
            stopped[spec.id] = halt.rounds
            bench.stopped(preset.name, spec.id, halt.rounds, int(units(shlex.join(cmd))),
                          best_so_far(run_root / spec.id))  # fmt: skip
            bar.write(f"{spec.id}: stopped{why} after round {halt.rounds}; the next bench "
                      f"continues it")  # fmt: skip
            return
        except RuntimeError as error:  # a days-long bench goes on with the other runs
            failed[spec.id] = str(error).splitlines()[0]
            bar.write(f"{spec.id}: FAILED (its log: {run_root / spec.id / 'log.txt'})")
            return
        bench.add(result, bench_command)
        bar.update()
        bar.write(f"{result['id']}: test ppl {result['test_ppl']:.2f} (best round "
                  f"{result['best_round']}), {result['wall_seconds']:.0f} s")  # fmt: skip

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        try:
            while True:
                for spec in to_start(max(jobs, 1) - len(running)):
                    job = pool.submit(run_one, spec, preset, data_root, run_root, stop_for(spec))
                    running[job] = spec
                if not running:  # all done, or nothing left fits in the time left
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    settle(running.pop(future), future)
                todo = [s for s in todo_now() if s.id not in {r.id for r in running.values()}]
                bar.total = bar.n + len(todo) + len(running)
                bar.refresh()
        except BaseException:
            interrupted.set()  # the runs going stop within 2 s, their checkpoints kept
            for future in wait(running).done:  # each noted as begun (or done), as at a limit
                settle(running.pop(future), future)
            raise
    bar.close()
    todo = [s for s in todo if s.id not in failed]
    if todo and hours is not None:
        final = pace()
        print(f"{len(todo)} runs left for want of time ({duration(max(time_left(), 0.0))} left "
              f"of --hours {hours:g}); run the bench again to go on:")  # fmt: skip
        twin_of = firsts(todo)
        for spec in todo:
            if twin_of[spec.id] != spec.id:
                print(f"  {spec.id} (the same run as {twin_of[spec.id]}: recorded from it)")
                continue
            need = expected(spec, final)
            begun = (f", stopped after round {stopped[spec.id]}: the next bench continues it"
                     if stopped.get(spec.id) is not None else "")  # fmt: skip
            print(f"  {spec.id} (about {duration(need) if need else '?'} to run{begun})")
    unwritten = write_fresh(out / preset.results_folder)
    problems = [unwritten] if unwritten else []
    if failed:
        problems.append(f"{len(failed)} runs failed; the others are in results.json. Fix the "
                        f"cause (each run's log.txt says it) and run the bench again:\n"
                        + "\n".join(f"  {why}" for why in failed.values()))  # fmt: skip
    if problems:
        raise RuntimeError("\n".join(problems))
    return bench.read()


#: The module that writes the report, run by write_fresh.
REPORT_MODULE = "fedkey_bench.paper_report"


def write_fresh(folder: Path) -> str | None:
    """:func:`write` in a new interpreter; what went wrong in one line, or None. A bench runs for
    hours, and the code on disk may change meanwhile (a commit mid-bench: each run's child
    process takes the code as it is then): the report must import modules that match each
    other, not mix them with those this process imported at its start."""
    done = subprocess.run([sys.executable, "-m", REPORT_MODULE, str(folder)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return (
        f"results.md was not written ({last}); results.json holds every run: rebuild the "
        f"report with `python -m {REPORT_MODULE} {folder}`"
    )


def write(folder: Path) -> list[dict]:
    """Regenerate FOLDER/results.md and its curves from FOLDER/results.json."""
    from fedkey_bench.paper_report import write_report

    bench = Bench(folder)
    runs = bench.read()
    for r in runs:  # the seed papers' numbers are this file's constants, as they are now
        r["seed_ppl"] = seed_number(
            r["suite"], r["dataset"], r["method"], r["fraction"], r["group"]
        )
    write_report(runs, folder, bench.commands(), bench.lr_choices(), bench.begun())
    return runs
