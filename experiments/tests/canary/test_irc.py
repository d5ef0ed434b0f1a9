"""fedkey_bench.canary.irc: every arm of the IRC canary audit is a cell of the privacy table (the same
Settings, the z calibrate_cell gives its target epsilon), in the priority order, with the clip of
the table's probe; an interrupted bench resumes."""

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

import fedkey_bench.canary.irc as canary_irc
from fedkey.runners.canary_arms import arms, command
from fedkey.server.settings import Settings
from fedkey_bench.canary.irc import planned, probe_clip
from fedkey_bench.paper.results import Bench
from fedkey_bench.privacy.runner import (
    PROBE_ID,
    WORKLOADS,
    Cell,
    _config,
    calibrate_cell,
    settings_fields,
)

#: The IRC protocol at two of its epsilons (each calibration costs a few accountant calls).
PROTOCOL = replace(WORKLOADS["irc"], epsilons=(8.0, 2.0), workers=0)
CLIP = 5.575570284885108


def parsed(argv: list[str]) -> dict:
    """The Settings fields a `env NAME=value ... fedkey simulate --flag value ...` line sets."""
    fields: dict[str, object] = {}
    at = argv.index("fedkey")
    for item in argv[1:at]:
        name, value = item.split("=", 1)
        fields[name.removeprefix("FEDKEY_").lower()] = value
    flags = argv[at + 2 :]
    i = 0
    while i < len(flags):
        key = flags[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            fields[key], i = flags[i + 1], i + 2
        else:
            fields[key], i = True, i + 1
    return fields


def test_every_arm_is_the_privacy_tables_cell_with_its_calibrated_z():
    steps = planned(PROTOCOL, CLIP)
    order = [
        (
            cfg.dp_mechanism if cfg.dp_noise_multipliers else None,
            cfg.dp_epsilons or cfg.dp_noise_multipliers,
        )
        for cfg, _ in steps
    ]  # the table's epsilons; (0.0,): z = 0
    assert order == [(None, ()), ("gaussian", (0.0,)), ("gaussian", (8.0,)), ("blt", (8.0,)),
                     ("blt", (2.0,)), ("gaussian", (2.0,)), ("gaussian", (0.0,)), (None, ()),
                     (None, ()), ("tree", (8.0,)), ("tree", (2.0,)), (None, ()),
                     ("gaussian", (8.0,)), ("blt", (8.0,))]  # fmt: skip
    ids = [i for _, step in steps for i in step]
    assert ids[:6] == ["fedavg", "fedavg-control", "fedavg-dp-z0", "fedavg-dp-z0-control",
                       "fedavg-eps8", "fedavg-eps8-control"]  # fmt: skip
    assert ids[12:18] == ["fedavg-dp-z0-k400", "fedavg-dp-z0-control", "fedavg-unbounded-k400",
                          "fedavg-unbounded-control", "fedavg-unbounded",
                          "fedavg-unbounded-control"]  # fmt: skip
    assert ids[22:26] == ["fedatt-fixed", "fedatt-fixed-control", "fedatt-fixed-eps8",
                          "fedatt-fixed-eps8-control"]  # fmt: skip
    controls: dict[str, list[str]] = {}
    for cfg, step in steps:
        for arm in (a for a in arms(cfg) if a.id in step):
            argv = command(arm, cfg, Path("runs/x"))
            given = parsed(argv)
            strategy = "fedatt-fixed" if arm.strategy == "fedatt" else "fedavg"
            z = None
            if arm.noise == 0.0:  # the DP arms' aggregation without noise
                z = 0.0
            elif arm.dp:
                cell = Cell(strategy, arm.epsilon, mechanism=arm.mechanism)
                z = calibrate_cell(PROTOCOL, cell).noise_multiplier
                assert float(given["dp_noise_multiplier"]) == z  # every digit of the table's z
            unbounded = arm.id.startswith("fedavg-unbounded")  # --bound off: no clip at all
            table = settings_fields(
                PROTOCOL, strategy, None if unbounded else CLIP, z, arm.mechanism
            )
            settings = Settings(**{k: v for k, v in given.items() if k in Settings.model_fields})
            ours = settings.model_dump()
            assert {k: ours[k] for k in table} == Settings(**table).model_dump(include=set(table))
            assert (given["partition"], given["clients"], given["rounds"]) == ("user", "2000", "12")
            assert given["canary_repeats"] == (str(cfg.repeats) if arm.planted else "0")
            if arm.planted:
                assert cfg.repeats == (400 if arm.id.endswith("-k400") else 20)
            else:  # a control is the same run whatever k the planted arm beside it has
                assert controls.setdefault(arm.id, argv) == argv
            assert settings.canary_spec().size == 10**4  # my password is _ _ _ _ over 0 .. 9


def test_the_clip_is_the_tables_probe_and_never_measured_here(tmp_path):
    with pytest.raises(ValueError, match="no clip probe of this workload"):
        probe_clip(PROTOCOL, tmp_path)
    config = _config(settings_fields(PROTOCOL, "fedavg", None, None), PROTOCOL.probe_rounds,
                     PROTOCOL)  # fmt: skip
    Bench(tmp_path).add({"id": PROBE_ID, "clip": 4.5, "config": "another workload"}, "")
    with pytest.raises(ValueError):
        probe_clip(PROTOCOL, tmp_path)
    Bench(tmp_path).add({"id": PROBE_ID, "clip": CLIP, "config": config}, "")
    assert probe_clip(PROTOCOL, tmp_path) == CLIP


def test_an_interrupted_bench_resumes_in_priority_order(tmp_path, monkeypatch):
    """Each arm runs once, in PRIORITY order; a second bench runs only what is missing."""
    ran = []

    def run_audit(cfg, out, runs_dir, only=None, audit_command=""):
        (arm,) = [a for a in arms(cfg) if a.id in (only or [])]
        path = out / "results.json"
        data = json.loads(path.read_text()) if path.exists() else {"runs": []}
        line = shlex.join(command(arm, cfg, runs_dir / arm.id))
        if not any(r["id"] == arm.id and r["command"] == line for r in data["runs"]):
            ran.append(arm.id)
            data["runs"].append({"id": arm.id, "command": line})
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data))

    monkeypatch.setattr(canary_irc, "run_audit", run_audit)
    monkeypatch.setattr(canary_irc, "write_page", lambda *a: None)
    monkeypatch.setattr(canary_irc, "WORKLOADS", {"irc": PROTOCOL})
    canary_irc.run(tmp_path / "out", tmp_path / "runs", tmp_path, clip=CLIP)
    assert ran[:8] == ["fedavg", "fedavg-control", "fedavg-dp-z0", "fedavg-dp-z0-control",
                       "fedavg-eps8", "fedavg-eps8-control", "fedavg-blt-eps8",
                       "fedavg-blt-eps8-control"]  # fmt: skip
    # each step a planted arm and its control; a -k400 arm's control is the k 20 arm's
    assert len(ran) == 2 * 14 - 2 and ran[12:15] == [
        "fedavg-dp-z0-k400", "fedavg-unbounded-k400", "fedavg-unbounded-control"
    ]  # fmt: skip
    canary_irc.run(tmp_path / "out", tmp_path / "runs", tmp_path, clip=CLIP)
    assert len(ran) == 26  # nothing again
