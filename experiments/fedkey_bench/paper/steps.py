"""A learning rate a short run chose, checked at full length one grid step lower.

A sweep run (fedkey_bench.paper.sweep) lasts a fifth of a full run, so it ranks rates by early progress,
which favours the larger. The confirm suite (fedkey_bench.paper.suites) and the real suite
(fedkey_bench.paper.real_suite) run a row whose rate the sweep chose again at the grid's next smaller value,
and again one lower while the lower one wins on validation (steps_lower).
"""

from __future__ import annotations

from dataclasses import replace

from fedkey_bench.paper.presets import Preset
from fedkey_bench.paper.spec import RunSpec
from fedkey_bench.paper.sweep import KNOBS, MAX_EXTENSIONS, Knob, _score, grid_step, half_decade

#: The methods whose chosen rate is checked lower, and that rate: a sweep run lasts a fifth of a
#: rank run, so it ranks lrs by early progress, which favours the larger (63 of the cpu sweep's 123
#: runs were still improving at their end; PTB's FedAdam choice led FedAvgM's at round 10, 264 to
#: 364, and ended 19% above it; one step lower, 4% below). Not larger: the one such run by hand
#: lost (FedAvgM at server lr 3: test 324 against 142). The server lr for FedAvgM and FedAdam, at
#: the client lr chosen with it. Not FedAtt's step (a smaller one moves the model less of FedAvg's
#: way), nor FedAttOpt's: its reach goes as 1 / d^2 of the update norm d, which falls ~8x in a run
#: (fedkey_bench.paper.attopt_step).
CONFIRMED = {"FedAvg": "client_lr", "FedAvgM": "momentum_server_lr", "FedAdam": "adam_server_lr"}


def lower_lr(grid: tuple[float, ...], value: float) -> float:
    """One step of the grid's ratio below `value`, snapped to half-decades (the sweep's own steps
    past a grid's edge): the grid's next smaller value for a value on it."""
    return half_decade(value / (grid_step(grid) if len(grid) > 1 else 10.0))


def confirmed_knob(spec: RunSpec) -> Knob:
    """The knob whose value the confirm step lowers for a row (CONFIRMED's, or the centralized
    model's lr)."""
    return KNOBS["central_lr" if spec.kind == "central" else CONFIRMED[spec.method]]


def steps_lower(
    preset: Preset, spec: RunSpec, knob: Knob, above: dict | None, done: dict[str, dict]
) -> list[RunSpec]:
    """`spec` again at lower_lr of its `knob`'s value (tagged "lr<value>", or "server-lr<value>"
    for a server optimizer's); while the last of them ended better on validation than the run
    above it (`above`: the record of `spec` itself; `done`: records by id), one step lower again,
    as the sweep extends a grid (MAX_EXTENSIONS steps at most)."""
    runs: list[RunSpec] = []
    at = spec.args.index(knob.flag) + 1 if knob.flag in spec.args else 0  # a server lr's place
    value = float(spec.args[at]) if at else (spec.lr or preset.lr)
    for _ in range(MAX_EXTENSIONS):
        value = lower_lr(getattr(preset, knob.grid), value)
        if at:
            args = (*spec.args[:at], f"{value:g}", *spec.args[at + 1 :])
            runs.append(replace(spec, args=args, tag=f"server-lr{value:g}"))
        else:
            runs.append(replace(spec, lr=value, tag=f"lr{value:g}"))
        below = done.get(runs[-1].id)
        if above is None or below is None or _score(below) >= _score(above):
            break
        above = below
    return runs
