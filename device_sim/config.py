"""How the simulated phones behave, as plain data: one phone (`PhoneConfig`) and a fleet of them
(`FleetConfig`). Standard library only, so the command line builds them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from common.config import DataConfig, Scheme

#: What a malicious phone uploads: scale: its delta times 100 (a valid upload); nan: a NaN
#: tensor; shape: wrong tensors.
Attack = Literal["scale", "nan", "shape"]
ATTACKS: tuple[Attack, ...] = get_args(Attack)


@dataclass
class PhoneConfig:
    """How one phone behaves (the honest default: always there, never slow, no attack)."""

    dropout_rate: float = 0.0  # per selected round: vanish (no loss report, no upload)
    slow_rate: float = 0.0  # per selected round: wait slow_seconds before uploading
    slow_seconds: float = 5.0
    attack: Attack | None = None
    seed: int = 0  # seeds the dropout / slow draws (with the name, round and attempt)
    device: str = "auto"  # where phone_round trains
    poll_wait: float = 30.0  # long-poll of GET /v1/rounds/current
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
    retry_seconds: float = 300.0  # how long a phone keeps retrying an unavailable server
    poll_wait: float = 30.0
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
        )

    def phone_config(self, malicious: bool) -> PhoneConfig:
        return PhoneConfig(
            dropout_rate=self.dropout_rate,
            slow_rate=self.slow_rate,
            slow_seconds=self.slow_seconds,
            attack=self.attack if malicious else None,
            seed=self.seed,
            device=self.device,
            poll_wait=self.poll_wait,
            loss_wait=self.poll_wait,
        )
