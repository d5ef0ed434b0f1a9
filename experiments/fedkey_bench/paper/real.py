"""The real-typing tables of `fedkey-bench paper`: keyboard quality on
text people typed, measured as production measures it; its summary leads results.md, every row
is on real-typing.md beside it.

One row per run of the real suite (fedkey_bench.paper.real_suite): NUS SMS and the Ubuntu IRC
population, one phone per sender; perplexity, top-1, top-3 (as the suggestion bar ranks) and
keystroke savings on the phones' own later messages (the test split of the senders who have a
phone) and on the messages of held-out senders who never trained (the unseen_* fields), each of
the best-validation model; top-1 against the Kneser-Ney 3-gram's on the same phones' text (the
target: at least 1.25x, for the best federated method and for FedAtt). A run not done, or
stopped at a time limit, says so. Written from results.json's objects alone.
"""

from __future__ import annotations

import math
from pathlib import Path

from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.paper.presets import PRESETS
from fedkey_bench.paper.real_suite import (
    LR_FLOOR,
    REAL,
    REAL_AS_MANY,
    REAL_COHORTS,
    REAL_DECAYED,
    REAL_GROUP,
    STEP_LOWER_GROUP,
    SWEPT_GROUP,
    planned_rates,
    real_suite,
)
from fedkey_bench.paper.spec import command_flag
from fedkey_bench.paper.sweep import REAL_EVAL
from fedkey_bench.paper.tables import NAMES, Begun, _f, _key, _where, _x

#: The real-typing target: top-1 at least this many times the 3-gram's.
TOP1_VS_NGRAM = 1.25


def _swept(run: dict, spec) -> bool:
    """Whether a row ran at rates the sweep chose: recorded so, or at the very rates the plan
    now takes from the sweep (a row run before the sweep chose what it had run at)."""
    if run.get("group") == SWEPT_GROUP:
        return True
    return spec.group == SWEPT_GROUP and planned_rates(run, spec)


def _note(run: dict, spec) -> str:
    """What the table says of where a row's rates came from: the sweep, one step below it."""
    if _swept(run, spec):
        return " (swept)"
    return " (one step lower)" if spec.group == STEP_LOWER_GROUP else ""


def _lr(run: dict, note: str) -> str:
    """The learning rates a row ran at, from its command: the local one, and the server's."""
    cmd = run.get("command", "")
    server = command_flag(cmd, "--server-lr")
    step = command_flag(cmd, "--epsilon")
    out = f"lr {command_flag(cmd, '--lr')}" if run["kind"] != "ngram" else "-"
    if server != "-":
        out += f", server lr {server}"
    if step != "-":
        out += f", step {step}"
    return out + note


def _rounds(run: dict, planned_rounds: int) -> str:
    """Best round / rounds run, and a note where a row ran fewer than its suite plans."""
    if run["kind"] == "ngram":
        return "-"
    text = f"{run['best_round']} / {run['rounds']}"
    planned = planned_rounds if run["kind"] == "federated" else None
    if planned is not None and run["rounds"] < planned:
        text += f" (of {planned} planned)"
    return text


#: The page beside results.md with the real suite's every row (results.md leads with a summary).
REAL_PAGE = "real-typing.md"
#: How the table ranks a next word: as the suggestion bar shows them (no </s>, <unk>), what
#: production keyboards report as top-k recall; runs from before the bar's fields have none.
BAR = "top-1 and top-3: the suggestion bar's ranking (never </s> or <unk>)"


def _ngram(runs: dict, specs: list) -> dict:
    """The 3-gram's run of a task ({} where it has none yet)."""
    return next((runs[s.id] for s in specs if s.kind == "ngram" and s.id in runs), {})


def _phones(task, fraction: float | None) -> str:
    """The text, its phones and how many train a round at C `fraction` (None: AdaFL's own)."""
    if fraction is None:
        return f"{NAMES[task.dataset]} ({task.clients} phones, AdaFL's C: 0.1 rising to 0.5)"
    return (f"{NAMES[task.dataset]} ({task.clients} phones, C {fraction:g}: "
            f"{round(task.clients * fraction)} a round)")  # fmt: skip


def _mine(runs: list[dict], preset: str) -> dict:
    return {r["id"]: r for r in runs if r.get("preset") == preset and r["suite"] == "real"}


def real_rows(runs: list[dict], preset: str = "cpu") -> list[list]:
    """The table's rows: per REAL task, its done runs in the suite's order (the 3-gram first)."""
    p = PRESETS[preset]
    mine = _mine(runs, preset)
    suite = real_suite(p, runs)
    rows: list[list] = []
    for task, fraction in REAL:
        specs = [s for s in suite if s.dataset == task.dataset]
        ngram = _ngram(mine, specs)
        for s in specs:
            r = mine.get(s.id)
            if r is None:
                continue
            fed = r["kind"] != "ngram"
            rows.append([
                _phones(task, fraction if s.kind == "ngram" else s.fraction), r["method"], _rounds(r, s.rounds or p.rounds), _lr(r, _note(r, s)), _f(r["best_val_ppl"]),
                _f(r["test_ppl"]), _f(r.get("bar_top1"), ".3f"), _f(r.get("bar_top3"), ".3f"),
                _f(r.get("ksr"), ".3f"),
                _x(r.get("bar_top1"), ngram.get("bar_top1")) if fed else "-",
                _f(r.get("unseen_test_ppl")), _f(r.get("unseen_bar_top1"), ".3f"),
                _f(r.get("unseen_bar_top3"), ".3f"), _f(r.get("unseen_ksr"), ".3f"),
                _x(r.get("unseen_bar_top1"), ngram.get("unseen_bar_top1")) if fed else "-",
                _f(r.get("top1"), ".3f"), _f(r.get("unseen_top1"), ".3f"),
            ])  # fmt: skip
    return rows


def real_summary(runs: list[dict], preset: str = "cpu") -> list[list]:
    """results.md's answer on real typing, a row per REAL task with a run: the 3-gram's and the
    centralized model's top-1, the best federated run's and FedAtt's, each against the
    3-gram's, and the best federated perplexity against the centralized; of the runs at the
    task's C or as many phones in all (the other cohort sizes and AdaFL's are on REAL_PAGE).
    The best federated run and the centralized one: those of lowest validation perplexity
    (dropout and a step lower among them)."""
    p = PRESETS[preset]
    mine = _mine(runs, preset)
    suite = real_suite(p, runs)
    rows: list[list] = []
    for task, fraction in REAL:
        specs = [s for s in suite if s.dataset == task.dataset
                 and _as_many_examples(s, fraction, p.rounds)]  # fmt: skip
        done = [mine[s.id] for s in specs if s.id in mine]
        if not done:
            continue
        ngram = _ngram(mine, specs)
        central = _best_on_validation([r for r in done if r["kind"] == "central"])
        fed = [r for r in done if r["kind"] == "federated"]
        best = _best_on_validation(fed)
        att: dict = next((r for r in fed if r["method"] == "FedAtt"), {})
        gap = (f"{best['test_ppl'] / central['test_ppl'] - 1:+.1%}"
               if best and central else "-")  # fmt: skip
        rows.append([
            _phones(task, fraction), _f(ngram.get("bar_top1"), ".3f"), _f(central.get("bar_top1"), ".3f"),
            _label(task, best, fraction), _f(best.get("bar_top1"), ".3f"),
            _x(best.get("bar_top1"), ngram.get("bar_top1")), _f(att.get("bar_top1"), ".3f"),
            _x(att.get("bar_top1"), ngram.get("bar_top1")), _f(best.get("test_ppl")),
            _f(central.get("test_ppl")), gap, f"{len(fed)} of {sum(s.kind == 'federated' for s in specs)}",
        ])  # fmt: skip
    return rows


def _label(task, run: dict, fraction: float) -> str:
    """A run's method, and its phones a round where not the task's ("-" for no run)."""
    if not run:
        return "-"
    return run["method"] + _cohort(task, run["fraction"], fraction)


def _as_many_examples(spec, fraction: float, rounds: int) -> bool:
    """Whether a row trains as many phones in all as one at C `fraction` for `rounds` rounds
    (the 3-gram: yes; AdaFL's own rising C: no)."""
    if spec.kind == "ngram":
        return True
    if spec.fraction is None:
        return False
    return math.isclose((spec.rounds or rounds) * spec.fraction, rounds * fraction)


def _best_on_validation(runs: list[dict]) -> dict:
    """The run of lowest best validation perplexity ({} where none): a row is chosen as its
    learning rates were, never by its test perplexity."""
    return min(runs, key=lambda r: _key(r["best_val_ppl"]), default={})


def real_waiting(runs: list[dict], preset: str = "cpu", begun: Begun | None = None) -> str:
    """The real suite's runs not done, per task: "not run yet", how far one stopped got, or
    that a row ran at other rates than the sweep has since chosen (to run again)."""
    begun = begun or {}
    done = {r["id"]: r for r in runs if r.get("preset") == preset and r["suite"] == "real"}
    suite = real_suite(PRESETS[preset], runs)
    parts = []
    for task, fraction in REAL:
        left = [f"{s.method}{_cohort(task, s.fraction, fraction)}{_step(s)} "
                f"({_where(begun.get(f'{preset}/{s.id}'), s.kind) if s.id not in done else AGAIN})"
                for s in suite if s.dataset == task.dataset
                and (s.id not in done or not planned_rates(done[s.id], s))]  # fmt: skip
        if left:
            parts.append(f"{NAMES[task.dataset]}: {'; '.join(left)}")
    return ("Not done: " + ". ".join(parts) + ".") if parts else "Every run of the suite is done."


#: How the not-done line names a row that ran at rates the sweep did not choose.
AGAIN = "to run again at the rates the sweep chose; the table shows the rates it ran at"


def _step(spec) -> str:
    """The label of a row one grid step below the sweep's choice (", server lr 0.3"), else
    nothing."""
    if spec.group != STEP_LOWER_GROUP:
        return ""
    server = command_flag(" ".join(spec.args), "--server-lr")  # a server optimizer's step
    return f", server lr {server}" if server != "-" else f", lr {spec.lr:g}"


def _cohort(task, c: float | None, usual: float) -> str:
    """The label of a run at another C than its task's (", N a round"), else nothing."""
    return "" if c is None or c == usual else f", {round(task.clients * c)} a round"


def _cohorts_note() -> str:
    """What the rows at other cohort sizes (REAL_COHORTS, REAL_AS_MANY, REAL_DECAYED) are."""
    parts = []
    for task, fraction in REAL:
        if cs := REAL_COHORTS.get(task.dataset):
            sizes = " and ".join(f"{round(task.clients * c):,} (C {c:g})" for c in cs)
            parts.append(f"{NAMES[task.dataset]}'s FedAvg also trains {sizes} phones a round, "
                          f"at the same lr and rounds as at C {fraction:g}")  # fmt: skip
        if cs := REAL_AS_MANY.get(task.dataset):
            sizes = " and ".join(f"{round(task.clients * c):,}" for c in cs)
            parts.append(
                f"{NAMES[task.dataset]}'s FedAvg also trains {sizes} phones a round "
                f"for as many fewer or more rounds (as many examples as at C {fraction:g})"
            )
        if task.dataset in REAL_DECAYED:
            parts.append(_decayed_note(task))
    if not parts:
        return ""
    return (
        "; ".join(parts)
        + ": how the cohort's size moves it. results.md sums up the runs at the task's C or "
        "with as many examples (not the others, nor AdaFL's, whose C rises from 0.1 to 0.5)."
    )


def _decayed_note(task) -> str:
    """What a task's rows with the lr decayed (REAL_DECAYED) are."""
    sizes = " and ".join(f"{round(task.clients * c):,}" for c in REAL_DECAYED[task.dataset])
    fedavg = f", and its FedAvg at {sizes} a round to {LR_FLOOR:g}x by its last round"
    return (f"{NAMES[task.dataset]}'s centralized model trains again with its lr falling "
            f"{1 / LR_FLOOR:g}-fold over its epochs (stepped per epoch)"
            f"{fedavg if sizes else ''} (marked lr decayed)")  # fmt: skip


#: The x axis of the real suite's figures.
PHONES_TRAINED = "phones trained in all (one pass over a phone's text each)"
#: Their y axis's top: the first rounds' perplexity (10,000) would flatten where runs differ.
REAL_CURVE_TOP = 400.0


def real_curve_top(curves: list[dict]) -> float:
    """A figure's y axis top: REAL_CURVE_TOP, or higher where a run's line (its curve's test
    perplexity) ends above it (IRC's 1,000 phones a round for 5 rounds: 566), so that every
    line in the legend shows its end."""
    ends = [r["curve"][-1][2] for r in curves if r["curve"]]
    return max([REAL_CURVE_TOP, *(1.2 * e for e in ends if e is not None)])


def real_curves(runs: list[dict], preset: str = "cpu") -> dict[str, list[dict]]:
    """Per REAL task (its dataset): FedAvg at every cohort size and the centralized model (no
    dropout, no step lower), each with its curve's rounds as the phones trained so far (a
    federated round trains clients x C phones, a centralized epoch every phone once), so that
    runs at different cohort sizes meet where they have seen as many examples; each named in
    the legend by its phones a round and rounds (and "lr decayed" where it is)."""
    mine = _mine(runs, preset)
    suite = real_suite(PRESETS[preset], runs)
    preset_rounds = PRESETS[preset].rounds
    out: dict[str, list[dict]] = {}
    for task, _ in REAL:
        specs = [s for s in suite if s.dataset == task.dataset
                 and s.group != STEP_LOWER_GROUP and "--dropout" not in s.args and s.id in mine
                 and (s.kind == "central" or s.method.split(",")[0] == "FedAvg")]  # fmt: skip
        for s in specs:  # a centralized epoch trains every phone once (its C is the task's)
            r = mine[s.id]
            per_step = task.clients * ((s.fraction or 1.0) if s.kind == "federated" else 1.0)
            curve = [[step * per_step, *rest] for step, *rest in r["curve"]]
            label = (s.method.split(" (")[0] if s.kind == "central" else
                     f"FedAvg, {round(task.clients * (s.fraction or 1.0)):,} a round x "
                     f"{s.rounds or preset_rounds} rounds")  # fmt: skip
            label += ", lr decayed" if "--lr-decay" in s.args else ""
            out.setdefault(task.dataset, []).append({**r, "curve": curve, "label": label})
    return out


def _presets(runs: list[dict]) -> list[str]:
    return [p for p in PRESETS if any(r.get("preset") == p and r["suite"] == "real"
                                      for r in runs)]  # fmt: skip


def real_section(runs: list[dict], begun: Begun | None = None) -> list[str]:
    """results.md's lines on real typing: the summary per preset, and a link to REAL_PAGE
    (nothing where no preset has a real run)."""
    out: list[str] = []
    for preset in _presets(runs):
        header = ["text (phones)", "3-gram top-1", "centralized top-1", "best federated",
                  "its top-1", "vs 3-gram", "FedAtt top-1", "FedAtt vs 3-gram",
                  "best federated test ppl", "centralized test ppl", "vs centralized",
                  "federated runs"]  # fmt: skip
        out += [
            f"### Real typing (preset `{preset}`, suite `real`): keyboard quality on text people "
            "typed",
            "",
            markdown_table(header, real_summary(runs, preset)),
            "",
            f"On the phones' later messages; {BAR}. Best federated: the federated run of lowest "
            "validation perplexity; centralized: the model that saw as many examples (of its "
            "runs, the one of lowest validation perplexity). Target: "
            f"top-1 at least {TOP1_VS_NGRAM:g}x the Kneser-Ney 3-gram's, for the best "
            "federated method and for FedAtt. Every row, on the senders who never trained too: "
            f"[{REAL_PAGE}]({REAL_PAGE}). {real_waiting(runs, preset, begun)}",
            "",
        ]
    return out


def real_markdown(
    runs: list[dict], begun: Begun | None = None, plots: dict[str, Path] | None = None
) -> str:
    """REAL_PAGE: every row of the real suite per preset, how they were scored, and its figures
    (`plots`: "real:<preset>:<dataset>" -> a figure of real_curves)."""
    out = ["# fedkey-bench paper: keyboard quality on text people typed", "",
           "How well each method's model suggests the next word on real people's messages "
           "(NUS SMS, the Ubuntu IRC population), against the Kneser-Ney 3-gram a keyboard would "
           "otherwise ship and the centralized model that saw as many examples. Target: "
           f"top-1 at least {TOP1_VS_NGRAM:g}x the 3-gram's, for the best federated method "
           "and for FedAtt. The summary, and the seed papers' reproduction: "
           "[results.md](results.md). Every run's figures and command: [`runs.csv`](runs.csv), "
           "[`results.json`](results.json)."]  # fmt: skip
    header = ["text (phones)", "method", "best round / rounds", "learning rates", "val ppl",
              "test ppl", "top-1", "top-3", "KSR", "top-1 vs 3-gram", "unseen ppl",
              "unseen top-1", "unseen top-3", "unseen KSR", "unseen top-1 vs 3-gram",
              "top-1, model's ranking", "unseen top-1, model's ranking"]  # fmt: skip
    for preset in _presets(runs):
        out += [
            "", f"## Preset `{preset}`", "",
            markdown_table(header, real_rows(runs, preset)), "",
            real_waiting(runs, preset, begun), "",
            "One phone per sender; each sender's messages in time order, the first 80% train, "
            "the next 10% validate, the last 10% test; 10% of the senders never train. test, "
            "top-1, top-3, KSR: on the phones' later messages; unseen: on the never-trained "
            f"senders' messages; of the best-validation model. {BAR}, what production "
            "keyboards report as top-k recall (Hard et al. 2018); the model's ranking counts "
            "</s> or <unk> as its first guess where it is likeliest (the other tables' top-1). "
            "KSR: keystroke savings with a 3-slot bar, first 100 messages. Vocabulary: 10k "
            "words of the training messages. Validation, test and unseen: the first "
            f"{REAL_EVAL:,} messages each (senders interleaved). Learning rates: {REAL_GROUP}, "
            "or, marked (swept), chosen by the sweep on the corpus's validation set; marked (one "
            "step lower), a swept row again one grid step below the sweep's choice, and lower "
            "again while that wins on validation (10-round sweeps favour large rates). "
            "The 3-gram and the centralized model (as many examples) train on the same phones' "
            f"text. {_cohorts_note()}",
        ]  # fmt: skip
        figures = [p for k, p in (plots or {}).items() if k.startswith(f"real:{preset}:")]
        if figures:
            out += ["", "FedAvg at each cohort size against the centralized model, by the "
                    "phones trained so far (test perplexity; a smaller cohort takes more rounds "
                    "to as many examples):", ""]  # fmt: skip
            out += [f"![{p.stem}]({p.name})" for p in figures]
    return "\n".join(out) + "\n"
