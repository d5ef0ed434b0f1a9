"""Do a results table's figures come back from the models kept for them? `python -m
fedkey_bench.paper.verify experiments/results/cpu`.

A finished bench run keeps its best and last rounds' checkpoints (fedkey_bench.paper.runner.keep_what_matters).
This scores each selected run's best-round checkpoint again on its own held-out text (the
--data, --paper-protocol, --max-eval-sentences, --ksr-sentences, --seed, --partition and
--clients of its recorded command, at the precision it evaluated in: fedkey.runners.rescore) and sets
the figures beside those in results.json: a row whose test perplexity comes back is one a reader
can check from the model itself, and a row that does not names a fault between training,
choosing the best round and keeping its checkpoint. The checkpoints stay on the machine that ran
the runs (runs/ is not committed): a run without one here is listed as such, not failed.

With `--record`, each check made here is kept in FOLDER/verified.json (the run's figures, those
scored again, the verdict, the machine, the commit and the day), and a run whose checkpoint is
not here shows the check an earlier machine made of it, if its figures are still those that were
checked: so the table covers every machine's checks, not only this one's.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import sys
from pathlib import Path

from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.paper.results import Bench
from fedkey_bench.paper.spec import command_flag

#: The verdict of a run whose checkpoint is not on this machine.
NOT_HERE = "no checkpoint here"


def checkpoint_of(run: dict, runs_dir: Path) -> Path:
    """The checkpoint of a run's best round in its folder under RUNS_DIR (a twin's: the run it was
    recorded from)."""
    folder = runs_dir / (run.get("same_run_as") or run["id"])
    return folder / "checkpoints" / f"round_{int(run['best_round']):04d}.safetensors"


def held_out_flags(cmd: str) -> dict:
    """fedkey.runners.rescore's arguments from a recorded fedkey command line (a flag it lacks: the CLI's
    default, the Settings default)."""
    from fedkey.server.settings import Settings

    def given(flag: str, name: str):
        value = command_flag(cmd, flag)
        return Settings.model_fields[name].default if value == "-" else int(value)

    def or_default(flag: str, default: str) -> str:  # simulate's default where it lacks one
        value = command_flag(cmd, flag)
        return default if value == "-" else value

    return {
        "data": command_flag(cmd, "--data"),
        "paper_protocol": "--paper-protocol" in cmd.split(),
        "max_eval_sentences": given("--max-eval-sentences", "max_eval_sentences"),
        "ksr_sentences": given("--ksr-sentences", "ksr_sentences"),
        "seed": given("--seed", "seed"),
        # a real-typing run (--partition user) is scored on its --clients phones' senders
        "clients": int(or_default("--clients", "100")),
        "partition": or_default("--partition", "iid"),
    }


def verify(runs: list[dict], runs_dir: Path, progress=None) -> list[list[str]]:
    """One row per run: its recorded best validation and test perplexity, the same scored again
    from its kept checkpoint, and whether every recorded score agrees (fedkey.runners.rescore.AGREE)."""
    from fedkey.models.checkpoint import read_metadata
    from fedkey.runners.rescore import agrees, rescore

    rows = []
    for run in runs:
        path = checkpoint_of(run, runs_dir)
        cells = [run["id"], str(run["best_round"]), f"{run['best_val_ppl']:.2f}",
                 f"{run['test_ppl']:.2f}"]  # fmt: skip
        if not path.is_file():
            rows.append([*cells, "-", "-", NOT_HERE])
        else:
            asked = (read_metadata(path).get("metrics") or {}).get("eval_precision", "auto")
            r = rescore(path, device="cpu", precision=asked, **held_out_flags(run["command"]))
            # the checkpoint's own record of its round, and the figures results.json holds
            differ = r.differ + [f"{k} of results.json" for k, mine in (("val_ppl", "best_val_ppl"),
                                 ("test_ppl", "test_ppl")) if not agrees(r.scores[k], run[mine])]  # fmt: skip
            rows.append([*cells, f"{r.scores['val_ppl']:.2f}", f"{r.scores['test_ppl']:.2f}",
                         f"no: {', '.join(differ)}" if differ else "yes"])  # fmt: skip
        if progress is not None:
            progress.update()
    return rows


#: Where `--record` keeps the checks, in the results folder beside results.json.
RECORD = "verified.json"


def recorded(record: dict, run: dict, row: list[str]) -> list[str]:
    """`run`'s row (verify's, without a checkpoint here) with an earlier machine's check of it
    from `record` (RECORD's object), its verdict naming where and when; the row as it was if
    there is none or the run's figures changed since (a rerun)."""
    from fedkey.runners.rescore import agrees

    then = record.get(run["id"])
    if (
        not then
        or then["best_round"] != run["best_round"]
        or not all(agrees(then[k], run[k]) for k in ("best_val_ppl", "test_ppl"))
    ):
        return row
    return [*row[:4], f"{then['val_again']:.2f}", f"{then['test_again']:.2f}",
            f"{then['agrees']} (on {then['device']}, {then['day']})"]  # fmt: skip


def read_record(path: Path) -> dict:
    """The checks kept at `path` by run id ({} where there is none yet); ValueError where the
    file is not such a record."""
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())["runs"]
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not a record of checks this command wrote ({e})") from e
    if not isinstance(record, dict):
        raise ValueError(f"{path} is not a record of checks this command wrote")
    return record


def record_checks(path: Path, before: dict, runs: list[dict], rows: list[list[str]],
                  device: str) -> None:  # fmt: skip
    """Write to `path` the record `before` with this machine's checks (`rows`, verify's, of
    `runs`) added."""
    from fedkey_bench.common.provenance import git

    now = dict(before)
    day, commit = datetime.date.today().isoformat(), git("rev-parse", "HEAD")
    for run, row in zip(runs, rows, strict=True):
        if row[-1] != NOT_HERE:
            now[run["id"]] = {"best_round": run["best_round"], "best_val_ppl": run["best_val_ppl"],
                              "test_ppl": run["test_ppl"], "val_again": float(row[4]),
                              "test_again": float(row[5]), "agrees": row[-1], "device": device,
                              "day": day, "git_commit": commit}  # fmt: skip
    path.write_text(json.dumps({"runs": dict(sorted(now.items()))}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "folder", type=Path, help="A bench results folder (experiments/results/cpu)."
    )
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/bench"),
                        help="Where the bench's run folders are: RUNS_DIR/<folder name>/<run id>.")  # fmt: skip
    parser.add_argument("--suite", action="append", default=None,
                        help="Only the runs of this suite (repeat; default: rank).")  # fmt: skip
    parser.add_argument("--only", action="append", default=None,
                        help="Only the run ids matching this glob (repeat).")  # fmt: skip
    parser.add_argument("--record", action="store_true",
                        help=f"Keep this machine's checks in FOLDER/{RECORD}, and show an earlier "
                        "machine's check of a run whose checkpoint is not here.")  # fmt: skip
    args = parser.parse_args(argv)
    import torch
    from tqdm import tqdm

    from fedkey_bench.common.runs import device_label

    torch.set_num_threads(1)
    suites = set(args.suite or ["rank"])
    runs = [r for r in Bench(args.folder).read()
            if r.get("suite") in suites and r.get("kind") in ("federated", "central")
            and "best_round" in r
            and (not args.only or any(fnmatch.fnmatch(r["id"], g) for g in args.only))]  # fmt: skip
    if not runs:
        print(f"no finished run of {', '.join(sorted(suites))} in {args.folder}", file=sys.stderr)
        return 1
    try:  # read before the scoring, so that a damaged record costs no time
        earlier = read_record(args.folder / RECORD) if args.record else {}
    except ValueError as e:
        print(f"{e}: move it aside and run again", file=sys.stderr)
        return 2
    with tqdm(total=len(runs), desc="scoring kept checkpoints", unit="run") as bar:
        rows = verify(runs, args.runs_dir / args.folder.name, bar)
    here = [row[-1] != NOT_HERE for row in rows]  # checked on this machine
    if args.record:
        record_checks(args.folder / RECORD, earlier, runs, rows, device_label())
        rows = [recorded(earlier, run, row) if row[-1] == NOT_HERE else row
                for run, row in zip(runs, rows, strict=True)]  # fmt: skip
    header = ["run", "best round", "val ppl", "test ppl", "val ppl, scored again",
              "test ppl, scored again", "agrees"]  # fmt: skip
    print(f"# {args.folder}: its runs scored again from their kept checkpoints\n\n"
          f"`python -m fedkey_bench.paper.verify {' '.join(argv if argv is not None else sys.argv[1:])}`"
          f", on {device_label()}; `agrees`: every score the checkpoint recorded for its round, "
          "and results.json's validation and test perplexity, within 0.1%"
          + (f"; a run checked on an earlier machine (FOLDER/{RECORD}) names it" if args.record
             else "") + ".\n")  # fmt: skip
    print(markdown_table(header, rows))
    mine = [r for r, h in zip(rows, here, strict=True) if h]
    before = [r for r, h in zip(rows, here, strict=True) if not h and r[-1] != NOT_HERE]
    good = sum(r[-1] == "yes" for r in mine)
    print(f"\n{good} of {len(mine)} runs with a checkpoint here give their recorded figures "
          f"again ({len(rows) - len(mine)} without one"
          + (f"; of those, {sum(r[-1].startswith('yes') for r in before)} of {len(before)} "
             "checked on an earlier machine gave them" if args.record else "") + ")")  # fmt: skip
    return 0 if good == len(mine) else 1


if __name__ == "__main__":
    sys.exit(main())
