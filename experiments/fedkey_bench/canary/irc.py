"""`fedkey-bench canary --workload irc`: the canary audit (`fedkey audit canary`,
fedkey.runners.canary_audit) on the privacy-utility table's population, settings and noise.

Every arm is one of the privacy table's cells (fedkey_bench.privacy.runner, workload ``irc``) with a secret
planted: the same Settings fields (fedkey_bench.privacy.runner.settings_fields: 2,000 phones, one per sender,
vocabulary 2,000, cohorts of 100, 12 rounds, E 1, B 10, SGD lr 3, GRU h64, the probe's clip S,
delta 1/N^1.1), the same z for a target epsilon under a mechanism (fedkey_bench.privacy.runner.calibrate_cell,
the server's own accounting), `--workers 0`. The no-DP arm is the table's no-DP cell (the same
clip S as a fixed bound, no noise). Each DP arm runs again with nothing planted.

The secret's format: the audit's default 'my secret is _ _ _ _' over one .. ten is not in this
vocabulary ('secret' and four .. ten are not among the 2,000 words), so the secret here is
'my password is _ _ _ _' over the digits 0 .. 9 (10^4 candidates, every word in the vocabulary;
the run refuses a format with an unknown word, fedkey.models.canary.check_vocabulary). It is planted in
the first phone's shard: the sender with the most training messages.

The arms run in PRIORITY order, each `fedkey simulate` a child process; results.json keeps each
arm with its command, so an interrupted bench resumes, and ``until`` stops it from starting an
arm after a given time. The page (OUT/results.md) is fedkey.runners.canary_report's, with this
workload's notes after its title.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

from fedkey.runners.canary_arms import AuditConfig, arms, number
from fedkey.runners.canary_audit import Results, run_audit, write_report
from fedkey.runners.canary_report import mean_exposure, rounds_with
from fedkey_bench.common.checkout import RESULTS, shown
from fedkey_bench.paper.results import Bench
from fedkey_bench.privacy.runner import PROBE_ID, WORKLOADS, Cell, Protocol, _config, calibrate_cell
from fedkey_bench.privacy.runner import settings_fields as privacy_fields

#: The secret's format: all of its words are in the IRC workload's 2,000-word vocabulary.
FORMAT = "my password is _ _ _ _"
ALPHABET = "0 1 2 3 4 5 6 7 8 9"
REPEATS = 20  # copies of the secret in the planted phone's shard (the audit's default)
#: The arms in the order they run: (the privacy table's strategy, mechanism, target epsilon);
#: (strategy, None, None): no DP, the table's (the clip, the server's default trim and outlier
#: filter); epsilon inf: the DP arms' aggregation without noise (z = 0: the clip and the
#: uniform mean, no trim, no filter).
#: A fourth entry: the copies planted (default REPEATS), for arms named by it (-k400).
#: Mechanism "unbounded": no DP and no bound, trim or outlier filter (--bound off, the seed
#: papers' server, FedAvg's weights by example count): can the audit see the secret at all?
STRESS = 400  # a third of the planted phone's ~800 messages
PRIORITY: tuple[tuple, ...] = (
    ("fedavg", None, None),
    ("fedavg", "gaussian", math.inf),
    ("fedavg", "gaussian", 8.0),
    ("fedavg", "blt", 8.0),
    ("fedavg", "blt", 2.0),
    ("fedavg", "gaussian", 2.0),
    ("fedavg", "gaussian", math.inf, STRESS),
    ("fedavg", "unbounded", None, STRESS),
    ("fedavg", "unbounded", None),
    ("fedavg", "gaussian", 4.0),
    ("fedavg", "blt", 4.0),
    ("fedavg", "gaussian", 1.0),
    ("fedavg", "blt", 1.0),
    ("fedavg", "tree", 8.0),
    ("fedavg", "tree", 2.0),
    ("fedatt-fixed", None, None),
    ("fedatt-fixed", "gaussian", 8.0),
    ("fedatt-fixed", "blt", 8.0),
)
#: The table's FedAtt: the fixed normalizer (DP-FedAvg's sensitivity), as fedatt-fixed.
NORMALIZER = "fixed"
#: The Settings fields the audit's own options set (AuditConfig.flags, Arm.flags).
AUDIT_FIELDS = {
    "data", "seed", "fraction", "local_epochs", "max_eval_sentences", "ksr_sentences",
    "strategy", "bound", "bound_norm", "dp_clip", "dp_noise_multiplier", "dp_mechanism",
}  # fmt: skip


def probe_clip(protocol: Protocol, privacy_out: Path) -> float:
    """The privacy table's clip S: its probe's, read from PRIVACY_OUT/results.json (the probe of
    these settings; never run here)."""
    config = _config(
        privacy_fields(protocol, "fedavg", None, None), protocol.probe_rounds, protocol
    )
    probe = next(
        (r for r in Bench(privacy_out).read() if r["id"] == PROBE_ID and r["config"] == config),
        None,
    )
    if probe is None:
        raise ValueError(
            f"{privacy_out / 'results.json'} has no clip probe of this workload: run "
            "`fedkey-bench privacy --workload irc --only fedavg-nodp` first, or pass --clip"
        )
    return float(probe["clip"])


def flags(fields: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """`fedkey simulate` options for Settings `fields` (None: the default, left out), and the
    FEDKEY_ variables (name, value) of those that have no option (hidden_size)."""
    from fedkey.cli.options import SETTINGS_GROUPS

    options = {name for group in SETTINGS_GROUPS for name in group}
    out, env = [], []
    for key, value in sorted(fields.items()):
        if value is None:
            continue
        text = number(value) if isinstance(value, float) else str(value)
        if key in options:
            out += [f"--{key.replace('_', '-')}", text]
        else:
            env.append((key, text))
    return out, env


def audit_config(
    protocol: Protocol,
    clip: float,
    mechanism: str,
    epsilons: tuple[float, ...],
    repeats: int = REPEATS,
) -> AuditConfig:
    """The audit of the table's FedAvg cells under `mechanism` at `epsilons`, z calibrated as
    the table's (calibrate_cell)."""
    if epsilons == (math.inf,):  # no noise: z = 0, the arm named by it (fedavg-dp-z0)
        cells, epsilons = [Cell("fedavg", None, noise_multiplier=0.0)], ()
    else:
        cells = [calibrate_cell(protocol, Cell("fedavg", e, mechanism=mechanism)) for e in epsilons]
    shared = privacy_fields(protocol, "fedavg", clip, None)
    args, env = flags({k: v for k, v in shared.items() if k not in AUDIT_FIELDS})
    return AuditConfig(
        data=protocol.data,
        clients=protocol.clients,
        fraction=protocol.fraction,
        rounds=protocol.rounds,
        local_epochs=protocol.local_epochs,
        repeats=repeats,
        name_repeats=repeats != REPEATS,
        dp_clip=clip,
        dp_noise_multipliers=tuple(float(c.noise_multiplier or 0.0) for c in cells),
        dp_epsilons=epsilons,
        max_eval_sentences=protocol.max_eval_sentences,
        seed=protocol.seed,
        workers=0,
        dp_mechanism=mechanism,
        bound_norm=clip,
        canary_format=FORMAT,
        canary_alphabet=ALPHABET,
        simulate_args=tuple(args),
        simulate_env=tuple(env),
        nodp_controls=True,
        fedatt_normalizer=NORMALIZER,
    )


def planned(protocol: Protocol, clip: float) -> list[tuple[AuditConfig, list[str]]]:
    """Each step of PRIORITY: the audit that runs it and its arms' ids (planted, then not
    planted); strategies, mechanisms and epsilons the protocol has not are left out."""
    steps = []
    for strategy, mech, eps, *k in PRIORITY:
        known = eps is None or math.isinf(eps) or eps in protocol.epsilons
        if eps is not None and (mech not in protocol.mechanisms or not known):
            continue
        if strategy not in protocol.strategies:
            continue
        cfg = audit_config(protocol, clip, mech or "gaussian", () if eps is None else (eps,), *k)
        if mech == "unbounded":
            cfg = replace(cfg, bound_norm=None, tag=("-unbounded", ", no bound"))
        ids = [
            a.id
            for a in arms(cfg)
            if table_strategy(a.id) == strategy and a.dp == (eps is not None)
        ]
        steps.append((cfg, ids))
    return steps


def table_strategy(arm_id: str) -> str:
    """The privacy table's strategy (fedkey_bench.privacy.runner.VARIANTS) of an arm: fedavg, fedatt-fixed."""
    return (
        "fedatt-" + NORMALIZER
        if arm_id.startswith("fedatt-" + NORMALIZER)
        else arm_id.split("-")[0]
    )


def notes(protocol: Protocol, clip: float) -> str:
    """This workload's paragraph of the page."""
    return (
        "The population and settings of the privacy-utility table on Ubuntu IRC "
        "(experiments/results/privacy-irc, `fedkey-bench privacy --workload irc`): "
        f"{protocol.clients:,} phones, one per sender (the {protocol.clients:,} with the most "
        f"training messages), vocabulary {protocol.vocab_size:,}, cohorts of {protocol.cohort} "
        f"(C {protocol.fraction:g}), {protocol.rounds} rounds, E {protocol.local_epochs}, "
        f"B {protocol.batch_size}, SGD lr {protocol.lr:g}, GRU h{protocol.hidden_size}, clip "
        f"S = {clip:.3g} (the table's probe), delta 1/N^1.1; each DP arm's z is the table's "
        "for its target epsilon and mechanism (fedkey_bench.privacy.runner.calibrate_cell on the server's "
        "accountant; DP-FTRL at the default separation b = floor(N/m), so a phone trains at "
        "most once in these rounds). The no-DP arm is the table's no-DP cell: the same clip, no "
        "noise, and the server's defaults without DP, the coordinate trim and the cosine outlier "
        "filter (fedkey.federation.strategies.outliers), which may reject the planted phone's update (the "
        "column 'rounds with' says so). 'DP-FedAvg z 0' is the DP arms' aggregation without "
        "noise (the clip and the uniform mean, no trim, no filter): what the secret's exposure "
        "is before the noise. Two checks of whether the audit can see the secret at all: arms "
        f"named 'k {STRESS}' plant {STRESS} copies instead of {REPEATS} (their control is the "
        "same run as the k "
        f"{REPEATS} arm's), and 'no bound' arms run the seed papers' server (`--bound off`: "
        "no clip, trim or outlier filter; FedAvg weighs each update by its phone's examples). "
        "The audit's default secret format is not in this vocabulary ('secret' and "
        "four .. ten are not among its words), so the secret is drawn from "
        f"`{FORMAT}` over the digits {ALPHABET}. The planted phone is the sender with the most "
        "training messages; the column 'rounds with' says in which rounds its update was "
        "aggregated (the cohort of round 1 is drawn from every phone under every mechanism, "
        "with the same seeded draw)."
    )


def _f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _no_dp(run: dict) -> str:
    return "no DP (same clip)" if run["config"].get("bound_norm") else "no DP, no bound"


def paired(runs: list[dict]) -> str:
    """A row per planted arm beside its not-planted control (the same run, nothing planted):
    exposure in the last round, its mean from the planted phone's round, its max; no DP first,
    then gaussian, blt, tree, each from the largest epsilon down."""
    mechs = ("gaussian", "blt", "tree")
    controls = {r["id"].removesuffix("-control"): r for r in runs if not r.get("planted", True)}
    base = {r["id"]: re.sub(r"-k\d+$", "", r["id"]) for r in runs}  # a -k400 arm's control
    planted = sorted(
        (r for r in runs if r.get("planted", True)),
        key=lambda r: (r["strategy"], r["dp"], mechs.index(r.get("mechanism") or "gaussian"),
                       -(r.get("target_epsilon") or math.inf), r["config"]["repeats"]),
    )  # fmt: skip
    lines = [
        "| arm | mechanism | target epsilon | epsilon | z | exposure, last round: planted / "
        "not planted | mean from the phone's round | max | rank (planted) | test ppl | "
        "rounds with the phone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in planted:
        c = controls.get(base[r["id"]])

        def pair(key: str, c: dict | None = c, r: dict = r) -> str:
            get = (lambda x: mean_exposure(x)) if key == "mean" else (lambda x: x[key])
            return f"{_f(get(r))} / {_f(get(c)) if c else '-'}"

        lines.append(
            f"| {r['label']} | {r.get('mechanism') or _no_dp(r)} | "
            f"{_f(r.get('target_epsilon'), 'g')} | {_f(r['epsilon'])} | "
            f"{_f(r['noise_multiplier'], '.3f')} | {pair('exposure')} | {pair('mean')} | "
            f"{pair('max_exposure')} | {r['rank']:.0f} | {r['test_ppl']:.1f} | "
            f"{rounds_with(r)} |"
        )
    return "\n".join(lines)


def write_page(out: Path, protocol: Protocol, clip: float) -> Path:
    """OUT/results.md: the audit's report with this workload's notes and the paired table after
    its title."""
    results = Results(out)
    runs = results.read()
    write_report([{**r, "command": shown(r["command"])} for r in runs], out, results.commands())
    page = out / "results.md"
    title, rest = page.read_text().split("\n", 1)
    title = "# Canary exposure on the IRC population at the privacy table's epsilons"
    page.write_text(f"{title}\n\n{notes(protocol, clip)}\n\n{paired(runs)}\n{rest}")
    return page


def rebuild(folder: Path, workload: str = "irc") -> Path:
    """FOLDER/results.md from FOLDER/results.json alone (the clip: its arms')."""
    runs = Results(folder).read()
    if not runs:
        raise ValueError(f"{folder / 'results.json'} holds no arm yet")
    return write_page(folder, WORKLOADS[workload], float(runs[0]["config"]["dp_clip"]))


def run(
    out: Path,
    runs_dir: Path,
    privacy_out: Path,
    clip: float | None = None,
    until: dt.datetime | None = None,
    bench_command: str = "",
    workload: str = "irc",
) -> list[dict]:
    """Run the arms not yet in OUT/results.json in PRIORITY order, starting none after `until`
    (UTC); -> every arm recorded."""
    protocol = replace(WORKLOADS[workload], workers=0)
    s = probe_clip(protocol, privacy_out) if clip is None else clip
    for cfg, ids in planned(protocol, s):
        for arm_id in ids:
            if until is not None and dt.datetime.now(dt.UTC) >= until:
                print(f"stopped at {until:%H:%M} UTC before {arm_id}; run again to resume")
                write_page(out, protocol, s)
                return Results(out).read()
            run_audit(cfg, out, runs_dir, only=[arm_id], audit_command=bench_command)
            write_page(out, protocol, s)
    write_page(out, protocol, s)
    return Results(out).read()


if __name__ == "__main__":  # python -m fedkey_bench.canary.irc [FOLDER]: the page from results.json
    try:
        print(rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "canary-irc"))
    except ValueError as e:
        sys.exit(f"error: {e}; run `fedkey-bench canary --workload irc` first")
