"""results.json of `fedkey-bench paper` (and of the benches that keep their results with it):
the runs, the bench command lines that produced them, the learning rates the sweep chose, and
the runs stopped at a time limit. Written under a file lock, replaced atomically."""

from __future__ import annotations

import fcntl
import json
import shlex
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from fedkey.common.files import atomic_write
from fedkey_bench.common.runs import without_options
from fedkey_bench.paper.presets import PRESETS
from fedkey_bench.paper.sweep import lr_choices

T = TypeVar("T")

#: Options that say how or where a bench ran, not what it ran (with how many values each): the
#: bench command that results.json records leaves them out, so a bench continued over several
#: sessions with other --hours (or on a GPU, --backend stacked) is one line, not one per session.
HOW = {"--jobs": 1, "--hours": 1, "--advance": 0, "--no-advance": 0, "--backend": 1}


def what_it_runs(command: str) -> str:
    """The bench command line without the options of HOW."""
    return shlex.join(without_options(command, HOW))


class Bench:
    """results.json of a results folder (one or more presets' runs), updated one run at a time under
    a file lock (two suites may run side by side) and replaced atomically, so an interrupted bench
    loses at most its current run. Beside the runs it keeps the bench command lines and, per
    preset, the learning rates the sweep chose (``lr_choices``, which the ranking suites use).
    The other benches (attacks, privacy, load) keep their results with it too."""

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
            return {"bench_commands": [], "lr_choices": {}, "runs": []}
        return {"lr_choices": {}, **json.loads(self.path.read_text())}

    def pending(
        self,
        items: Iterable[T],
        run: Callable[[T], tuple[str, list[str]]],
        dry_run: bool = False,
        same: Callable[[str], Hashable] = str,
    ) -> list[T]:
        """The items whose run (``run(item)``: its id and command line) is not in results.json
        with the same command (``same(command)`` equal: bench paper leaves out where a run ran,
        fedkey_bench.common.runs.what_it_computes): an interrupted bench resumes. With ``dry_run``, print every
        item's command line and return none."""
        done = {(r["id"], same(r["command"])) for r in self.read()}  # results.json read once
        todo = []
        for item in items:
            spec_id, argv = run(item)
            cmd = shlex.join(argv)
            if dry_run:
                print(cmd)
            elif (spec_id, same(cmd)) not in done:
                todo.append(item)
        return todo

    def begun(self) -> dict[str, list[float]]:
        """ "<preset>/<run id>" -> [rounds done, rounds, best val ppl so far, its round] of the
        runs stopped at a time limit before their end (`fedkey-bench paper --hours`): the next
        bench continues them. (Runs stopped before the bench noted the best have two items.)"""
        begun: dict[str, list[float]] = self._data().get("begun", {})
        return begun

    @contextmanager
    def _updating(self) -> Iterator[dict]:
        """results.json's content, to change in place: read under the file lock and written back
        atomically at the end of the block (not at all if the block raises)."""
        with (self.out / ".results.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._data()
            yield data
            order = ("bench_commands", "lr_choices", "begun", "runs")
            body = {k: data[k] for k in (*order, *data) if k in data}
            for part in ("lr_choices", "begun"):  # the other benches' results.json as before
                if not body.get(part):
                    body.pop(part, None)
            atomic_write(self.path, json.dumps(body, indent=1))

    def stopped(
        self, preset: str, run_id: str, rounds: int, of: int, best: Sequence[float] = ()
    ) -> None:
        """Note that a run stopped at a time limit after `rounds` of its `of` rounds, its `best`
        validation perplexity and round so far (fedkey_bench.common.runs.best_so_far)."""
        with self._updating() as data:
            data["begun"] = {**data.get("begun", {}), f"{preset}/{run_id}": [rounds, of, *best]}

    def add(self, result: dict, bench_command: str) -> list[dict]:
        """Record one run (replacing the same preset's run of the same id; no longer begun), the
        bench command that ran it (what_it_runs), and recompute that preset's sweep choices."""
        with self._updating() as data:
            key = (result["id"], result.get("preset"))
            data["begun"] = {k: v for k, v in data.get("begun", {}).items()
                             if k != f"{result.get('preset')}/{result['id']}"}  # fmt: skip
            runs = [r for r in data["runs"] if (r["id"], r.get("preset")) != key] + [result]
            data["runs"] = runs
            line = what_it_runs(bench_command) if bench_command else ""
            if line and line not in data["bench_commands"]:
                data["bench_commands"] = [*data["bench_commands"], line]
            preset = PRESETS.get(result.get("preset", ""))
            if preset is not None and result.get("suite") == "sweep":
                data["lr_choices"] = {**data["lr_choices"], preset.name: lr_choices(runs, preset)}
        return runs

    def merge(self, path: Path, take: Collection[str] = ()) -> tuple[list[str], list[str]]:
        """Take in the results.json at `path` of the same bench run on another machine (a GPU
        lent for a session): its runs that this one lacks (by preset and id), its bench command
        lines, and its notes of runs begun there and not done here (the note with more rounds
        winning); the sweep's choices are recomputed. -> ("preset/id" of the runs taken, of
        those this one has too, recorded otherwise there, and keeps as they are here). `take`
        ("preset/id"): runs whose record there replaces this one's (a run the other machine ran
        again at settings the suite plans now); each must be in the other results.json. A begun
        run goes on where its checkpoints are: its folder stays on the machine that ran it."""
        try:
            theirs = json.loads(path.read_text())
            runs = [dict(r) for r in theirs["runs"]]
            names = [f"{r.get('preset')}/{r['id']}" for r in runs]
            lines = [str(line) for line in theirs.get("bench_commands", [])]
            notes = {str(k): list(v) for k, v in theirs.get("begun", {}).items()}
            if not all(v and isinstance(v[0], int) for v in notes.values()):
                raise ValueError("a note of a begun run without its rounds")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a bench's results.json ({e})") from None
        if missing := sorted(set(take) - set(names)):
            raise ValueError(f"{path} has no run {', '.join(missing)} (--theirs takes PRESET/ID)")
        taken: list[str] = []
        kept: list[str] = []
        with self._updating() as data:
            have = {f"{r.get('preset')}/{r['id']}": r for r in data["runs"]}
            for name, r in zip(names, runs, strict=True):
                if name not in have:
                    taken.append(name)
                    data["runs"].append(r)
                elif name in take:
                    taken.append(name)
                    data["runs"] = [r if x is have[name] else x for x in data["runs"]]
                elif have[name] != r:
                    kept.append(name)
            data["bench_commands"] += [x for x in lines if x not in data["bench_commands"]]
            done = set(have) | set(taken)
            begun = {**data.get("begun", {})}
            for name, note in notes.items():
                if name not in begun or note[0] > begun[name][0]:
                    begun[name] = note
            data["begun"] = {k: v for k, v in begun.items() if k not in done}
            swept = {str(r.get("preset")) for name, r in zip(names, runs, strict=True)
                     if r.get("suite") == "sweep" and name in taken}  # fmt: skip
            for preset in sorted(swept & set(PRESETS)):
                choices = lr_choices(data["runs"], PRESETS[preset])
                data["lr_choices"] = {**data["lr_choices"], preset: choices}
        return taken, kept

    def lr_choices(self) -> dict[str, dict[str, dict[str, float]]]:
        """preset -> dataset -> {knob: the value the sweep chose}."""
        return self._data()["lr_choices"]
