"""`fedkey-bench attacks`: malicious phones against FedAvg and FedAtt, with and without the
server's bounded influence, on the demo corpus.

The matrix (every cell one `fedkey simulate` command line, run as a child process):

    strategy    fedavg, fedatt
    defence     on (the defaults: the server rejects the updates whose direction is an outlier
                among the round's (the cosine filter, fedkey.federation.strategies.outliers), trims every
                coordinate of every update to the range of the round's others, clips it to a
                multiple of the round's median norm, caps attention and FedAvg weights), clip (the same without the trim and the filter:
                --trim 0 --outlier-z 0), off
                (--bound off: the seed papers' server, no bounding at all)
    population  1 attacker of 10 phones, 3 of 30 (every phone selected every round)
    attack      clean (no attacker), scale (delta x100), signflip (delta x-10), backdoor (a
                word-prediction backdoor trained on poisoned sentences and boosted by model
                replacement, Bagdasaryan et al. 2020)

plus `nan` and `shape` at 1 of 10 with the defaults: uploads the server's validation refuses, so
the run must match the clean one. Every cell reports the test perplexity per round and the
backdoor's top-1 / top-3 success on held-out trigger contexts (the clean cells run with
`--attack backdoor --malicious 0`, so their success is the clean model's own rate). Results:
OUT/results.json (a cell whose command is already there is not run again: an interrupted bench
resumes), OUT/results.md and OUT/attacks.png (fedkey_bench.attacks.report).
"""

from __future__ import annotations

import fnmatch
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from fedkey_bench.attacks.matrix import DEFENCES, Cell, Protocol, cells
from fedkey_bench.attacks.report import write_report
from fedkey_bench.common.runs import run_fedkey
from fedkey_bench.paper.results import Bench


def command(cell: Cell, protocol: Protocol, run_dir: Path) -> list[str]:
    """The `fedkey simulate` command line of one cell."""
    cmd = ["fedkey", "simulate", *protocol.flags(), "--clients", str(cell.clients)]
    cmd += ["--strategy", cell.strategy, *DEFENCES[cell.defence]]
    if cell.attack == "clean":  # the probe without attackers: the clean model's own rate
        cmd += ["--malicious", "0", "--attack", "backdoor"]
    else:
        cmd += ["--malicious", str(cell.attackers), "--attack", cell.attack]
    if cell.attack in ("clean", "backdoor"):
        cmd += list(protocol.backdoor)
    return cmd + ["--out", str(run_dir)]


def clip_multiple(rows: list[dict]) -> float | None:
    """The adaptive clip's S over the round's median norm in the last aggregated round (the
    multiple the run's server used, whatever its defaults were then); None without one."""
    for r in reversed(rows):
        clip = (r.get("info") or {}).get("clip") or {}
        if clip.get("mode") == "adaptive" and clip.get("norm") and clip.get("median_norm"):
            return round(clip["norm"] / clip["median_norm"], 3)
    return None


def outlier_filter(rows: list[dict]) -> tuple[float | None, list[list[str]]]:
    """The cosine outlier filter's cut in the run's last aggregated round (None: the run's server
    had none, or it was off) and, per aggregated round, the phones it rejected."""
    clips = [(r.get("info") or {}).get("clip") or {} for r in rows[1:]]
    cut = next((c.get("outlier_z") for c in reversed(clips) if c.get("outlier_z")), None)
    return cut, [sorted(c.get("outliers") or {}) for c in clips]


def summarize(rows: list[dict], cell: Cell) -> dict:
    """One results.json object from a cell's metrics rows (round 0: the initial model)."""
    refused = [why for r in rows for why in (r.get("rejected") or {}).values()]
    last = rows[-1]
    cut, outliers = outlier_filter(rows)
    return {
        "strategy": cell.strategy,
        "defence": cell.defence,
        "clients": cell.clients,
        "attackers": cell.attackers,
        "attack": cell.attack,
        "rounds": last["round"],
        "final_test_ppl": last["test_ppl"],
        "final_top1": last.get("top1"),
        "backdoor_top1": last.get("backdoor_top1"),
        "backdoor_top3": last.get("backdoor_top3"),
        "refused_uploads": len(refused),
        "refused_reasons": sorted(set(refused)),
        "aggregated_per_round": [len(r.get("aggregated", [])) for r in rows[1:]],
        "clip_multiple": clip_multiple(rows),
        "outlier_z": cut,
        "outliers_per_round": outliers,  # the cosine filter's rejections, rounds 1..
        # round, test ppl, backdoor top-1, backdoor top-3
        "curve": [
            [r["round"], r["test_ppl"], r.get("backdoor_top1"), r.get("backdoor_top3")]
            for r in rows
        ],
    }


def run_cell(cell: Cell, protocol: Protocol, runs_dir: Path) -> dict:
    """Run one cell as a child process (its log in its run folder); its summary."""
    run_dir = runs_dir / cell.id
    rows, provenance = run_fedkey(cell.id, command(cell, protocol, run_dir), run_dir)
    return {"id": cell.id, **summarize(rows, cell), **provenance}


def select(only: list[str] | None = None) -> list[Cell]:
    """The matrix's cells whose id matches one of the `only` globs (all without)."""
    todo = cells()
    if only:
        todo = [c for c in todo if any(fnmatch.fnmatch(c.id, pat) for pat in only)]
        if not todo:
            ids = ", ".join(c.id for c in cells()[:3])
            raise ValueError(f"--only {' '.join(only)} matches no cell (cell ids look like {ids})")
    return todo


def run_attacks(
    out: Path,
    runs_dir: Path,
    protocol: Protocol,
    only: list[str] | None = None,
    jobs: int = 1,
    dry_run: bool = False,
    bench_command: str = "",
    progress: bool = True,
) -> list[dict]:
    """Run every selected cell not yet in OUT/results.json (same command), then the report."""
    from tqdm import tqdm

    bench = Bench(out)
    todo = bench.pending(
        select(only), lambda c: (c.id, command(c, protocol, runs_dir / c.id)), dry_run
    )
    if dry_run:
        return bench.read()
    bar = tqdm(total=len(todo), desc="bench attacks", unit="run", disable=not progress)
    failed: list[str] = []
    # Each cell is a child process: threads are enough to keep `jobs` of them going.
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        futures = {pool.submit(run_cell, c, protocol, runs_dir): c for c in todo}
        for future in as_completed(futures):
            bar.update()
            try:
                result = future.result()
            except RuntimeError as e:  # one failed cell does not stop the others
                failed.append(str(e))
                bar.write(f"failed: {e}")
                continue
            bench.add(result, bench_command)
            backdoor = result["backdoor_top1"]
            bar.write(
                f"{result['id']}: test ppl {result['final_test_ppl']:.5g}"
                + ("" if backdoor is None else f", backdoor top-1 {backdoor:.2f}")
                + f", {result['wall_seconds']:.0f} s"
            )
    bar.close()
    runs = bench.read()
    write_report(runs, out, bench.commands(), protocol)
    if failed:
        heads = "; ".join(f.splitlines()[0] for f in failed)
        raise RuntimeError(f"{len(failed)} cell(s) failed (their logs say why): {heads}")
    return runs
