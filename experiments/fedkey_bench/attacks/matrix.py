"""The matrix of `fedkey-bench attacks`: its strategies, defences, populations and attacks, the
settings every cell shares (:class:`Protocol`), and its cells."""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("fedavg", "fedatt")
#: The flags of each arm: "on" is the server's defaults, "clip" the defaults without the coordinate
#: trim and the cosine outlier filter (the clip and the caps alone), "off" turns every bound off.
DEFENCES: dict[str, tuple[str, ...]] = {
    "on": (),
    "clip": ("--trim", "0", "--outlier-z", "0"),
    "off": ("--bound", "off"),
}
POPULATIONS = ((10, 1), (30, 3))  # (phones, attackers)
ATTACKS = ("clean", "scale", "signflip", "backdoor")
#: Uploads the server refuses: checked at 1 of 10 with the defaults, against the clean run.
CHECKS = ("nan", "shape")


@dataclass(frozen=True)
class Protocol:
    """What every cell shares: the demo corpus, every phone selected every round."""

    rounds: int = 5
    local_epochs: int = 1
    max_eval_sentences: int = 300
    seed: int = 0
    workers: int | None = None  # training processes per run (None: one per core)
    backdoor: tuple[str, ...] = ()  # --backdoor-* flags beyond the defaults
    # auto would be bf16 on a CPU with avx512_bf16 and fp32 elsewhere: the arms compared in one
    # table must run at one precision, whatever machine runs each cell.
    precision: str = "fp32"

    def flags(self) -> list[str]:
        f = ["--data", "demo", "--partition", "iid", "--fraction", "1.0"]
        f += ["--precision", self.precision]
        f += ["--rounds", str(self.rounds), "--local-epochs", str(self.local_epochs)]
        f += ["--max-eval-sentences", str(self.max_eval_sentences), "--ksr-sentences", "0"]
        f += ["--seed", str(self.seed)]
        if self.workers is not None:
            f += ["--workers", str(self.workers)]
        return f


@dataclass(frozen=True)
class Cell:
    """One run of the matrix."""

    strategy: str
    defence: str  # a key of DEFENCES
    clients: int
    attackers: int
    attack: str  # clean | scale | signflip | backdoor | nan | shape

    @property
    def id(self) -> str:
        return f"{self.strategy}-{self.defence}-{self.attackers}of{self.clients}-{self.attack}"

    @property
    def population(self) -> str:
        return f"{self.attackers} of {self.clients}"

    @property
    def clean_id(self) -> str:
        """The clean run of the same arm (strategy, defence, phones)."""
        return f"{self.strategy}-{self.defence}-{self.attackers}of{self.clients}-clean"


def cells() -> list[Cell]:
    """The whole matrix: the 48 cells, then the refused-upload checks."""
    out = [
        Cell(s, d, n, m, a)
        for s in STRATEGIES
        for d in DEFENCES
        for n, m in POPULATIONS
        for a in ATTACKS
    ]
    n, m = POPULATIONS[0]
    return out + [Cell(s, "on", n, m, a) for s in STRATEGIES for a in CHECKS]
