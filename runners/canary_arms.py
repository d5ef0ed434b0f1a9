"""The canary audit's configuration and arms: the federation every arm runs (AuditConfig), the
arms (FedAvg and FedAtt, without and with DP, each DP arm beside its not-planted control), each
arm's `fedkey simulate` command line, and the summary of its metrics rows that results.json keeps.
runners.canary_audit runs them; runners.canary_report records and reports them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "STRATEGIES",
    "Arm",
    "AuditConfig",
    "arms",
    "canary_phone",
    "command",
    "select",
    "summarize",
]


def canary_phone(clients: int) -> str:
    """The phone whose shard holds the canary: the first (corpora.dataset.plant_canary), named
    as corpora.dataset.device_name names it."""
    return f"device-{0:0{len(str(clients - 1))}d}"


@dataclass(frozen=True)
class AuditConfig:
    """The federation every arm runs (the arms differ only in strategy and privacy)."""

    data: str = "demo"
    clients: int = 20  # the demo's 20 owners, one phone each
    fraction: float = 0.5
    rounds: int = 8  # FedAvg ranks the secret first by round 7 (device-00 in rounds 2, 7, 8)
    local_epochs: int = 2
    repeats: int = 20  # copies of the canary in the first phone's shard
    dp_clip: float = 1.0
    dp_noise_multipliers: tuple[float, ...] = (1.0, 0.1)
    max_eval_sentences: int = 200
    seed: int = 0
    workers: int = 2

    def flags(self, repeats: int) -> list[str]:
        return [
            "--data", self.data, "--partition", "user", "--clients", str(self.clients),
            "--fraction", f"{self.fraction:g}", "--rounds", str(self.rounds),
            "--local-epochs", str(self.local_epochs), "--max-eval-sentences",
            str(self.max_eval_sentences), "--ksr-sentences", "0", "--seed", str(self.seed),
            "--canary", "--canary-repeats", str(repeats), "--workers", str(self.workers),
        ]  # fmt: skip


@dataclass(frozen=True)
class Arm:
    id: str
    label: str
    strategy: str
    noise: float | None = None  # the DP noise multiplier z; None: no DP
    planted: bool = True  # False: the control, nothing planted (--canary-repeats 0)

    @property
    def dp(self) -> bool:
        return self.noise is not None

    def flags(self, cfg: AuditConfig) -> list[str]:
        if self.noise is None:  # the undefended arm: no bound on any phone's update
            return ["--strategy", self.strategy, "--bound", "off"]
        return [
            "--strategy", self.strategy, "--dp-clip", f"{cfg.dp_clip:g}",
            "--dp-noise-multiplier", f"{self.noise:g}",
        ]  # fmt: skip


STRATEGIES = (("fedavg", "FedAvg"), ("fedatt", "FedAtt"))


def arms(cfg: AuditConfig) -> list[Arm]:
    """FedAvg and FedAtt without DP, then with DP at each noise multiplier of `cfg`, each DP arm
    beside its control (the same run with nothing planted)."""
    out = [Arm(s, name, s) for s, name in STRATEGIES]
    for z in cfg.dp_noise_multipliers:
        for s, name in STRATEGIES:
            out.append(Arm(f"{s}-dp-z{z:g}", f"DP-{name} z {z:g}", s, z))
            out.append(
                Arm(f"{s}-dp-z{z:g}-control", f"DP-{name} z {z:g}, not planted", s, z, False)
            )
    return out


def command(arm: Arm, cfg: AuditConfig, run_dir: Path) -> list[str]:
    """The fedkey command line of one arm (without the interpreter)."""
    flags = cfg.flags(cfg.repeats if arm.planted else 0)
    return ["fedkey", "simulate", *flags, *arm.flags(cfg), "--out", str(run_dir)]


def summarize(rows: list[dict], arm: Arm, clients: int) -> dict:
    """One results.json object from an arm's metrics rows (round 0 = the initial model)."""
    last, phone = rows[-1], canary_phone(clients)
    return {
        "id": arm.id,
        "label": arm.label,
        "strategy": arm.strategy,
        "dp": arm.dp,
        "noise_multiplier": arm.noise,
        "planted": arm.planted,
        "rounds": last["round"],
        "exposure": last["canary_exposure"],
        "rank": last["canary_rank"],
        "max_exposure": max(r["canary_exposure"] for r in rows),
        "test_ppl": last["test_ppl"],
        "initial_test_ppl": rows[0]["test_ppl"],
        "best_test_ppl": last["best_test_ppl"],
        "epsilon": last.get("epsilon"),
        # DP: the std of the noise added to every weight each round (z x the sensitivity)
        "noise_std": ((last.get("info") or {}).get("dp") or {}).get("noise_std"),
        # Rounds whose aggregate held the canary phone's update.
        "canary_phone": phone,
        "canary_rounds": [r["round"] for r in rows if phone in r["aggregated"]],
        "curve": [
            {
                "round": r["round"],
                "exposure": r["canary_exposure"],
                "rank": r["canary_rank"],
                "val_ppl": r["val_ppl"],
                "test_ppl": r["test_ppl"],
                "epsilon": r.get("epsilon"),
                "canary_phone": phone in r["aggregated"],
            }
            for r in rows
        ],
    }


def select(choices: list[Arm], only: list[str] | None) -> list[Arm]:
    if not only:
        return choices
    unknown = [o for o in only if o not in {a.id for a in choices}]
    if unknown:
        raise ValueError(
            f"no arm {', '.join(unknown)}; the arms are {', '.join(a.id for a in choices)}"
        )
    return [a for a in choices if a.id in only]
