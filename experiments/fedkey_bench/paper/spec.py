"""What one run of `fedkey-bench paper` is (RunSpec), and how its recorded command line is read
back; shared by the suites (fedkey_bench.paper.suites) and the report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DATASETS = ("ptb", "wikitext-2")


@dataclass(frozen=True)
class RunSpec:
    """One run of a suite: the command it is and where its number goes in the tables."""

    suite: str
    dataset: str  # a folder under the data root, or "demo"
    method: str  # the label of the table row
    fraction: float | None  # C; None where the method picks its own (AdaFL)
    args: tuple[str, ...] = ()  # flags beyond the preset's
    kind: str = "federated"  # federated | central | ngram
    group: str = ""  # a column or sweep key inside a suite (privacy: beta / z; sweep: knob=value)
    full_train: bool = False  # all of the training split, whatever the preset's cut
    full_eval: bool = False  # all of the validation and test splits, whatever the preset's cut
    lr: float | None = None  # the local lr, where not the preset's (chosen by the sweep)
    rounds: int | None = None  # the rounds, where not the preset's (the sweep's short runs)
    partition: str = "iid"
    clients: int = 100
    seed: int = 0  # --seed: the phones' shares of the data, the initial weights, who trains when
    tag: str = ""  # one more run of the same row in a suite, named in its id (dropout: "lr10")
    # --paper-protocol (the vocabulary from all three splits); the real suite's runs build it
    # from the training split, as the server's would be
    paper_protocol: bool = True

    def fields(self) -> dict:
        """What a results.json object says of the run's place in the bench (suite, method, C...):
        set by the spec, not by the run."""
        return {"suite": self.suite, "dataset": self.dataset, "method": self.method,
                "fraction": self.fraction, "group": self.group, "kind": self.kind,
                "partition": self.partition, "seed": self.seed}  # fmt: skip

    @property
    def id(self) -> str:
        c = "auto" if self.fraction is None else f"c{self.fraction:g}"
        slug = re.sub(r"[^a-z0-9]+", "-", self.method.lower()).strip("-")
        return (
            f"{self.suite}-{self.dataset}-{slug}-{c}"
            + (f"-seed{self.seed}" if self.seed else "")
            + (f"-{self.tag}" if self.tag else "")
        )


def fed(suite, dataset, method, fraction, *args, group="", full_train=False):
    """A federated run of `method` at C `fraction` with the flags `args` beyond the preset's."""
    return RunSpec(
        suite, dataset, method, fraction, tuple(args), group=group, full_train=full_train
    )


def command_flag(cmd: str, *flags: str) -> str:
    """The value of a flag in a recorded command line, given under any of `flags` (a flag and its
    short form), "-" where it has none (the last one wins, as in the CLI)."""
    words = cmd.split()
    at = [i for i, w in enumerate(words[:-1]) if w in flags]
    return words[at[-1] + 1] if at else "-"
