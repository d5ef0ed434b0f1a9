"""The learning-rate page of `fedkey-bench paper` (learning-rates.md beside results.md): the
sweep's every knob per preset and dataset, and the confirm suite's check of its choices at full
length; and the helpers the pages share to name presets, datasets and epochs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.paper.presets import PRESETS
from fedkey_bench.paper.spec import RunSpec, command_flag
from fedkey_bench.paper.sweep import KNOBS, TASK_OF, sweep_epochs, sweep_suite
from fedkey_bench.paper.tables import NAMES, PARTITIONS, RUNS_CSV, Begun, _f, _where
from fedkey_bench.paper.variants import VARIANTS, variant_section

#: The ranking suites: the presets whose runs they hold rank the methods.
RANKING = ("sweep", "rank", "noniid")


def dataset_name(ds: str) -> str:
    """A dataset as the pages name it."""
    return NAMES.get(ds, ds)


def ranking_presets(runs: list[dict]) -> list[str]:
    """The ranking presets present, in PRESETS' order."""
    present = {r.get("preset") for r in runs if r["suite"] in RANKING}
    return [p for p in PRESETS if p in present]


def dealt_to_phones(dataset: str) -> str:
    """How a sweep's dataset is dealt to the phones (its task's partition; a real corpus's
    phones are its senders)."""
    task = TASK_OF.get(dataset)
    if task and task.real:
        return f"{task.clients:,} phones, one per sender"
    return PARTITIONS.get(task.partition if task else "iid", "")


def epochs_text(n: int) -> str:
    return f"{n} epoch" + ("" if n == 1 else "s")


def sweep_summary(runs: list[dict], choices: Mapping[str, Mapping[str, float]],
                  begun: Sequence[tuple[RunSpec, Sequence[float]]] = ()) -> str:  # fmt: skip
    """The sweep in one row per dataset and knob: the values tried, the one chosen (with the
    client lr of a joint knob's pair) and its best validation perplexity; every run is a row of
    runs.csv (its `group`: knob=value)."""
    header = ["dataset (phones)", "knob", "values tried", "chosen", "its best val ppl", "runs"]
    order = {k: i for i, k in enumerate(KNOBS)}
    cells: dict[tuple[str, str], dict] = {}
    for r in runs:
        knob, value = r["group"].split("=")
        cell = cells.setdefault((r["dataset"], knob), {"values": set(), "runs": 0, "begun": []})
        cell["values"].add(float(value))
        cell["runs"] += 1
        choice = choices.get(r["dataset"], {})
        key = KNOBS[knob].client_key if knob in KNOBS else ""
        client_lr = command_flag(r["command"], "--lr")
        if float(value) == choice.get(knob) and (
            not key or client_lr != "-" and float(client_lr) == choice.get(key)
        ):
            cell["chosen"] = f"{value}" + (f" (client lr {client_lr})" if key else "")
            cell["ppl"] = _f(r["best_val_ppl"])
    for spec, at in begun:
        knob, value = spec.group.split("=")
        cell = cells.setdefault((spec.dataset, knob), {"values": set(), "runs": 0, "begun": []})
        cell["values"].add(float(value))
        cell["begun"].append(f"{value} {_where(at[:2], spec.kind)}")
    rows = [[f"{dataset_name(ds)} ({dealt_to_phones(ds)})", knob.replace("_", " "),
             ", ".join(f"{v:g}" for v in sorted(c["values"])), c.get("chosen", "none yet"),
             c.get("ppl", "-"), str(c["runs"]) + "".join(f"; {b}" for b in c["begun"])]
            for (ds, knob), c in sorted(cells.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9)))]  # fmt: skip
    return markdown_table(header, rows)


#: The page beside results.md on the learning rates: the sweep's every knob and the confirm
#: suite's check of its choices at full length (results.md says what was chosen and links it).
LR_PAGE = "learning-rates.md"
LR_SUITES = ("sweep", "confirm")


def _chosen(choices: Mapping) -> str:
    return "; ".join(f"{dataset_name(d)}: " + ", ".join(f"{k.replace('_', ' ')} {v:g}"
                                                 for k, v in c.items())
                     for d, c in choices.items()) or "none yet"  # fmt: skip


def lr_stub(runs: list[dict], choices: Mapping) -> list[str]:
    """results.md's section on the learning rates: what was chosen, and where the rest is."""
    out = []
    for name in ranking_presets(runs):
        if not any(r.get("preset") == name and r["suite"] in LR_SUITES for r in runs):
            continue
        out += ["", f"## Learning rates, chosen on the validation set: preset `{name}`", "",
                f"Chosen by the sweep suite's short runs on validation perplexity (results.json, "
                f"lr_choices): {_chosen(choices.get(name, {}))}. Every value tried, and the "
                f"confirm suite's check of the choices at full length: [{LR_PAGE}]({LR_PAGE})."]  # fmt: skip
    return out


def lr_markdown(runs: list[dict], choices: Mapping, begun: Begun | None = None) -> str:
    """learning-rates.md: the sweep, then the confirm suite's rows, per preset."""
    out = ["# fedkey-bench paper: the learning rates, chosen on the validation set and checked",
           "", "How the learning rates of the ranking ([results.md](results.md)) were chosen, "
           f"and how well. Every run's figures and command: [`{RUNS_CSV}`]({RUNS_CSV})."]  # fmt: skip
    out += sweep_sections(runs, choices, begun)
    for name in ranking_presets(runs):
        for v in VARIANTS.values():
            if v.suite in LR_SUITES:
                out += variant_section(v, PRESETS[name], runs, begun)
    return "\n".join(out) + "\n"


def sweep_sections(runs: list[dict], choices: Mapping, begun: Begun | None = None) -> list[str]:
    out = []
    for name in ranking_presets(runs):
        sweep = [r for r in runs if r.get("preset") == name and r["suite"] == "sweep"]
        if not sweep:
            continue
        preset = PRESETS[name]
        stopped = [(s, at) for s in sweep_suite(preset, sweep)
                   if (at := (begun or {}).get(f"{name}/{s.id}"))]  # fmt: skip
        chosen = choices.get(name, {})
        out += [
            "",
            f"## Learning rates, chosen on the validation set: preset `{name}`",
            "",
            f'As Reddi et al. 2021 ("Adaptive Federated Optimization", Section 5, Appendix '
            f"D) choose theirs: short runs ({preset.sweep_rounds} rounds at C 0.1, all of "
            f"the data), the value with the lowest best validation perplexity: FedAvg's client "
            f"lr, the centralized model's lr ({epochs_text(sweep_epochs(preset))}: as many "
            f"examples), the server lr of FedAvgM (momentum 0.9) and of FedAdam (beta1 0.9, "
            f"beta2 0.99, tau 1e-3), each jointly with the client lr (a pair is chosen), and at "
            f"FedAvg's client lr the server step epsilon of FedAtt and of FedAttOpt (the papers' "
            f"1.2 was tuned for client lr 0.01). A best value at the grid's edge adds one more step "
            f"past it (twice at most; per client lr for the pairs). Test perplexity is never "
            f"read. Every method uses its dataset's chosen values (WikiText-2 by article: the "
            f"IID sweep's). Chosen (results.json, lr_choices): {_chosen(chosen)}.",
            "",
            sweep_summary(sweep, chosen, stopped),
            "",
            f"Every sweep run's best validation perplexity and round: [`{RUNS_CSV}`]({RUNS_CSV}) "
            "(suite `sweep`; its `group` is the knob and value, its command the client lr).",
        ]
        last = sum(r["best_round"] == r["rounds"] for r in sweep)
        if last:
            out += ["", f"{last} of {len(sweep)} sweep runs were still improving at their last "
                    f"round: {preset.sweep_rounds} rounds rank the learning rates by early "
                    "progress, which favours the larger ones (a chosen lr that diverges later "
                    "shows in the rank suite's curves)."]  # fmt: skip
    return out
