"""Do a results table's figures come back from the models kept for them? `python -m
bench.paper_verify bench/results/cpu`.

A finished bench run keeps its best and last rounds' checkpoints (bench.paper.keep_what_matters).
This scores each selected run's best-round checkpoint again on its own held-out text (the
--data, --paper-protocol, --max-eval-sentences, --ksr-sentences and --seed of its recorded
command, at the precision it evaluated in: runners.rescore) and sets the figures beside those in
results.json: a row whose test perplexity comes back is one a reader can check from the model
itself, and a row that does not names a fault between training, choosing the best round and
keeping its checkpoint. The checkpoints stay on the machine that ran the runs (runs/ is not
committed): a run without one here is listed as such, not failed.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

from bench.paper_results import Bench
from bench.paper_spec import command_flag
from bench.report import markdown_table


def checkpoint_of(run: dict, runs_dir: Path) -> Path:
    """The checkpoint of a run's best round in its folder under RUNS_DIR (a twin's: the run it was
    recorded from)."""
    folder = runs_dir / (run.get("same_run_as") or run["id"])
    return folder / "checkpoints" / f"round_{int(run['best_round']):04d}.safetensors"


def held_out_flags(cmd: str) -> dict:
    """runners.rescore's arguments from a recorded fedkey command line (a flag it lacks: the CLI's
    default, the Settings default)."""
    from server.settings import Settings

    def given(flag: str, name: str):
        value = command_flag(cmd, flag)
        return Settings.model_fields[name].default if value == "-" else int(value)

    return {
        "data": command_flag(cmd, "--data"),
        "paper_protocol": "--paper-protocol" in cmd.split(),
        "max_eval_sentences": given("--max-eval-sentences", "max_eval_sentences"),
        "ksr_sentences": given("--ksr-sentences", "ksr_sentences"),
        "seed": given("--seed", "seed"),
    }


def verify(runs: list[dict], runs_dir: Path, progress=None) -> list[list[str]]:
    """One row per run: its recorded best validation and test perplexity, the same scored again
    from its kept checkpoint, and whether every recorded score agrees (runners.rescore.AGREE)."""
    from models.checkpoint import read_metadata
    from runners.rescore import agrees, rescore

    rows = []
    for run in runs:
        path = checkpoint_of(run, runs_dir)
        cells = [run["id"], str(run["best_round"]), f"{run['best_val_ppl']:.2f}",
                 f"{run['test_ppl']:.2f}"]  # fmt: skip
        if not path.is_file():
            rows.append([*cells, "-", "-", "no checkpoint here"])
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="A bench results folder (bench/results/cpu).")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/bench"),
                        help="Where the bench's run folders are: RUNS_DIR/<folder name>/<run id>.")  # fmt: skip
    parser.add_argument("--suite", action="append", default=None,
                        help="Only the runs of this suite (repeat; default: rank).")  # fmt: skip
    parser.add_argument("--only", action="append", default=None,
                        help="Only the run ids matching this glob (repeat).")  # fmt: skip
    args = parser.parse_args(argv)
    import torch
    from tqdm import tqdm

    from bench.runs import device_label

    torch.set_num_threads(1)
    suites = set(args.suite or ["rank"])
    runs = [r for r in Bench(args.folder).read()
            if r.get("suite") in suites and r.get("kind") in ("federated", "central")
            and "best_round" in r
            and (not args.only or any(fnmatch.fnmatch(r["id"], g) for g in args.only))]  # fmt: skip
    if not runs:
        print(f"no finished run of {', '.join(sorted(suites))} in {args.folder}", file=sys.stderr)
        return 1
    with tqdm(total=len(runs), desc="scoring kept checkpoints", unit="run") as bar:
        rows = verify(runs, args.runs_dir / args.folder.name, bar)
    header = ["run", "best round", "val ppl", "test ppl", "val ppl, scored again",
              "test ppl, scored again", "agrees"]  # fmt: skip
    print(f"# {args.folder}: its runs scored again from their kept checkpoints\n\n"
          f"`python -m bench.paper_verify {' '.join(argv if argv is not None else sys.argv[1:])}`"
          f", on {device_label()}; `agrees`: every score the checkpoint recorded for its round, "
          "and results.json's validation and test perplexity, within 0.1%.\n")  # fmt: skip
    print(markdown_table(header, rows))
    checked = [r for r in rows if r[-1] != "no checkpoint here"]
    good = sum(r[-1] == "yes" for r in checked)
    print(f"\n{good} of {len(checked)} runs with a checkpoint here give their recorded figures "
          f"again ({len(rows) - len(checked)} without one)")  # fmt: skip
    return 0 if good == len(checked) else 1


if __name__ == "__main__":
    sys.exit(main())
