"""The page of `fedkey-bench peers` (fedkey_bench.peers.runner): one table first, per workload the
seconds a round (median of the repeats, their spread) and the CPU seconds a round of fedkey, pfl
and Flower, and fedkey's speed against pfl's; then per workload each framework's row against
fedkey's (void where its perplexity disagrees) and how it was run; rebuilt from results.json
alone: `python -m fedkey_bench.peers.report experiments/results/peers`."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from fedkey_bench.common.checkout import RESULTS, shown, shown_path

#: The frameworks compared, fedkey first (the reference of every ratio).
FRAMEWORKS = ("fedkey", "flower", "pfl")
#: Final test perplexities within this share of fedkey's: the same computation (the runs train
#: the same cohorts on batches in the same order; they differ in float rounding, and pfl in its
#: own local loop). Past it the speed comparison of that row is void.
TOLERANCE = 0.05


def agreement(rows: list[dict], tolerance: float = TOLERANCE) -> dict[str, str]:
    """Per framework of one workload's rows: 'reference' (fedkey), 'agrees' (final test
    perplexity within `tolerance` of fedkey's), 'void' (past it: that row's speed comparison
    says nothing), or 'no result'."""
    ref = next((r["final_test_ppl"] for r in rows if r["framework"] == "fedkey"), None)
    verdicts = {}
    for r in rows:
        ppl = r.get("final_test_ppl")
        if r["framework"] == "fedkey":
            verdicts[r["framework"]] = "reference" if ppl is not None else "no result"
        elif ppl is None or ref is None or not math.isfinite(ppl):
            verdicts[r["framework"]] = "no result"
        else:
            verdicts[r["framework"]] = "agrees" if abs(ppl / ref - 1) <= tolerance else "void"
    return verdicts


#: The lead table's frameworks, in its order.
LEAD = ("fedkey", "pfl", "flower")


def _seconds(row: dict | None, key: str = "seconds_per_round") -> str:
    """A row's median seconds with their spread, "2.13 (2.05-2.30)"; "-" without a figure."""
    if row is None or row.get(key) is None:
        return "-" if row is None or not row.get("error") else "failed"
    spread = row.get(f"{key}_spread")
    if spread and len(spread) == 2 and spread[0] != spread[1]:
        return f"{row[key]:.2f} ({spread[0]:.2f}-{spread[1]:.2f})"
    return f"{row[key]:.2f}"


def speed_ratio(fedkey: dict | None, other: dict | None) -> str:
    """fedkey's speed over another framework's: its s/round over fedkey's (above 1: fedkey is
    faster), "(tie)" where their spreads overlap, "(void)" where its perplexity disagrees."""
    if not fedkey or not other:
        return "-"
    a, b = fedkey.get("seconds_per_round"), other.get("seconds_per_round")
    if not a or not b:
        return "-"
    cell = f"{b / a:.2f}x"
    sa, sb = fedkey.get("seconds_per_round_spread"), other.get("seconds_per_round_spread")
    if sa and sb and sa[0] <= sb[1] and sb[0] <= sa[1]:
        cell += " (tie: the spreads overlap)"
    ref, ppl = fedkey.get("final_test_ppl"), other.get("final_test_ppl")
    if ref and ppl is not None and math.isfinite(ppl) and abs(ppl / ref - 1) > TOLERANCE:
        cell += " (void: perplexity disagrees)"
    return cell


def lead_table(data: dict) -> str:
    """The page's first table: one line per workload (the latest first), the median s/round
    (spread) and CPU s/round of fedkey, pfl and Flower, and fedkey's speed over pfl's."""
    lines = ["| workload | repeats | s/round: fedkey | pfl | flower | CPU s/round: fedkey | pfl "
             "| flower | fedkey's speed / pfl's |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, meta in reversed(data["workloads"].items()):
        rows = {r["framework"]: r for r in data["rows"] if r["workload"] == name}
        cells = [name, str(meta.get("repeats", "-"))]
        cells += [_seconds(rows.get(f)) for f in LEAD]
        cells += [_seconds(rows.get(f), "cpu_seconds_per_round") for f in LEAD]
        cells.append(speed_ratio(rows.get("fedkey"), rows.get("pfl")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict], tolerance: float = TOLERANCE) -> str:
    """The page's table: one line per framework of one workload, fedkey first."""
    order = {f: i for i, f in enumerate(FRAMEWORKS)}
    rows = sorted(rows, key=lambda r: order.get(r["framework"], len(order)))
    ref = next((r for r in rows if r["framework"] == "fedkey"), None)
    verdicts = agreement(rows, tolerance)
    lines = ["| framework | version | precision | s/round (spread) | CPU s/round | ratio to fedkey "
             "| final test ppl | peak RSS |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        s = r.get("seconds_per_round")
        ratio = "-"
        if s is not None and ref and ref.get("seconds_per_round"):
            ratio = f"{s / ref['seconds_per_round']:.2f}x"
            if verdicts[r["framework"]] == "void":
                ratio += " (void: perplexity disagrees)"
        ppl = r.get("final_test_ppl")
        ppl_cell = "-" if ppl is None else f"{ppl:.2f}"
        if ppl is not None and ref and ref.get("final_test_ppl") and r is not ref:
            ppl_cell += f" ({ppl / ref['final_test_ppl'] - 1:+.1%})"
        cells = [r["framework"], r.get("version") or "-", r.get("precision") or "fp32",
                 _seconds(r), _seconds(r, "cpu_seconds_per_round"), ratio, ppl_cell,
                 "-" if r.get("peak_rss_mb") is None else f"{r['peak_rss_mb']:.0f} MB"]  # fmt: skip
        if r.get("error"):
            cells[3] = f"not run: {r['error']}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def page(data: dict) -> str:
    """results.md: the lead table, then per workload its table and how it was run."""
    parts = ["# fedkey against Flower and pfl-research: the same workload in three frameworks", "",
             lead_table(data), "",
             "Seconds a round: the median of the repeats (min-max across them), each repeat's "
             "the mean wall time of its steady rounds (2..R); CPU seconds a round: the whole "
             "process tree's (every worker, actor and helper process), user and system, over "
             "the same rounds, so on 2 cores up to twice the wall time. fedkey's speed / pfl's: "
             "pfl's s/round over fedkey's (above 1: fedkey is faster). Every framework trains "
             "the same phones each round (fedkey's own selection, checked against its metrics "
             "rows) on the same shards from the same weights; the figures, every repeat's and "
             "its perplexity curve, are in [results.json](results.json).", ""]  # fmt: skip
    for name, meta in reversed(data["workloads"].items()):  # the latest first
        rows = [r for r in data["rows"] if r["workload"] == name]
        verdicts = agreement(rows)
        parts += [f"## {name}", "", table(rows), ""]
        void = [f for f, v in verdicts.items() if v == "void"]
        if void:
            parts += [f"**Void:** {', '.join(void)}: the final test perplexity differs from "
                      f"fedkey's by more than {TOLERANCE:.0%}, so the run did not compute the "
                      "same thing and its speed says nothing.", ""]  # fmt: skip
        swing = final_swing(next((r["test_ppl"] for r in rows if r["framework"] == "fedkey"), []))
        if swing > TOLERANCE:
            parts += [f"**Weak check:** fedkey's own test perplexity still jumps back up by up "
                      f"to {swing:.0%} from one round to the next in the run's second half, more "
                      "than the tolerance: the final rounds agreeing says little here (see the "
                      "curves).", ""]  # fmt: skip
        parts += [_how(meta, rows), ""]
    parts += [METHOD, ""]
    return "\n".join(parts)


def final_swing(curve: list[float]) -> float:
    """The largest rise of the test perplexity from one round to the next in the second half of
    the run (0 for a curve that only falls there): a curve that still jumps back up by more than
    the tolerance carries more noise than the check allows, so its final round agreeing with
    another run's says little."""
    tail = curve[len(curve) // 2 :]
    return max((max(0.0, b / a - 1) for a, b in zip(tail, tail[1:], strict=False)), default=0.0)


def _population(meta: dict) -> str:
    """Whose text the phones hold, in words (a row written before `partition` existed: PTB)."""
    corpus = Path(meta["data"]).name
    if meta.get("partition", "iid") == "user":
        return (f"{corpus}: one phone per speaker, the {meta['clients']} with the most training "
                "messages, all of their training messages")  # fmt: skip
    cut = meta.get("max_train_tokens")
    words = f"first {cut:,} training words" if cut else "training split"
    return f"{corpus.upper()}'s {words}, IID over {meta['clients']} phones"


def _held_out(meta: dict) -> str:
    if meta.get("partition", "iid") == "user":
        return "held-out messages (the first of those the phones' speakers wrote)"
    return "sentences"


def _unseen(meta: dict) -> str:
    n = meta.get("unseen_sentences")
    if not n:
        return ""
    return (f", and on {n} messages of speakers who never trained (as fedkey's server scores "
            "them on such a corpus)")  # fmt: skip


def _how(meta: dict, rows: list[dict]) -> str:
    init = ", ".join(f"{r['framework']} {r['initial_test_ppl']:.2f}" for r in rows
                     if r.get("initial_test_ppl") is not None)  # fmt: skip
    lines = [
        f"{_population(meta)} ({meta['train_sentences']:,} sentences, {meta['train_words']:,} "
        f"predicted words), vocabulary {meta['vocab_size']:,} (the training split's most "
        f"frequent words); a 1-layer GRU of {meta['hidden_size']} units with "
        f"tied embeddings; C {meta['fraction']}, E {meta['local_epochs']}, B "
        f"{meta['batch_size']}, local SGD lr {meta['lr']} momentum {meta['momentum']} clip "
        f"{meta['clip']}; {meta['rounds']} rounds; validation and test perplexity on "
        f"{meta['max_eval_sentences']} {_held_out(meta)} each after every round{_unseen(meta)}; "
        f"{meta['workers']} "
        "workers (fedkey's training processes, Flower's Ray actors, pfl's torchrun workers), "
        "one torch thread each.",
        "",
        f"Run by `{shown(meta['bench_command'])}` on {meta['device']}, commit "
        f"{str(meta['git_commit'])[:10]} ({meta['date']}), fedkey from "
        f"{shown_path(meta['fedkey_tree'])}; "
        f"{meta['repeats']} repeat(s), interleaved; a row's figures are the medians of its "
        "repeats, every repeat's figures and test perplexity after every round beside them in "
        f"[results.json](results.json). {_cohorts(meta)}",
        "",
        f"The initial model's test perplexity, the same weights on the same sentences: {init}.",
        "",
        "| framework | s/round: training | s/round: the rest | final test ppl per repeat "
        "| first round s | wall s | peak PSS | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['framework']} | - | - | - | - | - | {r['error']} | "
                         f"`{shown(r['command'])}` |")  # fmt: skip
            continue
        pss = r.get("peak_pss_mb")
        ppl = [p.get("final_test_ppl") for p in r.get("per_repeat", [])] or [r["final_test_ppl"]]
        lines.append(f"| {r['framework']} | {r['train_s']:.2f} | {r['eval_s']:.2f} | "
                     f"{', '.join(f'{p:.2f}' for p in ppl if p is not None)} | "
                     f"{r['first_round_s']:.2f} | {r['wall_s']:.1f} | "
                     f"{'-' if pss is None else f'{pss:.0f} MB'} | `{shown(r['command'])}` |")  # fmt: skip
    return "\n".join(lines)


def _cohorts(meta: dict) -> str:
    """How the rounds' cohorts were chosen (a workload recorded before they were shared: each
    framework drew its own)."""
    if meta.get("cohort_seed") is None:
        return "Each framework drew its own cohorts (recorded before the cohorts were shared)."
    return (f"Every framework trained the same {meta.get('cohort_size', '')} phones each round: "
            f"fedkey's selection with seed {meta['cohort_seed']}, checked against fedkey's "
            "metrics rows, each phone on batches in fedkey's order of that round.")  # fmt: skip


METHOD = "\n".join(
    [
        "## How it was run",
        "",
        "Every framework reads one .npz written by fedkey's own corpus and partition code (each "
        "phone's encoded sentences, the held-out sentences) with fedkey's round-0 weights in it, "
        "so all three start from the same model on the same shards. The .npz also carries each "
        "round's cohort, drawn by fedkey's own selection code (fedkey.federation.plan."
        "choose_cohort: without DP, from the seed and the round), and each phone's training seed "
        "of that round: Flower's server sends exactly those phones (a FedAvg whose "
        "configure_train hands each to one of the round's SuperNodes), pfl's user sampler yields "
        "them in order, and each trains on its sentences in the order fedkey's trainer takes "
        "them. After fedkey's run the bench checks that its metrics rows selected that list, and "
        "each peer reports the phones it trained: a mismatch fails the row. The peers' model, "
        "local loop and perplexity mirror fedkey's line for line "
        "(experiments/peers/workload.py); pfl trains with its own local loop "
        "(PyTorchModel.do_multiple_epochs_of) on that model's loss. FedAvg weighs each phone by "
        "the words it predicts in all three (pfl: a WeightingStrategy); pfl also knows each "
        "phone's words when it splits a cohort between its workers (user_id_to_weight), and "
        "Flower keeps one model per Ray actor, loading each phone's round weights into it.",
        "",
        "s/round: per repeat the mean wall time of rounds 2..R, each from the end of the "
        "previous round's "
        "evaluation to the end of its own (training, aggregation, evaluation); round 1 also pays "
        "for starting the workers (first round s), and wall s adds the start-up (imports, "
        "reading the data, Ray). fedkey's round ends are when its metrics rows appear; the "
        "peers' are timed in the script. Training: the part of a round before its evaluation "
        "(local training, shipping, aggregation; fedkey's rows' own `seconds`); the rest: the "
        "validation and test scoring, and whatever else the framework does between rounds "
        "(fedkey: its top-1/top-3 counts, checkpoint and metrics row). fedkey and Flower score "
        "in their server process, pfl splits the scoring across its workers (its central "
        "evaluation). Peak RSS: the largest sum of VmRSS over the framework's "
        "process and every descendant (Ray's raylet, GCS and workers; torchrun's workers), "
        "sampled every 0.2 s; PSS counts a page that processes share once. CPU s/round: the "
        "user and system seconds of the same process tree (/proc/<pid>/stat, with the reaped "
        "children's), sampled with the memory, between the end of round 1 and the end of round "
        "R, over R - 1 (the round ends placed on the samples' clock: fedkey's metrics rows' "
        "arrival, the peers' wall-clock round ends). "
        f"A row whose final test perplexity is more than {TOLERANCE:.0%} from fedkey's is "
        "void: it did not compute the same thing.",
        "",
        "The runs take the machine as they find it: where other work shares its cores (this "
        "bench runs well under `nice`), a framework's s/round moves by tens of percent from one "
        "repeat to the next (the spread beside each median), and ratios within that spread are "
        "ties. "
        "The repeats are interleaved so that such load weighs on every framework alike.",
        "",
        "Precision: fp32 unless a row says bf16 (`--precision bf16`: fedkey's own bf16, the "
        "peers' model forward under torch.autocast bf16), which is only measured where the CPU "
        "does bf16 natively. Not measured here: a GPU (every run is on the CPU), larger models. Running a workload's command again replaces its rows; "
        "`python -m fedkey_bench.peers.report experiments/results/peers` rebuilds this page "
        "from results.json.",
    ]
)


def rebuild(out: Path) -> None:
    """OUT/results.md from OUT/results.json."""
    data = json.loads((out / "results.json").read_text())
    (out / "results.md").write_text(page(data))


if __name__ == "__main__":
    rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "peers")
