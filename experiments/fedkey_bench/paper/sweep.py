"""The learning-rate sweep of `fedkey-bench paper` (its `sweep` suite) and the choices it makes.

The learning rates are chosen on the VALIDATION set only with short runs, as Reddi et al. 2021
("Adaptive Federated Optimization", Section 5, Appendix D) tune theirs: FedAvg's client lr over a
grid; the centralized model's lr over the same grid (as many examples as the FedAvg runs); the
server lr of FedAvgM and of FedAdam jointly with the client lr (a 2-D grid, as Reddi et al. tune
each server optimizer); and, at FedAvg's client lr, the server step epsilon of FedAtt (Ji et al.
2019, eq. 4) and of FedAttOpt (Jiang et al. 2020, eq. 7). A best value at the grid's edge
extends the grid by one step (twice at most). The other ranking suites (fedkey_bench.paper.suites) run
at the values chosen here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedkey_bench.paper.presets import Preset
from fedkey_bench.paper.spec import RunSpec, command_flag

#: The demo corpus's owners: one phone each (--partition user).
DEMO_OWNERS = 22


@dataclass(frozen=True)
class Knob:
    """One value the sweep chooses: its runs are `flags` plus `flag` set to each grid value (the
    client lr's runs set --lr itself; the others run at the chosen client lr, or, for a joint
    knob, at each client lr of the grid)."""

    label: str
    flags: tuple[str, ...]
    flag: str
    grid: str  # the Preset field that holds its grid
    # A joint knob is swept with the client lr (a 2-D grid); lr_choices keeps the client lr of
    # its chosen pair under this key.
    client_key: str = ""
    kind: str = "federated"  # "central": the centralized model's own lr (fedkey train-central)


#: The sweep's knobs, in the order it decides them (the client lr first: the others run at it,
#: the centralized model's own lr aside).
#: FedAtt's and FedAttOpt's epsilon is their server step: the published 1.2 is tuned for the
#: papers' client lr 0.01, and at a larger one FedAtt's softmax of distances gives one phone
#: nearly all the weight (rank-ptb-fedatt at lr 3 and epsilon 1.2 never left perplexity 1e6-1e10)
#: while FedAttOpt's step, epsilon / d_k^2 of each delta, barely moves (its validation perplexity
#: stayed at the initial 10,006 for 50 rounds: d_k was 100-150). FedAvgM and FedAdam are joint:
#: at FedAvg's client lr 3 on PTB every server lr of theirs was 2-10x worse on validation than
#: FedAvg (server momentum 0.9 multiplies a step up to 10x), and Reddi et al. find their best
#: pairs at smaller client lrs.
KNOBS = {
    "client_lr": Knob("FedAvg, client lr", ("--strategy", "fedavg"), "--lr", "client_lrs"),
    "central_lr": Knob("centralized, lr", (), "--lr", "client_lrs", kind="central"),
    "momentum_server_lr": Knob(
        "FedAvgM (server momentum 0.9), server lr",
        ("--strategy", "fedavg", "--server-opt", "momentum", "--server-momentum", "0.9"),
        "--server-lr",
        "momentum_server_lrs",
        client_key="momentum_client_lr",
    ),
    "adam_server_lr": Knob(
        "FedAdam, server lr",
        ("--strategy", "fedavg", "--server-opt", "adam", "--server-momentum", "0.9"),
        "--server-lr",
        "adam_server_lrs",
        client_key="adam_client_lr",
    ),
    "fedatt_step": Knob(
        "FedAtt, server step", ("--strategy", "fedatt"), "--epsilon", "fedatt_steps"
    ),
    "fedattopt_step": Knob(
        "FedAttOpt, server step", ("--strategy", "fedattopt"), "--epsilon", "fedattopt_steps"
    ),
}
#: Times a sweep extends its grid past an edge where the best value sits.
MAX_EXTENSIONS = 2
#: The C of the sweep's runs.
SWEEP_FRACTION = 0.1


@dataclass(frozen=True)
class Task:
    """A dataset as phones hold it: the sweep tunes per task, the ranking runs reuse its choice."""

    dataset: str
    partition: str = "iid"
    clients: int = 100
    # A real per-sender corpus (the real suite's): the vocabulary from its training split (no
    # --paper-protocol), every evaluation capped at REAL_EVAL messages, and the centralized model
    # trained on the phones' senders' text (--partition user --clients K).
    real: bool = False

    def args(self, kind: str) -> tuple[str, ...]:
        """Flags of every run of the task beyond the preset's, for a run of `kind` (federated
        runs name their partition through RunSpec.partition)."""
        if not self.real:
            return ()
        cut = ("--max-eval-sentences", str(REAL_EVAL))
        return cut if kind == "federated" else ("--partition", self.partition, *cut)


#: The real tasks' validation, test and held-out senders' messages each capped at the first
#: REAL_EVAL (the splits interleave the senders round-robin, so the cut keeps every sender's first
#: ones): every round scores all three, on two CPU cores.
REAL_EVAL = 1000
#: The real corpora as phones hold them. NUS SMS: 300 of its 309 training senders (the 9 left out
#: have the fewest messages). Ubuntu IRC: the 1,000 most active of its 15,853 training senders
#: (30 messages or more each).
REAL_TASKS = (Task("nus-sms", "user", 300, real=True), Task("ubuntu-irc", "user", 1000, real=True))
TASKS = (Task("ptb"), Task("wikitext-2"), Task("demo", "user", DEMO_OWNERS), *REAL_TASKS)
#: The task whose chosen learning rates a dataset's runs use (WikiText-2 by article: the IID
#: sweep's, so the partition is the only change between the rank and noniid suites).
TASK_OF = {t.dataset: t for t in TASKS}


def _grid(preset: Preset, knob: str) -> tuple[float, ...]:
    return getattr(preset, KNOBS[knob].grid)


def sweep_epochs(preset: Preset) -> int:
    """The centralized sweep's epochs: as many examples as a FedAvg run of the sweep."""
    return max(1, round(preset.sweep_rounds * SWEEP_FRACTION * preset.local_epochs))


def sweep_spec(
    preset: Preset,
    task: Task,
    knob: str,
    value: float,
    client_lr: float,
    fedavg_lr: float | None = None,
) -> RunSpec:
    """One run of the sweep, judged by its best validation perplexity: FedAvg for the client lr,
    the centralized model for its lr, a joint knob's method at `client_lr`, the others at
    FedAvg's chosen client lr, at C 0.1 for the preset's sweep_rounds. A joint knob's run at
    another client lr than FedAvg's (`fedavg_lr`) names it; those at FedAvg's keep the name
    they had when the sweep ran the server lrs at that client lr only."""
    k = KNOBS[knob]
    label = f"{k.label} {value:g}"
    if k.client_key and client_lr != fedavg_lr:
        label += f", client lr {client_lr:g}"
    common = dict(group=f"{knob}={value:g}", full_train=True, full_eval=True,
                  partition=task.partition, clients=task.clients,
                  paper_protocol=not task.real)  # fmt: skip
    if k.kind == "central":
        return RunSpec("sweep", task.dataset, label, SWEEP_FRACTION,
                       ("--epochs", str(sweep_epochs(preset)), *task.args("central")),
                       kind="central", lr=value, **common)  # type: ignore[arg-type]  # fmt: skip
    args = k.flags if knob == "client_lr" else (*k.flags, k.flag, f"{value:g}")
    args = (*args, *task.args("federated"))
    return RunSpec(
        "sweep", task.dataset, label, SWEEP_FRACTION, args,
        lr=value if knob == "client_lr" else client_lr, rounds=preset.sweep_rounds,
        **common,  # type: ignore[arg-type]
    )  # fmt: skip


def _score(r: dict) -> float:
    v = r.get("best_val_ppl")
    return v if isinstance(v, (int, float)) and math.isfinite(v) else math.inf


def _client_lr(r: dict) -> float:
    """The client lr a run trained at (its command line's --lr)."""
    lr = command_flag(r.get("command", ""), "--lr")
    return math.nan if lr == "-" else float(lr)


def _tried(
    results: list[dict], preset: Preset, task: Task, knob: str, client_lr: float | None = None
) -> dict[float, float]:
    """value -> best validation perplexity of the sweep's runs of `knob` so far (a joint knob's:
    those at `client_lr`)."""
    return {
        float(r["group"].split("=")[1]): _score(r)
        for r in results
        if r["suite"] == "sweep" and r.get("preset") == preset.name
        and r["dataset"] == task.dataset and r["group"].startswith(knob + "=")
        and (client_lr is None or _client_lr(r) == client_lr)
    }  # fmt: skip


def _decide(grid: tuple[float, ...], tried: dict[float, float]) -> tuple[float | None, list[float]]:
    """(the tried value with the lowest score, or None while undecided; the values still to
    run). The grid first; while the best sits at an edge, one more step past it (the grid's own
    ratio, snapped to half-decades), at most MAX_EXTENSIONS times a side."""
    missing = [v for v in grid if v not in tried]
    if missing:
        return None, missing
    best = min(tried, key=lambda v: (tried[v], v))
    values = sorted(tried)
    if len(grid) > 1:
        step = grid_step(grid)
        if best == values[0] and sum(v < min(grid) for v in values) < MAX_EXTENSIONS:
            return None, [half_decade(best / step)]
        if best == values[-1] and sum(v > max(grid) for v in values) < MAX_EXTENSIONS:
            return None, [half_decade(best * step)]
    return best, []


def grid_step(grid: tuple[float, ...]) -> float:
    """The ratio between neighbouring values of a geometric grid (of two or more values)."""
    return (max(grid) / min(grid)) ** (1 / (len(grid) - 1))


def choose(
    results: list[dict], preset: Preset, task: Task, knob: str
) -> tuple[float | None, list[float]]:
    """(the value of a one-dimensional `knob` with the lowest best validation perplexity, or
    None while undecided; the values still to run), by _decide's rule. Test perplexity is never
    read."""
    return _decide(_grid(preset, knob), _tried(results, preset, task, knob))


def joint_client_lrs(preset: Preset, fedavg_lr: float) -> list[float]:
    """The client lrs a joint knob is swept at: the grid's, and FedAvg's choice where the grid
    was extended to it."""
    return sorted({*preset.client_lrs, fedavg_lr})


def choose_joint(
    results: list[dict], preset: Preset, task: Task, knob: str
) -> tuple[tuple[float, float] | None, list[tuple[float, float]]]:
    """For a joint knob: ((client lr, value) with the lowest best validation perplexity, or
    None while undecided; the (client lr, value) pairs still to run). Each client lr's row of
    the grid is decided as a one-dimensional knob is, edge extensions included; nothing runs
    before FedAvg's client lr is chosen."""
    fedavg_lr, _ = choose(results, preset, task, "client_lr")
    if fedavg_lr is None:
        return None, []
    todo: list[tuple[float, float]] = []
    scored: dict[tuple[float, float], float] = {}
    for lr in joint_client_lrs(preset, fedavg_lr):
        tried = _tried(results, preset, task, knob, lr)
        value, missing = _decide(_grid(preset, knob), tried)
        todo += [(lr, v) for v in missing]
        if value is not None:
            scored[(lr, value)] = tried[value]
    if todo:
        return None, todo
    return min(scored, key=lambda pair: (scored[pair], pair)), []


def half_decade(value: float) -> float:
    """The nearest value of the 1-3-10 series (10^(k/2), written 1 or 3 x 10^j): the grid points
    of Reddi et al. 2021's sweeps."""
    e = round(2 * math.log10(value)) / 2
    return float(f"{(3 if e % 1 else 1) * 10 ** math.floor(e):.1g}")


def lr_choices(results: list[dict], preset: Preset) -> dict[str, dict[str, float]]:
    """task dataset -> {knob: chosen value} for every knob the sweep has decided (a joint
    knob's client lr under its client_key)."""
    out: dict[str, dict[str, float]] = {}
    for task in TASKS:
        for knob, k in KNOBS.items():
            if k.client_key:
                pair, _ = choose_joint(results, preset, task, knob)
                if pair is not None:
                    out.setdefault(task.dataset, {}).update({knob: pair[1], k.client_key: pair[0]})
                continue
            value, _ = choose(results, preset, task, knob)
            if value is not None:
                out.setdefault(task.dataset, {})[knob] = value
    return out


def sweep_suite(preset: Preset, results: list[dict], tasks=TASKS) -> list[RunSpec]:
    """The sweep's runs decidable now: the client-lr and centralized-lr grids (and their edge
    extensions), then, once the client lr is chosen, the joint grids and the server steps."""
    runs: list[RunSpec] = []
    for task in tasks:
        fedavg_lr, _ = choose(results, preset, task, "client_lr")
        for knob, k in KNOBS.items():
            if k.client_key:
                if fedavg_lr is not None:
                    runs += _joint_runs(preset, results, task, knob, fedavg_lr)
                continue
            if knob not in ("client_lr", "central_lr") and fedavg_lr is None:
                continue
            _, todo = choose(results, preset, task, knob)
            values = sorted({*_grid(preset, knob), *todo, *_tried(results, preset, task, knob)})
            runs += [sweep_spec(preset, task, knob, v, fedavg_lr or v) for v in values]
    return runs


def _joint_runs(
    preset: Preset, results: list[dict], task: Task, knob: str, fedavg_lr: float
) -> list[RunSpec]:
    """A joint knob's sweep runs: the pairs tried and those still to run, by client lr."""
    _, todo = choose_joint(results, preset, task, knob)
    tried = [(lr, v) for lr in joint_client_lrs(preset, fedavg_lr)
             for v in _tried(results, preset, task, knob, lr)]  # fmt: skip
    return [sweep_spec(preset, task, knob, v, lr, fedavg_lr) for lr, v in sorted({*todo, *tried})]


def choices_so_far(results: list[dict], preset: Preset) -> dict[str, dict[str, float]]:
    """The sweep's choices where it has made them, every_knob_chosen's placeholders elsewhere: a
    suite's whole plan with the ids of the runs it has already made (the confirm suite's steps
    lower follow from those runs' scores)."""
    chosen = lr_choices(results, preset)
    return {ds: {**every, **chosen.get(ds, {})} for ds, every in every_knob_chosen().items()}


def every_knob_chosen() -> dict[str, dict[str, float]]:
    """Choices as if the sweep had decided every knob on every task: the ranking suites' whole
    plan, to count and name its runs (the values are placeholders)."""
    return {t.dataset: {k: 1.0 for k in KNOBS} for t in TASKS}


def sweep_size(mine: list[dict], preset: Preset, task: Task, knob: str) -> int:
    """The runs of one knob's sweep on a task as far as known: its grid (a joint knob's at each
    client lr), the edge extensions asked for, and the values tried."""
    if not KNOBS[knob].client_key:
        return len({*_grid(preset, knob), *choose(mine, preset, task, knob)[1],
                    *_tried(mine, preset, task, knob)})  # fmt: skip
    fedavg_lr, _ = choose(mine, preset, task, "client_lr")
    lrs = joint_client_lrs(preset, fedavg_lr) if fedavg_lr is not None else preset.client_lrs
    todo = choose_joint(mine, preset, task, knob)[1]
    return sum(len({*_grid(preset, knob), *(v for at, v in todo if at == lr),
                    *_tried(mine, preset, task, knob, lr)}) for lr in lrs)  # fmt: skip
