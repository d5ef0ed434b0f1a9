"""The canary audit's configuration and arms: the federation every arm runs (AuditConfig), the
arms (FedAvg and FedAtt, without and with DP, each DP arm beside its not-planted control), each
arm's `fedkey simulate` command line, and the summary of its metrics rows that results.json keeps.
fedkey.runners.canary_audit runs them; fedkey.runners.canary_report records and reports them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedkey.models.canary import DEFAULT_ALPHABET, DEFAULT_TEMPLATE

__all__ = [
    "STRATEGIES",
    "number",
    "Arm",
    "AuditConfig",
    "arms",
    "canary_phone",
    "command",
    "select",
    "summarize",
]


def canary_phone(clients: int) -> str:
    """The phone whose shard holds the canary: the first (fedkey.corpora.dataset.plant_canary), named
    as fedkey.corpora.dataset.device_name names it."""
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
    dp_mechanism: str = "gaussian"  # --dp-mechanism of the DP arms: gaussian, tree or blt
    # The target epsilon each noise multiplier was calibrated for (the research harness's
    # fedkey_bench.canary_irc): names the arms by it; empty: by z.
    dp_epsilons: tuple[float, ...] = ()
    # The no-DP arms' server bound: None, none (--bound off, the seed papers'); S, the same
    # clip as the DP arms without noise (--bound fixed --bound-norm S, the privacy table's).
    bound_norm: float | None = None
    canary_format: str = DEFAULT_TEMPLATE  # FEDKEY_CANARY_FORMAT: its words must be in the vocab
    canary_alphabet: str = " ".join(DEFAULT_ALPHABET)
    simulate_args: tuple[str, ...] = ()  # more `fedkey simulate` options, the same for every arm
    # Settings without a simulate option, as FEDKEY_<NAME> variables: (("HIDDEN_SIZE", "64"),)
    simulate_env: tuple[tuple[str, str], ...] = ()
    # The no-DP arms also with nothing planted: the exposure the secret gets from the language
    # alone (digits the corpus favours), without which a no-DP exposure is hard to read.
    nodp_controls: bool = False
    # FedAtt's normalizer (--fedatt-normalizer; None: simulate's default, softmax); fixed: the
    # arms are named fedatt-fixed as in the privacy table.
    fedatt_normalizer: str | None = None
    # Name the planted arms by their copies (fedavg-dp-z0-k400, ", k 400"): arms of several k in
    # one results.json; their controls (nothing planted) are the same runs whatever k.
    name_repeats: bool = False
    # Appended to every arm's id and label ("-unbounded", ", no bound"): audits of other
    # settings in one results.json.
    tag: tuple[str, str] = ("", "")

    def flags(self, repeats: int) -> list[str]:
        return [
            "--data", self.data, "--partition", "user", "--clients", str(self.clients),
            "--fraction", f"{self.fraction:g}", "--rounds", str(self.rounds),
            "--local-epochs", str(self.local_epochs), "--max-eval-sentences",
            str(self.max_eval_sentences), "--ksr-sentences", "0", "--seed", str(self.seed),
            "--canary", "--canary-repeats", str(repeats), "--workers", str(self.workers),
            *self.simulate_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        """The variables a child needs: simulate_env's, and the canary format's (none for the
        default format)."""
        env = {f"FEDKEY_{name.upper()}": value for name, value in self.simulate_env}
        if self.canary_format != DEFAULT_TEMPLATE:
            env["FEDKEY_CANARY_FORMAT"] = self.canary_format
        if self.canary_alphabet != " ".join(DEFAULT_ALPHABET):
            env["FEDKEY_CANARY_ALPHABET"] = self.canary_alphabet
        return env


def number(x: float) -> str:
    """`x` as a flag value: %g where that is exact (1, 0.1), else every digit (a calibrated z)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


@dataclass(frozen=True)
class Arm:
    id: str
    label: str
    strategy: str
    noise: float | None = None  # the DP noise multiplier z; None: no DP
    planted: bool = True  # False: the control, nothing planted (--canary-repeats 0)
    mechanism: str = "gaussian"  # --dp-mechanism
    epsilon: float | None = None  # the target epsilon z was calibrated for, if any

    @property
    def dp(self) -> bool:
        return self.noise is not None

    def flags(self, cfg: AuditConfig) -> list[str]:
        if self.noise is None:  # no DP: no bound on any phone's update, or the DP arms' clip
            if cfg.bound_norm is None:
                return ["--strategy", self.strategy, *self.normalizer(cfg), "--bound", "off"]
            return ["--strategy", self.strategy, *self.normalizer(cfg), "--bound", "fixed",
                    "--bound-norm", number(cfg.bound_norm)]  # fmt: skip
        mechanism = [] if self.mechanism == "gaussian" else ["--dp-mechanism", self.mechanism]
        return [
            "--strategy", self.strategy, *self.normalizer(cfg), "--dp-clip", number(cfg.dp_clip),
            "--dp-noise-multiplier", number(self.noise), *mechanism,
        ]  # fmt: skip

    def normalizer(self, cfg: AuditConfig) -> list[str]:
        """FedAtt's --fedatt-normalizer where the audit sets one."""
        if self.strategy != "fedatt" or cfg.fedatt_normalizer is None:
            return []
        return ["--fedatt-normalizer", cfg.fedatt_normalizer]


STRATEGIES = (("fedavg", "FedAvg"), ("fedatt", "FedAtt"))


def _dp_names(strategy: str, name: str, z: float, mech: str, eps: float | None) -> tuple[str, str]:
    """A DP arm's id and label: by its target epsilon where it has one (the privacy table's cell
    ids: fedavg-eps8, fedavg-blt-eps8), else by z (fedavg-dp-z1, fedavg-blt-z1)."""
    tag = "" if mech == "gaussian" else f" ({mech})"
    if eps is not None:
        prefix = "" if mech == "gaussian" else f"-{mech}"
        return f"{strategy}{prefix}-eps{eps:g}", f"DP-{name}{tag} eps {eps:g} (z {z:.3g})"
    prefix = "-dp" if mech == "gaussian" else f"-{mech}"
    return f"{strategy}{prefix}-z{z:g}", f"DP-{name}{tag} z {z:g}"


def arms(cfg: AuditConfig) -> list[Arm]:
    """FedAvg and FedAtt without DP (with `cfg.nodp_controls`, each beside its control), then
    with DP at each noise multiplier of `cfg`, each DP arm beside its control (the same run with
    nothing planted)."""
    if cfg.dp_epsilons and len(cfg.dp_epsilons) != len(cfg.dp_noise_multipliers):
        raise ValueError("give one target epsilon per noise multiplier, or none")
    kinds = [(s, s, name) for s, name in STRATEGIES]
    if cfg.fedatt_normalizer is not None:  # the privacy table's names: fedatt-fixed, (fixed)
        n = cfg.fedatt_normalizer
        kinds = [(f"{s}-{n}", s, f"{name} ({n})") if s == "fedatt" else (s, s, name)
                 for s, name in STRATEGIES]  # fmt: skip
    k_id, k_label = (f"-k{cfg.repeats}", f", k {cfg.repeats}") if cfg.name_repeats else ("", "")
    kinds = [(key + cfg.tag[0], s, name + cfg.tag[1]) for key, s, name in kinds]
    out = [Arm(key + k_id, name + k_label, s) for key, s, name in kinds]
    if cfg.nodp_controls:
        out += [
            Arm(f"{k}-control", f"{name}, not planted", s, planted=False) for k, s, name in kinds
        ]
    targets: tuple[float | None, ...] = cfg.dp_epsilons or (None,) * len(cfg.dp_noise_multipliers)
    for z, eps in zip(cfg.dp_noise_multipliers, targets, strict=True):
        for key, s, name in kinds:
            arm_id, label = _dp_names(key, name, z, cfg.dp_mechanism, eps)
            out.append(
                Arm(arm_id + k_id, label + k_label, s, z, mechanism=cfg.dp_mechanism, epsilon=eps)
            )
            out.append(
                Arm(
                    f"{arm_id}-control", f"{label}, not planted", s, z, False, cfg.dp_mechanism, eps
                )  # fmt: skip
            )
    return out


def command(arm: Arm, cfg: AuditConfig, run_dir: Path) -> list[str]:
    """The fedkey command line of one arm (without the interpreter), after `env NAME=value` for
    a canary format other than the default (FEDKEY_CANARY_FORMAT, _ALPHABET)."""
    flags = cfg.flags(cfg.repeats if arm.planted else 0)
    env = cfg.environment()
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return [*prefix, "fedkey", "simulate", *flags, *arm.flags(cfg), "--out", str(run_dir)]


def summarize(rows: list[dict], arm: Arm, clients: int) -> dict:
    """One results.json object from an arm's metrics rows (round 0 = the initial model)."""
    last, phone = rows[-1], canary_phone(clients)
    return {
        "id": arm.id,
        "label": arm.label,
        "strategy": arm.strategy,
        "dp": arm.dp,
        "noise_multiplier": arm.noise,
        "mechanism": arm.mechanism if arm.dp else None,
        "target_epsilon": arm.epsilon,
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
        "canary_rounds": [r["round"] for r in rows if aggregated(r, phone)],
        # Rounds whose cohort held it but whose outlier filter rejected its update (no DP only).
        "canary_rejected": [r["round"] for r in rows if phone in rejected(r)],
        "curve": [
            {
                "round": r["round"],
                "exposure": r["canary_exposure"],
                "rank": r["canary_rank"],
                "val_ppl": r["val_ppl"],
                "test_ppl": r["test_ppl"],
                "epsilon": r.get("epsilon"),
                "canary_phone": aggregated(r, phone),
            }
            for r in rows
        ],
    }


def rejected(row: dict) -> set[str]:
    """The phones whose update the round's cosine outlier filter rejected (info.clip.outliers:
    on by default without DP, fedkey.federation.strategies.outliers): uploaded, but not in the aggregate."""
    return set(((row.get("info") or {}).get("clip") or {}).get("outliers") or {})


def aggregated(row: dict, phone: str) -> bool:
    """Whether the round's aggregate holds `phone`'s update: uploaded and not rejected (rows
    written before the row's "uploaded" field listed the rejected phones as aggregated)."""
    return phone in row["aggregated"] and phone not in rejected(row)


def select(choices: list[Arm], only: list[str] | None) -> list[Arm]:
    """The arms named in `only`, in its order (all of them without)."""
    if not only:
        return choices
    by_id = {a.id: a for a in choices}
    unknown = [o for o in only if o not in by_id]
    if unknown:
        raise ValueError(
            f"no arm {', '.join(unknown)}; the arms are {', '.join(a.id for a in choices)}"
        )
    return [by_id[o] for o in dict.fromkeys(only)]
