"""Everything `fedkey server` is configured by, in one pydantic-settings class.

Every field can be set from the environment with the prefix ``FEDKEY_`` (``FEDKEY_ROUNDS=20``,
``FEDKEY_ENROLLMENT_SECRET=...``, ``FEDKEY_DATABASE_URL=postgresql+psycopg://...``) or passed as
a keyword. The helpers build the engine's own dataclasses (DataConfig, ModelConfig,
FederationConfig) the same way `fedkey simulate` does, so a server and a simulation with the same
settings run the same federation.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fedkey.common.config import Batching, DataConfig, Precision, TokenizerKind, TrainConfig
from fedkey.federation.config import (
    AggregateIn,
    AttentionNormalizer,
    ClipMode,
    ClipScope,
    DPMechanism,
    DPSampling,
    EnrollmentMode,
    FederationConfig,
    InfluenceConfig,
    Norm,
    PrivacyConfig,
    ServerOptConfig,
    ServerOptName,
    StrategyName,
    dp_problem,
)
from fedkey.models.canary import DEFAULT_ALPHABET, DEFAULT_TEMPLATE, CanaryFormat
from fedkey.models.config import Cell, ModelConfig, ModelOverrides, Preset

#: The longest a long-poll may wait (seconds), as in the HTTP contract.
MAX_WAIT = 60.0

# The defaults of every field below that is also a dataclass field are read from the dataclass,
# so `fedkey server` and `fedkey simulate` start from the same values.
_DATA = DataConfig()
_MODEL = ModelConfig(vocab_size=_DATA.vocab_size)
_FEDERATION = FederationConfig()
_SERVER_OPT = _FEDERATION.server_opt
_TRAIN = _FEDERATION.train
_PRIVACY = _FEDERATION.privacy
_INFLUENCE = _FEDERATION.influence


#: Where the server may evaluate (--eval-device, FEDKEY_EVAL_DEVICE): the evaluator is tested on
#: the CPU and CUDA only.
EVAL_DEVICES = r"auto|cpu|cuda(:\d+)?"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FEDKEY_", extra="forbid")

    # -- data: the server's side (tokenizer + evaluation text), as DataConfig -----------------
    data: str = _DATA.data
    paper_protocol: bool = _DATA.paper_protocol
    tokenizer: TokenizerKind = _DATA.tokenizer
    vocab_size: int = Field(_DATA.vocab_size, ge=4)
    tokenizer_text: str | None = _DATA.tokenizer_text  # SentencePiece: public text it is trained on
    max_train_tokens: int | None = Field(_DATA.max_train_tokens, ge=1)
    max_eval_sentences: int | None = Field(_DATA.max_eval_sentences, ge=1)
    seed: int = _DATA.seed  # also the federation's seed

    # -- model ---------------------------------------------------------------------------------
    model: Preset = "small"
    hidden_size: int | None = Field(None, ge=1)  # overrides the preset's size (emb = hidden)
    cell: Cell = _MODEL.cell
    layers: int = Field(_MODEL.num_layers, ge=1, le=4)
    tied: bool = _MODEL.tied
    dropout: float = Field(_MODEL.dropout, ge=0.0, le=0.9)

    # -- federation ----------------------------------------------------------------------------
    strategy: StrategyName = _FEDERATION.strategy
    epsilon: float | None = None  # fedatt / fedattopt server step (strategy default 1.2)
    # fedattopt: a round's reach at most this many times FedAvg's (None: the paper's step)
    max_reach: float | None = Field(None, gt=0)
    norm: Norm = "l2"  # fedatt distance
    # fedatt's normalizer: the softmax, or the fixed count m (under DP, DP-FedAvg's sensitivity)
    fedatt_normalizer: AttentionNormalizer = "softmax"
    eta: float = 1.0  # fedmed step
    epsilon_med: float = 0.1  # fedmed mediation threshold
    topk_beta: float = Field(1.0, gt=0.0, le=1.0)  # fedmed topK share of uploaders (1 = off)
    adafl: bool = False  # AdaFL client selection
    fraction: float = Field(_FEDERATION.fraction, gt=0.0, le=1.0)
    rounds: int = Field(_FEDERATION.rounds, ge=1)
    # the server optimizer, on the aggregate's pseudo-gradient
    server_opt: ServerOptName = _SERVER_OPT.name
    server_lr: float = Field(_SERVER_OPT.lr, gt=0)
    server_momentum: float = Field(_SERVER_OPT.momentum, ge=0, lt=1)  # FedAvgM beta / Adam beta1
    # round r's server lr = server_lr * server_lr_decay ** (r - 1)
    server_lr_decay: float = Field(_SERVER_OPT.lr_decay, gt=0, le=1)
    # round r's local lr = lr * lr_decay ** (r - 1)
    lr_decay: float = Field(_FEDERATION.lr_decay, gt=0, le=1)
    # keystroke savings measured on N test sentences
    ksr_sentences: int = Field(_FEDERATION.ksr_sentences, ge=0)
    # checkpoints kept: 0 every round's, N the latest N rounds' and the best round's
    keep_checkpoints: int = Field(_FEDERATION.keep_checkpoints, ge=0)
    # where the global model is evaluated: auto (the GPU where torch sees one), cpu, cuda[:N]
    eval_device: str = Field(_FEDERATION.eval_device, pattern=f"^({EVAL_DEVICES})$")

    # -- round lifecycle -----------------------------------------------------------------------
    round_deadline: float = Field(600.0, gt=0)  # seconds from a round's opening
    upload_grace: float = Field(60.0, gt=0)  # topK decided at the deadline: time left to upload
    quorum: int | None = Field(None, ge=1)  # min updates at the deadline (absolute) ...
    quorum_fraction: float = Field(0.5, gt=0.0, le=1.0)  # ... else ceil(q * expected uploads)
    wait_devices: int = Field(1, ge=1)  # round 1 opens once this many devices enrolled
    exit_when_done: bool = False
    # exit_when_done: how long the finished server waits for every enrolled device to hear
    # "finished" (a phone in a retry backoff, up to 10 s, would otherwise find it gone)
    finish_linger: float = Field(20.0, ge=0)

    # -- local training (the task sent to devices) -----------------------------------------------
    local_epochs: int = Field(_TRAIN.epochs, ge=1)
    batch_size: int = Field(_TRAIN.batch_size, ge=1)
    lr: float = Field(_TRAIN.lr, gt=0)  # the seed papers' 0.01 learns far slower
    momentum: float = Field(_TRAIN.momentum, ge=0)
    clip: float = Field(_TRAIN.clip, ge=0)
    max_len: int = Field(_TRAIN.max_len, ge=2)
    # columns: the batches of the seed papers' code
    batching: Batching = _TRAIN.batching
    # the arithmetic of the phones' training (sent in the task) and of the server's evaluation
    precision: Precision = _TRAIN.precision

    # -- privacy ---------------------------------------------------------------------------------
    dp_beta: float = Field(_PRIVACY.beta, ge=0)
    dp_sigma: float = Field(_PRIVACY.sigma, ge=0)
    dp_clip: float | None = Field(_PRIVACY.clip_norm, gt=0)
    dp_noise_multiplier: float = Field(_PRIVACY.noise_multiplier, ge=0)
    dp_delta: float | None = Field(_PRIVACY.delta, gt=0, lt=1)  # None: 1 / N^1.1 for N phones
    dp_target_epsilon: float | None = Field(_PRIVACY.target_epsilon, gt=0)
    dp_sampling: DPSampling = _PRIVACY.sampling
    dp_mechanism: DPMechanism = _PRIVACY.mechanism  # gaussian (DP-FedAvg), tree or blt (DP-FTRL)
    dp_min_separation: int | None = Field(_PRIVACY.min_separation, ge=1)  # tree, blt: rounds apart
    # adaptive clipping (fedkey.federation.privacy.adaptive_clip): the clip follows this quantile of update norms
    dp_clip_quantile: float | None = Field(_PRIVACY.clip_quantile, gt=0, lt=1)
    dp_clip_lr: float = Field(_PRIVACY.clip_lr, gt=0)  # eta_C of its geometric update
    dp_clip_count_stddev: float | None = Field(_PRIVACY.clip_count_stddev, ge=0)  # sigma_b
    # the noise's secret: None, from the operating system; a passphrase: reproducible noise
    dp_secret: SecretStr | None = Field(None, min_length=1, repr=False)
    dp_publish_scores: bool = _PRIVACY.publish_scores  # held-out scores published under DP too

    # -- bounded influence (fedkey.federation.influence.bounding) ----------------------------------------------------
    bound: ClipMode = _INFLUENCE.mode
    bound_norm: float | None = Field(_INFLUENCE.norm, gt=0)
    bound_multiple: float = Field(_INFLUENCE.multiple, gt=0)
    bound_scope: ClipScope = _INFLUENCE.scope
    attention_temperature: float = Field(_INFLUENCE.temperature, gt=0)
    weight_cap: float = Field(_INFLUENCE.weight_cap, gt=0)
    trim: float | None = Field(_INFLUENCE.trim, ge=0, lt=0.5)
    outlier_z: float | None = Field(_INFLUENCE.outlier_z, ge=0)
    # The largest sample count a phone may declare (enrollment, loss report, upload): 422 past it.
    max_samples: int = Field(100_000_000, ge=1, le=2**62)

    # -- memorization audit (fedkey.models.canary, fedkey.models.exposure) ----------------------------------------
    # canary: a secret drawn (with `seed`) from the format goes canary_repeats times into the first
    # phone's shard, and every metrics row has its exposure. The format has no flag:
    # FEDKEY_CANARY_FORMAT ('_' marks a slot), FEDKEY_CANARY_ALPHABET (the words a slot takes).
    canary: bool = False
    canary_repeats: int = Field(20, ge=0)  # 0: a control, the exposure of a secret never planted
    canary_format: str = DEFAULT_TEMPLATE
    canary_alphabet: str = " ".join(DEFAULT_ALPHABET)

    # -- service ---------------------------------------------------------------------------------
    storage: Path = Path("runs/server")
    database_url: str | None = None  # default sqlite:///<storage>/fedkey.db
    # How devices enroll (fedkey.server.enrollment): "secret", with the shared enrollment secret or a
    # token the operator minted; "tokens", with a minted token only (one device each)
    enrollment: EnrollmentMode = "secret"
    # the shared secret; None: a random one is generated, in <storage>/enrollment_secret (0600)
    enrollment_secret: SecretStr | None = None
    max_devices: int | None = Field(None, ge=1)  # the most devices enrolled at once (a Sybil cap)
    # seconds a device's token works after its enrollment (then it enrolls again); None: always
    device_token_ttl: float | None = Field(None, gt=0, allow_inf_nan=False)
    # The operator's token: when set, GET /metrics (Prometheus), GET /v1/metrics and WS /v1/events
    # answer only `Authorization: Bearer <operator_token>` (401 otherwise); under DP it must be
    # set for GET /metrics, as the counters are exact counts of what the phones did
    operator_token: SecretStr | None = Field(None, min_length=16, repr=False)
    # GET /v1/model only with a device's token or the operator's (default: open to anyone)
    private_model: bool = False
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # HTTPS: the certificate (PEM, its chain after it) and its private key; None: plain HTTP
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_upload_margin: int = Field(65_536, ge=0)  # bytes allowed above the model's size
    # Upload bodies read at once; the others wait their turn with their bytes in the kernel's
    # socket buffers (up to fedkey.federation.updates.store.FLUSH_BYTES of each is in memory while read)
    max_receiving: int = Field(64, ge=1)
    # The slowest an upload body may come, in bytes per second, once it has a slot: a body must
    # end within 30 s plus (the model's size + max_upload_margin) / min_upload_rate, or 408
    min_upload_rate: float = Field(16_384.0, gt=0, allow_inf_nan=False)
    # Model download bodies sent at once (fedkey.server.api.routes_model); the others wait their turn
    # before their answer starts. Each body being sent is up to one event-loop step of
    # routes_model.YIELD_EVERY slices (about 0.37 ms) in every loop iteration, so this bounds
    # how late an iteration runs when a round opens and its cohort asks for the model at once
    # (unbounded, hundreds of steps made iterations of 0.1-0.3 s at 10,000 phones, issue 16):
    # 32 steps are about 12 ms an iteration. A download whose reader is behind (a slow link)
    # is no such step: it gives its slot to another until the reader has caught up.
    max_sending: int = Field(32, ge=1)
    # Seconds one slice of a download may wait for its reader (uvicorn's flow control waits
    # while the connection's buffer is full): past it the download is cut and the connection
    # closed, so a reader that stopped reading does not hold a max_sending slot for ever.
    send_timeout: float = Field(30.0, gt=0, allow_inf_nan=False)
    # export the global model to <dir>/model.onnx (+ .json) for the keyboard: the model of a
    # round whose validation perplexity is the best so far (the keyboard serves the best model
    # on validation), so a round that does worse leaves the export as it was
    export_dir: Path | None = None
    export_latest: bool = False  # export every round's model instead, better or not
    keep_uploads: bool = False  # keep uploads/round_XXXX/ after the round is aggregated
    # process: rounds are aggregated in a child process at a lower CPU priority, sharing no GIL
    # with the event loop (fedkey.server.aggregator); thread: in a thread of the server process
    aggregate_in: AggregateIn = "process"
    event_queue_size: int = Field(256, ge=1)  # per WebSocket subscriber; the oldest is dropped

    # -- limits (fedkey.server.runtime.rate_limit, uvicorn) ----------------------------------------------------
    # POST /v1/devices per client IP: a bucket of enroll_burst attempts refilled at enroll_rate a
    # second, 429 + Retry-After when empty (0: no limit). The defaults let 10,000 phones behind one
    # address enroll at once; a secret guesser gets 200 tries a second.
    enroll_rate: float = Field(200.0, ge=0)
    enroll_burst: int = Field(10_000, ge=1)
    # uvicorn: seconds an idle keep-alive connection is held (above a proxy's usual 60 s, so the
    # server is never the side that closes a connection the other is about to reuse) ...
    keep_alive: int = Field(75, ge=1)
    # ... connections + requests in flight before uvicorn answers 503 (long-polls count) ...
    limit_concurrency: int = Field(20_000, ge=1)
    # ... and h11's buffer for a request line + headers still unfinished: past it, 400 and closed
    max_header_bytes: int = Field(16_384, ge=1024)
    # ... and the seconds a connection may take from its opening (or, kept alive, from its next
    # request's first byte) to the end of a request's head: past them it is closed, so idle or
    # slowly-typed connections cannot pile up to limit_concurrency
    head_timeout: float = Field(15.0, gt=0, allow_inf_nan=False)
    # Long-polls (GET /v1/rounds/current?wait=) one device may have waiting at once (429 past)
    polls_per_device: int = Field(4, ge=1)
    # New HTTP requests that begin their work in one event-loop iteration (fedkey.server.runtime.admission);
    # the others wait their turn for a few ms, so a burst of arrivals cannot hold the loop for
    # one long iteration (/healthz and /metrics skip the queue). 0: no limit.
    admit_per_tick: int = Field(32, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.bound == "fixed" and self.bound_norm is None:
            raise ValueError("--bound fixed needs --bound-norm S")
        if self.max_reach is not None and self.strategy != "fedattopt":
            raise ValueError("--max-reach caps FedAttOpt's step: use it with --strategy fedattopt")
        if self.server_lr_decay != 1.0 and self.server_opt == "none":
            raise ValueError(
                "--server-lr-decay schedules a server optimizer's step: add --server-opt "
                "momentum or adam"
            )
        problem = dp_problem(
            self.strategy, self.privacy_config(), self.influence_config(), self.strategy_params()
        )
        if problem is not None:
            raise ValueError(problem)
        if self.canary:
            self.canary_spec()  # a malformed FEDKEY_CANARY_FORMAT / _ALPHABET, refused up front
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("HTTPS needs both --tls-cert and --tls-key")
        return self

    # -- the engine's dataclasses ----------------------------------------------------------------

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{Path(self.storage).resolve() / 'fedkey.db'}"

    @property
    def topk(self) -> bool:
        """Whether FedMed's topK picks the uploaders (else every selected device uploads)."""
        return self.strategy == "fedmed" and self.topk_beta < 1.0

    def data_config(self) -> DataConfig:
        """The server's DataConfig: every DataConfig field this class has (the phones' partition
        fields, clients/partition/alpha, keep their defaults: the server never cuts shards), and
        the canary sentence when the audit is on."""
        names = [
            f.name
            for f in dataclasses.fields(DataConfig)
            if f.name in type(self).model_fields and not f.name.startswith("canary")
        ]
        return DataConfig(
            **{name: getattr(self, name) for name in names},
            canary=self.canary_secret(),
            canary_repeats=self.canary_repeats if self.canary else 0,
        )

    def canary_spec(self) -> CanaryFormat:
        """The canary's format (a ValueError, one line, for a malformed one)."""
        return CanaryFormat.parse(self.canary_format, self.canary_alphabet)

    def canary_secret(self) -> str | None:
        """The planted secret, drawn from the format with the run's seed; None without --canary."""
        return self.canary_spec().draw(self.seed) if self.canary else None

    def build_model_config(self, vocab_size: int) -> ModelConfig:
        extra = ModelOverrides(
            cell=self.cell, num_layers=self.layers, tied=self.tied, dropout=self.dropout
        )
        if self.hidden_size is not None:
            return ModelConfig(
                vocab_size=vocab_size,
                emb_size=self.hidden_size,
                hidden_size=self.hidden_size,
                **extra,
            )
        return ModelConfig.preset(self.model, vocab_size, **extra)

    def strategy_params(self) -> dict:
        """The strategy's options, chosen as `fedkey simulate` chooses them."""
        params: dict = {}
        if self.strategy in ("fedatt", "fedattopt") and self.epsilon is not None:
            params["epsilon"] = self.epsilon
        if self.strategy == "fedattopt" and self.max_reach is not None:
            params["max_reach"] = self.max_reach
        if self.strategy == "fedatt":
            params["norm"] = self.norm
            params["normalizer"] = self.fedatt_normalizer
        if self.strategy == "fedmed":
            params.update(eta=self.eta, epsilon_med=self.epsilon_med, beta=self.topk_beta)
        if self.adafl:
            params["selector"] = "adafl"
        return params

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            epochs=self.local_epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            momentum=self.momentum,
            clip=self.clip,
            max_len=self.max_len,
            batching=self.batching,
            precision=self.precision,
        )

    def privacy_config(self) -> PrivacyConfig:
        return PrivacyConfig(
            beta=self.dp_beta,
            sigma=self.dp_sigma,
            clip_norm=self.dp_clip,
            noise_multiplier=self.dp_noise_multiplier,
            delta=self.dp_delta,
            target_epsilon=self.dp_target_epsilon,
            sampling=self.dp_sampling,
            mechanism=self.dp_mechanism,
            min_separation=self.dp_min_separation,
            clip_quantile=self.dp_clip_quantile,
            clip_lr=self.dp_clip_lr,
            clip_count_stddev=self.dp_clip_count_stddev,
            secret=self.dp_secret.get_secret_value() if self.dp_secret is not None else None,
            publish_scores=self.dp_publish_scores,
        )

    def influence_config(self) -> InfluenceConfig:
        return InfluenceConfig(
            mode=self.bound,
            norm=self.bound_norm,
            multiple=self.bound_multiple,
            scope=self.bound_scope,
            temperature=self.attention_temperature,
            weight_cap=self.weight_cap,
            trim=self.trim,
            outlier_z=self.outlier_z,
        )

    def federation_config(self) -> FederationConfig:
        return FederationConfig(
            strategy=self.strategy,
            strategy_params=self.strategy_params(),
            fraction=self.fraction,
            rounds=self.rounds,
            seed=self.seed,
            train=self.train_config(),
            privacy=self.privacy_config(),
            influence=self.influence_config(),
            server_opt=ServerOptConfig(
                self.server_opt,
                lr=self.server_lr,
                momentum=self.server_momentum,
                lr_decay=self.server_lr_decay,
            ),
            lr_decay=self.lr_decay,
            ksr_sentences=self.ksr_sentences,
            keep_checkpoints=self.keep_checkpoints,
            eval_device=self.eval_device,
        )

    def quorum_for(self, expected: int) -> int:
        """Updates needed at the deadline when `expected` uploads were asked for."""
        if expected <= 0:
            return 1
        q = self.quorum if self.quorum is not None else math.ceil(self.quorum_fraction * expected)
        return max(1, min(expected, q))
