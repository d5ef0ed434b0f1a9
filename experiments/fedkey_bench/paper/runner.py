"""`fedkey-bench paper`: the seed papers' experiments and the ranking of the methods, run
by the project's own commands.

Every run is one `fedkey simulate` (in-process), `fedkey run` (server + phones over HTTP),
`fedkey train-central` or `fedkey ngram` command line, executed as a child process; its
metrics.jsonl is summarized into one object of results.json with the command, the git commit and
the device beside the numbers (and, for the federated runs, the spread of the server's per-phone
weights each round: fedkey_bench.paper.spread). results.md (fedkey_bench.paper.report) leads with the language-model
perplexity and keyboard metrics of each method beside the centralized ceiling and the n-gram.

The presets are in fedkey_bench.paper.presets, the suites in fedkey_bench.paper.suites. A run whose command is already in results.json is not run again, so an
interrupted bench resumes; the suites that depend on the learning-rate sweep's choices (rank,
noniid) are rebuilt after every run, so one command runs the sweep and then the runs that use
what it chose.
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from tqdm import tqdm

from fedkey.federation.storage import prune_checkpoints
from fedkey_bench.common.runs import (
    Stopped,
    best_so_far,
    can_resume,
    device_label,
    rounds_done,
    run_fedkey,
    twins,
    what_it_computes,
)
from fedkey_bench.paper.attopt_step import step_scales, update_norms
from fedkey_bench.paper.budget import Pace, cores, duration, units
from fedkey_bench.paper.plan import LATE, command, placed, select, superseded
from fedkey_bench.paper.presets import PRESETS, Preset
from fedkey_bench.paper.results import Bench
from fedkey_bench.paper.spec import DATASETS, RunSpec
from fedkey_bench.paper.spread import round_spreads
from fedkey_bench.paper.suites import PLANNED, SEEDS, SUITES, seed_number, suite_runs

__all__ = [
    "DATASETS", "LATE", "PRESETS", "SEEDS", "SUITES", "Bench", "Preset", "RunSpec", "command",
    "run_bench", "seed_number", "select", "suite_runs", "summarize", "superseded",
]  # fmt: skip


# -- running --------------------------------------------------------------------------------------


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
        # the suggestion bar's ranking (no </s>, <unk>): recorded by the runs that have it
        **{k: best[k] for k in ("bar_top1", "bar_top3") if k in best},
        "ksr": best.get("ksr"),
        # a corpus with held-out senders (NUS SMS, Ubuntu IRC): the best model on their messages
        **{k: best.get(k) for k in UNSEEN if k in best},
        "rounds": rows[-1]["round"],
        "rounds_to_ppl_90": below_90[0] if below_90 else None,
        # the rounds' own seconds (training and aggregation, no evaluation): fedkey_bench.paper.budget
        "train_seconds": round(sum(r.get("seconds") or 0.0 for r in rows), 1),
        "uplink_bytes": sum(r.get("bytes_up", 0) for r in rows),
        "downlink_bytes": sum(r.get("bytes_down", 0) for r in rows),
        "updates": sum(len(r.get("aggregated", [])) for r in rows),
        "epsilon": rows[-1].get("epsilon"),
        "curve": [[r["round"], r["val_ppl"], r["test_ppl"]] for r in rows],
        "weight_spread": round_spreads(rows) if spec.kind == "federated" else [],
        "update_norms": update_norms(
            rows
        ),  # fedkey_bench.paper.attopt_step: FedAttOpt's reach against them
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
    (fedkey_bench.common.runs.twins): its numbers, the spec's own place and command, and `same_run_as`
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
    `stop()` says True a run still going is stopped: fedkey_bench.common.runs.Stopped. Of a run that ends,
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
    from now are started (fedkey_bench.paper.budget), and a run still going then is stopped; the
    others are listed at the end. With `advance`, the slots that none of them fits go to the
    runs that resume: stopped at the limit, the next bench continues them. `backend`: where
    the runs train in place of the preset's (fedkey_bench.paper.plan.placed)."""
    preset = placed(PRESETS[preset_name], backend)
    session = Session(preset, suites, data_root, Bench(out / preset.results_folder),
                      runs_dir / preset.results_folder, only, bench_command)  # fmt: skip
    session.jobs, session.hours, session.advance = max(jobs, 1), hours, advance
    if dry_run:
        session.print_plan()
        return session.bench.read()
    todo = session.todo_now()
    session.prune_finished(todo)
    session.check_sweep_chosen()
    session.deadline = None if hours is None else time.monotonic() + hours * 3600
    session.warn_lost(todo)
    session.print_left(session.run_all(todo))
    unwritten = write_fresh(out / preset.results_folder)
    problems = [unwritten] if unwritten else []
    if session.failed:
        problems.append(f"{len(session.failed)} runs failed; the others are in results.json. Fix "
                        f"the cause (each run's log.txt says it) and run the bench again:\n"
                        + "\n".join(f"  {why}" for why in session.failed.values()))  # fmt: skip
    if problems:
        raise RuntimeError("\n".join(problems))
    return session.bench.read()


class Session:
    """One `fedkey-bench paper` command's pass over a preset's runs: which to start, in what
    order and how many at once, within its time limit, each result recorded as its run ends.

    Runs are child processes, so threads are enough to keep `jobs` of them going at once. A
    finished run's slot is refilled at once (a batch would wait for its slowest run), from the
    specs rebuilt with every result: the sweep's choices open the ranking suites' runs. With a
    time limit (`deadline`), a run starts only if the pace of the runs done says it ends in time
    (fedkey_bench.paper.budget); a run with none to judge it by starts. The limit is hard: a run
    still going then is stopped (fedkey_bench.common.runs.Stopped), and one that resumes goes on
    next time. The runs stop too when the bench itself is interrupted (Ctrl-C, or a kill:
    fedkey_bench.cli makes SIGTERM one), so that no child goes on writing its folder unseen."""

    def __init__(self, preset: Preset, suites: list[str], data_root: Path, bench: Bench,
                 run_root: Path, only: list[str] | None, bench_command: str) -> None:  # fmt: skip
        self.preset, self.suites, self.data_root = preset, suites, data_root
        self.bench, self.run_root, self.only = bench, run_root, only
        self.bench_command = bench_command
        self.jobs, self.advance = 1, True
        self.hours: float | None = None  # --hours
        self.deadline: float | None = None  # time.monotonic() at the limit
        self.interrupted = threading.Event()
        self.todo: list[RunSpec] = []
        self.running: dict[Future, RunSpec] = {}
        self.stopped: dict[str, int | None] = {}  # run id -> rounds kept (None: none)
        self.failed: dict[str, str] = {}  # run id -> why (the other runs go on)
        self.bar = tqdm(disable=True)

    # -- the runs and their commands ---------------------------------------------------------

    def argv(self, spec: RunSpec) -> list[str]:
        """The spec's fedkey command line, its folder under this preset's runs."""
        return command(spec, self.preset, self.data_root, self.run_root / spec.id)

    def computes(self, spec: RunSpec) -> tuple[str, ...]:
        """What the spec's run computes (its command but for where it runs: its twins')."""
        return what_it_computes(shlex.join(self.argv(spec)))

    def firsts(self, specs: list[RunSpec]) -> dict[str, str]:
        """Spec id -> the id of the spec before it in `specs` that computes the same (its twin:
        recorded from that run once it ends, never run itself)."""
        first: dict[tuple[str, ...], str] = {}
        return {s.id: first.setdefault(self.computes(s), s.id) for s in specs}

    def todo_now(self, dry_run: bool = False) -> list[RunSpec]:
        """The selected runs not done yet (`dry_run`: every selected command line printed)."""
        specs = select(self.preset, self.suites, self.bench.read(), self.only)
        missing = [d for d in {s.dataset for s in specs} - {"demo"}
                   if not (self.data_root / d).is_dir()]  # fmt: skip
        if missing:
            raise FileNotFoundError(f"no dataset {', '.join(missing)} under {self.data_root}")
        if dry_run:
            print("\n".join(shlex.join(self.argv(s)) for s in specs))
        pending = self.bench.pending(specs, lambda s: (s.id, self.argv(s)), same=what_it_computes)
        done = twins(r for r in self.bench.read() if r.get("preset") == self.preset.name)
        return [s for s in pending if not self.adopt(s, done, dry_run)]

    def adopt(self, spec: RunSpec, done: dict, dry_run: bool) -> bool:
        """Whether a done run of the preset computed `spec` already (its command but for its
        --out and where it ran: fedkey_bench.common.runs.twins); unless `dry_run`, recorded from
        it, not run again."""
        cmd = shlex.join(self.argv(spec))
        twin = done.get(what_it_computes(cmd))
        if twin is not None and not dry_run:
            self.bench.add(reused(dict(twin), spec, cmd), self.bench_command)
            tqdm.write(f"{spec.id}: the same command as {twin['id']} but for --out (and where it "
                       f"ran); recorded from it, not run again")  # fmt: skip
        return twin is not None

    # -- time ---------------------------------------------------------------------------------

    def pace(self) -> Pace:
        """The pace of the preset's runs done on this device."""
        mine = [r for r in self.bench.read() if r.get("preset") == self.preset.name]
        return Pace(mine, self.data_root, device_label(), crowd=self.jobs / cores())

    def expected(self, spec: RunSpec, pace: Pace) -> float | None:
        """The run's expected seconds (fedkey_bench.paper.budget; None: nothing to judge it by)."""
        return pace.seconds(spec.dataset, shlex.join(self.argv(spec)), self.run_root / spec.id)

    def time_left(self) -> float:
        """Seconds to the time limit (infinite without one)."""
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def stop_for(self, spec: RunSpec) -> Callable[[], bool]:
        """When to stop `spec`'s run: at the time limit, or once the bench is interrupted. A run
        whose metrics hold its last round (or epoch) is let end at the time limit: writing its
        results takes seconds, and stopped there it would be lost on a lent machine."""
        planned = units(shlex.join(self.argv(spec)))
        folder = self.run_root / spec.id

        def ended() -> bool:
            return planned > 0 and rounds_done(folder) >= planned

        return lambda: self.interrupted.is_set() or (self.time_left() <= 0 and not ended())

    def too_long(self, spec: RunSpec, pace: Pace | None) -> float | None:
        """The run's expected seconds if they are more than the time left, else None."""
        if pace is None or self.deadline is None:
            return None
        need = self.expected(spec, pace)
        return need if need is not None and need > self.time_left() else None

    def can_advance(self, spec: RunSpec, pace: Pace | None) -> bool:
        """Whether a run too long for the time left is worth starting to stop at the limit: it
        resumes, and at least one of its rounds (or epochs) ends in time, so it keeps a
        checkpoint (fedkey_bench.paper.budget)."""
        if not self.advance or pace is None:
            return False
        cmd = self.argv(spec)
        step = pace.step_seconds(spec.dataset, shlex.join(cmd))
        return resumable(cmd) and step is not None and step < self.time_left()

    def started(self, spec: RunSpec) -> bool:
        """Whether an earlier, stopped attempt left the run a checkpoint to continue after."""
        return can_resume(self.run_root / spec.id, shlex.join(self.argv(spec)))

    # -- before the runs ----------------------------------------------------------------------

    def print_plan(self) -> None:
        """--dry-run: every command line, done or not, and the run time of those not done."""
        todo, judged = self.todo_now(dry_run=True), self.pace()
        twin_of = self.firsts(todo)
        needs = [self.expected(s, judged) for s in todo if twin_of[s.id] == s.id]
        known = [x for x in needs if x is not None]
        # The pace is per device: runs done elsewhere (a lent GPU's) judge nothing here.
        here = device_label()
        elsewhere = sorted({r.get("device") or "?" for r in self.bench.read()
                            if r.get("preset") == self.preset.name and r.get("device") != here})  # fmt: skip
        where = (f"; the pace is this machine's ({here}), and runs done on "
                 f"{', '.join(elsewhere)} do not set it" if elsewhere and not known else "")  # fmt: skip
        left = (f"about {duration(sum(known))} of run time at the pace of those done "
                f"({len(needs) - len(known)} with nothing to judge it by{where})" if known
                else f"no run time to tell: no run done judges them{where}")  # fmt: skip
        print(f"# {len(todo)} of them not done: {left}; the ranking suites add runs as the sweep "
              "decides")  # fmt: skip

    def prune_finished(self, todo: list[RunSpec]) -> None:
        """The runs done before checkpoints were pruned at the end of a run: pruned now, those of
        the selected specs done with their command as it is (a run begun again keeps all)."""
        selected = select(self.preset, self.suites, self.bench.read(), self.only)
        finished = {s.id for s in selected} - {s.id for s in todo}
        files, size = 0, 0
        for r in self.bench.read():
            if (r.get("preset") == self.preset.name and r["id"] in finished
                    and {"best_round", "rounds"} <= r.keys()):  # fmt: skip
                deleted = keep_what_matters(self.run_root / r["id"], r)
                files, size = files + deleted[0], size + deleted[1]
        if files:
            print(f"deleted {files} checkpoints ({size / 2**30:.1f} GB) of finished runs: each "
                  f"keeps its best and last rounds'")  # fmt: skip

    def check_sweep_chosen(self) -> None:
        """Refuse ranking suites without the sweep's learning rates (nor the sweep to choose them)."""
        choosing = [s for s in self.suites if s in PLANNED and s != "sweep"]
        name = self.preset.name
        if choosing and "sweep" not in self.suites and not self.bench.lr_choices().get(name):
            raise RuntimeError(f"the {', '.join(choosing)} suites use the learning rates the "
                               f"sweep chooses, and results.json has none for preset {name}: add "
                               f"--suite sweep (it runs first)")  # fmt: skip

    def warn_lost(self, todo: list[RunSpec]) -> None:
        """Say which runs noted begun have no checkpoint here to continue after (a new machine:
        run folders stay on the one that ran them): they start again from their first round."""
        noted = self.bench.begun()  # results.json read once, not once per run
        lost = [s.id for s in todo if f"{self.preset.name}/{s.id}" in noted and not self.started(s)]
        if lost:
            print(f"{len(lost)} runs noted as begun have no checkpoint under {self.run_root} (a "
                  f"run's folder stays on the machine that ran it): they start again from their "
                  f"first round: {', '.join(lost)}")  # fmt: skip

    # -- the runs -----------------------------------------------------------------------------

    def to_start(self, slots: int) -> list[RunSpec]:
        """The next runs for `slots` free slots: those that fit in the time left, in order; then
        the ones that resume (those already begun first) if `advance`. A run that computes what
        one going (or chosen before it) does waits: once that one is done, it is recorded from
        it (`adopt`: confirm's row at the sweep's lr is its rank run, under another id)."""
        if slots <= 0 or self.time_left() <= 0:
            return []
        busy = {s.id for s in self.running.values()} | self.stopped.keys() | self.failed.keys()
        free = [s for s in self.todo if s.id not in busy]
        paced = None if self.deadline is None else self.pace()
        fits = [s for s in free if self.too_long(s, paced) is None]
        ahead = [s for s in free if s not in fits and self.can_advance(s, paced)]
        ahead.sort(key=lambda s: not self.started(s))
        going = {self.computes(s) for s in self.running.values()}
        chosen: list[RunSpec] = []
        for spec in fits + ahead:
            if len(chosen) < slots and self.computes(spec) not in going:
                going.add(self.computes(spec))
                chosen.append(spec)
        return chosen

    def settle(self, spec: RunSpec, future: Future) -> None:
        """Record a finished run in results.json, or why it did not finish."""
        try:
            result = future.result()
        except Stopped as halt:
            self.note_stopped(spec, halt.rounds)
            return
        except RuntimeError as error:  # a days-long bench goes on with the other runs
            self.failed[spec.id] = str(error).splitlines()[0]
            self.bar.write(f"{spec.id}: FAILED (its log: {self.run_root / spec.id / 'log.txt'})")
            return
        self.bench.add(result, self.bench_command)
        self.bar.update()
        self.bar.write(f"{result['id']}: test ppl {result['test_ppl']:.2f} (best round "
                       f"{result['best_round']}), {result['wall_seconds']:.0f} s")  # fmt: skip

    def note_stopped(self, spec: RunSpec, rounds: int) -> None:
        """A run stopped at the time limit or by an interrupt: noted begun in results.json if it
        resumes (the next bench continues it), else started again next time."""
        cmd = self.argv(spec)
        why = "" if self.interrupted.is_set() else " at the time limit"
        if not resumable(cmd):  # an n-gram: minutes, and nothing kept
            self.stopped[spec.id] = None
            self.bar.write(f"{spec.id}: stopped{why}; the next bench starts it again")
            return
        self.stopped[spec.id] = rounds
        self.bench.stopped(self.preset.name, spec.id, rounds, int(units(shlex.join(cmd))),
                           best_so_far(self.run_root / spec.id))  # fmt: skip
        self.bar.write(f"{spec.id}: stopped{why} after round {rounds}; the next bench "
                       f"continues it")  # fmt: skip

    def run_all(self, todo: list[RunSpec]) -> list[RunSpec]:
        """Run `todo` (and the runs the results open meanwhile), `jobs` at once; -> the runs
        left for want of time."""
        self.todo = todo
        self.bar = tqdm(
            total=len(todo), desc=f"bench paper --preset {self.preset.name}", unit="run"
        )
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            try:
                while self.start_runs(pool):
                    done, _ = wait(self.running, return_when=FIRST_COMPLETED)
                    for future in done:
                        self.settle(self.running.pop(future), future)
                    going = {r.id for r in self.running.values()}
                    self.todo = [s for s in self.todo_now() if s.id not in going]
                    self.bar.total = self.bar.n + len(self.todo) + len(self.running)
                    self.bar.refresh()
            except BaseException:
                self.interrupted.set()  # the runs going stop within 2 s, their checkpoints kept
                for future in wait(self.running).done:  # each noted begun (or done), as at a limit
                    self.settle(self.running.pop(future), future)
                raise
        self.bar.close()
        return [s for s in self.todo if s.id not in self.failed]

    def start_runs(self, pool: ThreadPoolExecutor) -> bool:
        """Fill the free slots; whether any run is going (False: all done, or nothing left fits
        in the time left)."""
        for spec in self.to_start(self.jobs - len(self.running)):
            job = pool.submit(run_one, spec, self.preset, self.data_root, self.run_root,
                              self.stop_for(spec))  # fmt: skip
            self.running[job] = spec
        return bool(self.running)

    def print_left(self, todo: list[RunSpec]) -> None:
        """With a time limit: the runs left, each with its expected run time."""
        if not todo or self.hours is None:
            return
        final = self.pace()
        print(f"{len(todo)} runs left for want of time ({duration(max(self.time_left(), 0.0))} "
              f"left of --hours {self.hours:g}); run the bench again to go on:")  # fmt: skip
        twin_of = self.firsts(todo)
        for spec in todo:
            if twin_of[spec.id] != spec.id:
                print(f"  {spec.id} (the same run as {twin_of[spec.id]}: recorded from it)")
                continue
            need = self.expected(spec, final)
            begun = (f", stopped after round {self.stopped[spec.id]}: the next bench continues it"
                     if self.stopped.get(spec.id) is not None else "")  # fmt: skip
            print(f"  {spec.id} (about {duration(need) if need else '?'} to run{begun})")


#: The module that writes the report, run by write_fresh.
REPORT_MODULE = "fedkey_bench.paper.report"


def write_fresh(folder: Path) -> str | None:
    """fedkey_bench.paper.report.write in a new interpreter; what went wrong in one line, or None. A bench runs for
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
