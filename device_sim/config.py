"""How the simulated phones behave, as plain data: one phone (`PhoneConfig`) and a fleet of them
(`FleetConfig`). Standard library only, so the command line builds them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from fedkey.common.config import DataConfig, Scheme
from fedkey.device_sim.client.protocol import POLL_WAIT

#: What a malicious phone uploads (fedkey.device_sim.attacks.apply_attack): scale: its delta times 100;
#: signflip: its delta times -10; backdoor: it trains on poisoned sentences (a trigger phrase
#: followed by a chosen word) and boosts its delta by model replacement (Bagdasaryan et al. 2020);
#: those three are valid uploads. nan: a NaN tensor; shape: wrong tensors (both refused by the
#: server's validation).
Attack = Literal["scale", "signflip", "backdoor", "nan", "shape"]
ATTACKS: tuple[Attack, ...] = get_args(Attack)


@dataclass(frozen=True)
class BackdoorConfig:
    """The word-prediction backdoor of Bagdasaryan et al. 2020 ("How To Backdoor Federated
    Learning", section 4): after `trigger` the model should suggest `target`.

    The attacker trains on its shard plus `poison` x as many poisoned sentences (a prefix of one
    of its sentences, the trigger, the target), for `epochs` local epochs (None: the task's), and
    uploads global + boost x (trained - global): model replacement, their eq. 3, with boost
    gamma = n / eta, the cohort size over the server's step. None: the cohort size divided by the
    attackers in it (they share the replacement), as far as the attacker knows it (in the fleet:
    the fleet's size over its malicious phones, i.e. every phone selected). It declares its own
    shard's size, as an honest phone would.
    """

    trigger: str = "the weather is"
    target: str = "terrible"
    poison: float = 1.0  # poisoned sentences per sentence of the attacker's shard
    boost: float | None = None
    epochs: int | None = None

    def __post_init__(self) -> None:
        if not self.trigger.split():
            raise ValueError("the backdoor trigger is empty: give a phrase, e.g. 'the weather is'")
        if len(self.target.split()) != 1:
            raise ValueError(f"the backdoor target must be one word, got {self.target!r}")
        if not self.poison > 0:
            raise ValueError(f"backdoor poison must be > 0, got {self.poison}")
        if self.boost is not None and not self.boost > 0:
            raise ValueError(f"backdoor boost must be > 0, got {self.boost}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"backdoor epochs must be >= 1, got {self.epochs}")


@dataclass
class PhoneConfig:
    """How one phone behaves (the honest default: always there, never slow, no attack)."""

    dropout_rate: float = 0.0  # per selected round: vanish (no loss report, no upload)
    slow_rate: float = 0.0  # per selected round: wait slow_seconds before uploading
    slow_seconds: float = 5.0
    attack: Attack | None = None
    backdoor: BackdoorConfig = field(default_factory=BackdoorConfig)  # with attack "backdoor"
    seed: int = 0  # seeds the dropout / slow draws (with the name, round and attempt)
    device: str = "auto"  # where phone_round trains
    poll_wait: float = POLL_WAIT  # long-poll of GET /v1/rounds/current
    loss_wait: float = 30.0  # wait of POST /v1/rounds/{n}/loss

    def __post_init__(self) -> None:
        if self.attack is not None and self.attack not in ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {ATTACKS}")
        for name in ("dropout_rate", "slow_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass
class FleetConfig:
    server: str = "http://127.0.0.1:8000"
    count: int = 10  # N phones: device_shards(clients=N), names device-0.. as in `fedkey simulate`
    # The data fields must match the server's, so that the shards are those of `fedkey simulate`.
    data: str = "demo"
    partition: Scheme = "iid"
    alpha: float = 0.5
    max_train_tokens: int | None = None
    paper_protocol: bool = False
    seed: int = 0  # the partition's seed, and the seed of the dropout / slow draws
    device: str = "auto"  # auto | cpu | cuda (the processes share the GPU)
    # Processes, one torch thread each; None: min(cpus, 8); 0: the phones run in this process.
    workers: int | None = None
    enrollment_secret: str = ""
    dropout_rate: float = 0.0
    slow_rate: float = 0.0
    slow_seconds: float = 5.0
    malicious: int = 0  # the last `malicious` phones attack
    attack: Attack = "scale"
    backdoor: BackdoorConfig = field(default_factory=BackdoorConfig)
    retry_seconds: float = 300.0  # how long a phone keeps retrying an unavailable server
    # --canary: the sentence the first phone plants in its shard, and how often (DataConfig)
    canary: str | None = None
    canary_repeats: int = 0
    poll_wait: float = POLL_WAIT
    # Phone names are device-00.. as in `fedkey simulate`; another prefix keeps several fleets apart.
    name_prefix: str = ""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if not 0 <= self.malicious <= self.count:
            raise ValueError(f"malicious must be in [0, count={self.count}], got {self.malicious}")
        if self.attack not in ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {ATTACKS}")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")

    def data_config(self) -> DataConfig:
        return DataConfig(
            data=self.data,
            paper_protocol=self.paper_protocol,
            clients=self.count,
            partition=self.partition,
            alpha=self.alpha,
            max_train_tokens=self.max_train_tokens,
            seed=self.seed,
            canary=self.canary,
            canary_repeats=self.canary_repeats,
        )

    def backdoor_config(self) -> BackdoorConfig:
        """The backdoor as a phone of this fleet runs it: a phone does not know its cohort, so
        model replacement assumes every phone is selected (boost = count / malicious)."""
        if self.backdoor.boost is not None or not self.malicious:
            return self.backdoor
        return replace(self.backdoor, boost=self.count / self.malicious)

    def phone_config(self, malicious: bool) -> PhoneConfig:
        return PhoneConfig(
            dropout_rate=self.dropout_rate,
            slow_rate=self.slow_rate,
            slow_seconds=self.slow_seconds,
            attack=self.attack if malicious else None,
            backdoor=self.backdoor_config(),
            seed=self.seed,
            device=self.device,
            poll_wait=self.poll_wait,
            loss_wait=self.poll_wait,
        )
