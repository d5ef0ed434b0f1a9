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
from fedkey.models.base import (
    FIXED_BY_BASE,
    base_conflicts,
    base_model_config,
    ngram_path,
    read_base,
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
    """Every option of the federation and of its server, each declared once: its type, default,
    bounds and description. `fedkey simulate`, `server` and `run` build their flags from these
    fields (fedkey.cli.options), and reference/configuration.md lists them."""

    model_config = SettingsConfigDict(env_prefix="FEDKEY_", extra="forbid")

    # Each field and its description in as few lines as they fit (they are the flags' help):
    # fmt: off

    # -- data: the server's side (tokenizer + evaluation text), as DataConfig -----------------
    data: str = Field(_DATA.data,
        description="'demo' (the embedded corpus), 'chitchat' or 'chitchat-heldout' (public chat: "
        "its pretraining senders, the others), 'nus-sms' or 'ubuntu-irc' (real corpora in the "
        "data directory: fedkey data fetch), or a directory: train/valid/test.txt (PTB, "
        "WikiText-2), one .txt per user, a .jsonl of {user, text}, or a StackExchange Posts.xml.")
    paper_protocol: bool = Field(_DATA.paper_protocol,
        description="The seed papers' preprocessing: lowercase, split lines on ' . ', vocabulary "
        "from all splits.")
    tokenizer: TokenizerKind = Field(_DATA.tokenizer,
        description="Word vocabulary or SentencePiece.")
    vocab_size: int = Field(_DATA.vocab_size, ge=4,
        description="Maximum vocabulary size (specials included).")
    tokenizer_text: str | None = Field(_DATA.tokenizer_text,
        description="SentencePiece: public text the server trains it on (.txt or a corpus dir); "
        "never the phones' data. The demo has its own.")
    max_train_tokens: int | None = Field(_DATA.max_train_tokens, ge=1,
        description="Keep only the first N training words (reduced CPU runs).")
    max_eval_sentences: int | None = Field(_DATA.max_eval_sentences, ge=1,
        description="Keep only the first N validation and test sentences.")
    seed: int = Field(_DATA.seed,
        description="Seeds partitioning, initialization, selection, training and noise.")

    # -- model ---------------------------------------------------------------------------------
    model: Preset = Field("small",
        description="Size preset: small 300, medium 650, large 1500 (embedding = hidden).")
    hidden_size: int | None = Field(None, ge=1,
        description="Embedding and hidden size, overriding the preset's.")
    cell: Cell = Field(_MODEL.cell, description="Recurrent cell.")
    layers: int = Field(_MODEL.num_layers, ge=1, le=4, description="Recurrent layers.")
    tied: bool = Field(_MODEL.tied, description="Share input and output embeddings.")
    dropout: float = Field(_MODEL.dropout, ge=0.0, le=0.9,
        description="Dropout on embeddings and outputs.")
    init: str | None = Field(_DATA.init,
        description="Start from this base checkpoint (fedkey pretrain: a model of public text; "
        "'base': the one that ships with fedkey): its weights, its model and its vocabulary, "
        "which encodes the phones' text; round 0 scores it. Refuses a --model, --hidden-size, --cell, --layers, --tied/--untied, "
        "--tokenizer, --vocab-size or --tokenizer-text that differs from it.")
    ngram: str | None = Field(_FEDERATION.ngram,
        description="A Kneser-Ney n-gram (fedkey pretrain writes OUT/ngram.safetensors; 'base': "
        "the shipped base's) that the keyboard mixes with the model; each round's row then also "
        "scores the mixture (ngram_weight, mix_*). Its vocabulary must be the model's.")

    # -- federation ----------------------------------------------------------------------------
    strategy: StrategyName = Field(_FEDERATION.strategy, description="Aggregation method.")
    epsilon: float | None = Field(None,
        description="Server step size of fedatt / fedattopt (default 1.2).")
    max_reach: float | None = Field(None, gt=0,
        description="fedattopt: cap a round's step at this many times FedAvg's (1: never past the "
        "phones' mean; default: the paper's step, whose reach grows as updates shrink).")
    norm: Norm = Field("l2", description="fedatt distance: l2 (flattened) or spectral.")
    fedatt_normalizer: AttentionNormalizer = Field("softmax",
        description="fedatt: softmax (the paper's) or fixed: the same relative weights over the "
        "cohort's count m, whose DP noise is DP-FedAvg's.")
    eta: float = Field(1.0, description="fedmed step size (1 = weighted average).")
    epsilon_med: float = Field(0.1,
        description="fedmed mediation threshold on the change of mean loss.")
    topk_beta: float = Field(1.0, gt=0.0, le=1.0,
        description="fedmed topK: share of trained phones that upload (1 = off; paper best 0.8).")
    adafl: bool = Field(False,
        description="AdaFL attention-based client selection with a dynamic fraction (0.1 -> 0.5).")
    fraction: float = Field(_FEDERATION.fraction, gt=0.0, le=1.0,
        description="Share of phones selected per round (fedsgd uses all).")
    rounds: int = Field(_FEDERATION.rounds, ge=1, description="Federated rounds.")
    server_opt: ServerOptName = Field(_SERVER_OPT.name,
        description="Server optimizer on the aggregate's pseudo-gradient: momentum (FedAvgM) or "
        "adam (FedAdam).")
    server_lr: float = Field(_SERVER_OPT.lr, gt=0, description="Server optimizer step size.")
    server_momentum: float = Field(_SERVER_OPT.momentum, ge=0, lt=1,
        description="FedAvgM momentum / FedAdam beta1.")
    server_lr_decay: float = Field(_SERVER_OPT.lr_decay, gt=0, le=1,
        description="Server lr schedule: round r steps with server lr * decay^(r-1) (1 = "
        "constant).")
    lr_decay: float = Field(_FEDERATION.lr_decay, gt=0, le=1,
        description="Local lr schedule: round r (train-central: epoch r) trains with lr * "
        "decay^(r-1) (1 = constant).")
    ksr_sentences: int = Field(_FEDERATION.ksr_sentences, ge=0,
        description="Keystroke savings are measured on the first N test sentences (0: off).")
    eval_topk: bool = Field(_FEDERATION.eval_topk,
        description="Score the test set's top-1/top-3 (the bar's and the model's) every round "
        "(--no-eval-topk: its perplexity only, as Flower's and pfl-research's examples score).")
    checkpoint_every: int = Field(_FEDERATION.checkpoint_every, ge=1,
        description="Write a round's checkpoint every N rounds, and always at a new best round "
        "and the last round; a resume runs the rounds after the last checkpoint again (not "
        "with DP, whose published rounds cannot be run again).")
    keep_checkpoints: int = Field(_FEDERATION.keep_checkpoints, ge=0,
        description="Checkpoints kept on disk: the latest N rounds' and the best round's (0: "
        "every round's; a round's model is 13.5 MB at a 10k vocabulary).")
    eval_device: str = Field(_FEDERATION.eval_device, pattern=f"^({EVAL_DEVICES})$",
        description="Where the server evaluates the global model each round: auto (CUDA when "
        "available), cpu or cuda.")

    # -- round lifecycle -----------------------------------------------------------------------
    round_deadline: float = Field(600.0, gt=0, description="Seconds a round stays open.")
    upload_grace: float = Field(60.0, gt=0,
        description="FedMed topK, decided at the deadline: the seconds the chosen phones have "
        "left to upload.")
    quorum: int | None = Field(None, ge=1,
        description="Updates needed to aggregate at the deadline (default: half of those asked).")
    quorum_fraction: float = Field(0.5, gt=0.0, le=1.0,
        description="Without a quorum: the updates needed at the deadline, this share of those "
        "asked (rounded up).")
    wait_devices: int = Field(1, ge=1,
        description="Round 1 opens once this many devices have enrolled.")
    exit_when_done: bool = Field(False, description="Exit once the last round is recorded.")
    finish_linger: float = Field(20.0, ge=0,
        description="With exit_when_done: the seconds the finished server waits for every "
        "enrolled device to hear 'finished' (a phone in a retry backoff, up to 10 s, would "
        "otherwise find it gone).")

    # -- local training (the task sent to devices) -----------------------------------------------
    local_epochs: int = Field(_TRAIN.epochs, ge=1, description="Local epochs per round.")
    batch_size: int = Field(_TRAIN.batch_size, ge=1, description="Sentences per batch.")
    lr: float = Field(_TRAIN.lr, gt=0,
        description="Local SGD learning rate (the seed papers use 0.01, which learns far slower).")
    momentum: float = Field(_TRAIN.momentum, ge=0, description="Local SGD momentum.")
    clip: float = Field(_TRAIN.clip, ge=0,
        description="Gradient-norm clipping in local training (0: off).")
    max_len: int = Field(_TRAIN.max_len, ge=2,
        description="Longer sentences are cut into chunks of this many tokens (training only).")
    batching: Batching = Field(_TRAIN.batching,
        description="sentences: language modelling. columns: the batches the seed papers' "
        "published code trained on (token j of each sentence in a batch, cut to the shortest), to "
        "reproduce their numbers; adds their column perplexity to the metrics.")
    precision: Precision = Field(_TRAIN.precision,
        description="Arithmetic of local training (sent to the phones in the task) and of "
        "evaluation: bf16 mixed precision (bf16 autocast, fp32 weights, loss and updates), fp32, "
        "or auto: bf16 where the hardware has it natively (a CUDA GPU with bf16, a CPU with "
        "AVX512-BF16 or AMX), else fp32; each phone resolves auto on its own hardware.")

    # -- privacy ---------------------------------------------------------------------------------
    dp_beta: float = Field(_PRIVACY.beta, ge=0,
        description="The seed papers' randomization: each phone adds beta * N(0, sigma^2) to its "
        "weights (sigma: dp_sigma, default 1; no formal guarantee).")
    dp_sigma: float = Field(_PRIVACY.sigma, ge=0,
        description="The standard deviation sigma of the seed papers' randomization: beta * N(0, "
        "sigma^2).")
    dp_clip: float | None = Field(_PRIVACY.clip_norm, gt=0,
        description="DP: clip each update to this L2 norm S and add noise calibrated to the "
        "strategy's sensitivity (turns DP on; fedavg, fedatt, fedattopt, fedmed).")
    dp_noise_multiplier: float | None = Field(_PRIVACY.noise_multiplier, ge=0,
        description="DP noise multiplier z: N(0, (z * sensitivity)^2) on the aggregate. Default: "
        "with --dp-target-epsilon, calibrated before round 1 (the smallest z, to 3 significant "
        "digits, whose epsilon after --rounds rounds is at most the target); else 1.0.")
    dp_delta: float | None = Field(_PRIVACY.delta, gt=0, lt=1,
        description="DP delta for the reported epsilon (default: 1 / N^1.1 for N phones).")
    dp_target_epsilon: float | None = Field(_PRIVACY.target_epsilon, gt=0,
        description="DP budget: without --dp-noise-multiplier, z is calibrated so that the "
        "planned --rounds end at this epsilon (for the phones, cohorts and mechanism of the run); "
        "either way the run stops before epsilon would pass it.")
    dp_sampling: DPSampling = Field(_PRIVACY.sampling,
        description="How DP cohorts are drawn and accounted: fixed (a fixed-size sample, "
        "replace-one) or poisson (each phone with probability C, add/remove-one; fedavg/fedsgd "
        "only).")
    dp_mechanism: DPMechanism = Field(_PRIVACY.mechanism,
        description="How DP noise is added: gaussian (DP-FedAvg: fresh noise each round on "
        "sampled cohorts), tree (DP-FTRL, as Gboard trains: tree-aggregated noise on the running "
        "sum of the rounds' aggregates; no sampling, a minimum separation instead) or blt "
        "(DP-FTRL with BLT matrix-factorization noise, correlated across rounds; the same rule; "
        "factorizations shipped for runs of up to a fixed number of rounds).")
    dp_min_separation: int | None = Field(_PRIVACY.min_separation, ge=1,
        description="With --dp-mechanism tree or blt: a phone that trained in round r trains "
        "again no earlier than round r + b, and the accounting assumes it (default: the largest b "
        "the population allows, floor(phones / cohort)).")
    dp_clip_quantile: float | None = Field(_PRIVACY.clip_quantile, gt=0, lt=1,
        description="DP adaptive clipping (Andrew et al. 2021): the clip starts at --dp-clip and "
        "follows this quantile of the update norms (e.g. 0.5), from a noised count of the "
        "unclipped updates; the update noise is raised so the total stays at z (off: a fixed "
        "clip).")
    dp_clip_lr: float = Field(_PRIVACY.clip_lr, gt=0,
        description="With --dp-clip-quantile: the clip's learning rate eta_C, C <- C exp(-eta_C "
        "(noised unclipped fraction - quantile)).")
    dp_clip_count_stddev: float | None = Field(_PRIVACY.clip_count_stddev, ge=0,
        description="With --dp-clip-quantile: the count's noise sigma_b (default: the expected "
        "cohort / 20); it must exceed z (z / 2 with --dp-sampling poisson).")
    dp_secret: SecretStr | None = Field(None, min_length=1, repr=False,
        description="DP: a passphrase the noise and the sampled cohorts are drawn from, for "
        "research runs that must be reproducible (their rows say noise_reproducible: true; "
        "whoever knows it can remove the noise). Default: 256 bits from the operating system, "
        "kept in RUN_DIR/secret.key (0600).")
    dp_publish_scores: bool = Field(_PRIVACY.publish_scores,
        description="DP: publish the perplexities, top-k and keystroke savings on the held-out "
        "text too (and export the round best on validation), outside what epsilon covers: for a "
        "demonstration whose epsilon bounds nothing anyway.")

    # -- bounded influence (fedkey.federation.influence.bounding) --------------------------------
    bound: ClipMode = Field(_INFLUENCE.mode,
        description="Bounded influence: clip every update on the server to a multiple of the "
        "round's median norm (adaptive), to --bound-norm (fixed), or not at all (off: the "
        "papers').")
    bound_norm: float | None = Field(_INFLUENCE.norm, gt=0,
        description="The L2 bound S of --bound fixed.")
    bound_multiple: float = Field(_INFLUENCE.multiple, gt=0,
        description="--bound adaptive: S = this multiple of the round's median update norm.")
    bound_scope: ClipScope = Field(_INFLUENCE.scope,
        description="Clip the whole model's update, or each layer's (sum of S_l^2 = S^2).")
    attention_temperature: float = Field(_INFLUENCE.temperature, gt=0,
        description="Attention cap T: scores / (T S), so no weight exceeds e^(1/T) / (e^(1/T) + m "
        "- 1).")
    weight_cap: float = Field(_INFLUENCE.weight_cap, gt=0,
        description="A phone's FedAvg weight n_k counts at most this multiple of the round's "
        "median.")
    trim: float | None = Field(_INFLUENCE.trim, ge=0, lt=0.5,
        description="Coordinate trim beta: before the clip, clamp each coordinate of each update "
        "to the range of the round's values without their ceil(beta m) lowest and highest "
        "(default 0.1; 0 under DP, which refuses it).")
    outlier_z: float | None = Field(_INFLUENCE.outlier_z, ge=0,
        description="Cosine outlier filter: reject an update whose mean cosine to the round's "
        "others is this many modified z-scores below the median (fewer than half the phones; "
        "default 3.5; 0 turns it off; off under DP, which refuses it).")
    max_samples: int = Field(100_000_000, ge=1, le=2**62,
        description="The largest sample count a phone may declare (enrollment, loss report, "
        "upload): 422 past it.")

    # -- memorization audit (fedkey.models.canary, fedkey.models.exposure) -----------------------
    canary: bool = Field(False,
        description="Memorization audit: plant a random secret (drawn with --seed from "
        "FEDKEY_CANARY_FORMAT, default 'my secret is _ _ _ _' over one..ten) in the first phone's "
        "shard; every round reports its exposure in bits (Carlini et al. 2019).")
    canary_repeats: int = Field(20, ge=0,
        description="Copies of the canary in the first phone's shard (with --canary; 0: a "
        "control, the exposure of a secret no phone holds).")
    canary_format: str = Field(DEFAULT_TEMPLATE,
        description="The canary's template, '_' marking a slot.")
    canary_alphabet: str = Field(" ".join(DEFAULT_ALPHABET),
        description="The words a canary slot takes, space-separated.")

    # -- service ---------------------------------------------------------------------------------
    storage: Path = Field(Path("runs/server"),
        description="Run directory: database, checkpoints/, metrics.jsonl, uploads.")
    database_url: str | None = Field(None,
        description="SQLAlchemy URL (default: SQLite in --storage, STORAGE/fedkey.db).")
    enrollment: EnrollmentMode = Field("secret",
        description="secret: devices enroll with the shared secret or a token minted by `fedkey "
        "enroll-tokens`; tokens: with a minted token only, one device each.")
    enrollment_secret: SecretStr | None = Field(None,
        description="Devices present it to enroll (default: a random one, written to "
        "STORAGE/enrollment_secret, readable by you alone).")
    max_devices: int | None = Field(None, ge=1,
        description="The most devices enrolled at once (403 past it; a Sybil cap); default: no "
        "cap.")
    device_token_ttl: float | None = Field(None, ge=1.0, allow_inf_nan=False,
        description="Seconds a device's token works after it enrolls, then it enrolls again; "
        "default: for ever.")
    operator_token: SecretStr | None = Field(None, min_length=16, repr=False,
        description="The operator's token: when set, GET /metrics (Prometheus), GET /v1/metrics "
        "and WS /v1/events answer only `Authorization: Bearer <operator_token>` (401 otherwise); "
        "under DP it must be set for GET /metrics, as the counters are exact counts of what the "
        "phones did.")
    private_model: bool = Field(False,
        description="GET /v1/model only with a device's token or the operator's (default: open to "
        "anyone).")
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0: any free port).")
    tls_cert: Path | None = Field(None,
        description="Serve HTTPS with this certificate (PEM, its chain after it; phones check it "
        "against their trusted certificates, or SSL_CERT_FILE's).")
    tls_key: Path | None = Field(None, description="The certificate's private key.")
    max_upload_margin: int = Field(65_536, ge=0,
        description="Bytes an upload may have above the model's size.")
    max_receiving: int = Field(64, ge=1,
        description="Upload bodies read at once; the others wait their turn with their bytes in "
        "the kernel's socket buffers (up to fedkey.federation.updates.store.FLUSH_BYTES of each "
        "is in memory while read).")
    min_upload_rate: float = Field(16_384.0, gt=0, allow_inf_nan=False,
        description="The slowest an upload body may come, in bytes per second, once it has a "
        "slot: a body must end within 30 s plus (the model's size + max_upload_margin) / "
        "min_upload_rate, or 408.")
    max_sending: int = Field(32, ge=1,
        description="Model download bodies sent at once (fedkey.server.api.routes_model); the "
        "others wait their turn before their answer starts. Each body being sent is one "
        "event-loop step of about 0.37 ms in every loop iteration, so this bounds how late an "
        "iteration runs when a round's cohort asks for the model at once (32: about 12 ms). A "
        "download whose reader is behind (a slow link) gives its slot to another until it has "
        "caught up.")
    send_timeout: float = Field(30.0, gt=0, allow_inf_nan=False,
        description="Seconds one slice of a download may wait for its reader (uvicorn's flow "
        "control waits while the connection's buffer is full): past it the download is cut and "
        "the connection closed, so a reader that stopped reading holds no max_sending slot for "
        "ever.")
    export_dir: Path | None = Field(None,
        description="Export the global model to DIR/model.onnx (+ model.json) for the keyboard: a "
        "round's model when its validation perplexity is the best so far (the keyboard serves the "
        "best model on validation).")
    export_latest: bool = Field(False,
        description="With --export-dir: export every round's model, better on validation or not.")
    keep_uploads: bool = Field(False,
        description="Keep uploads/round_XXXX/ after the round is aggregated.")
    aggregate_in: AggregateIn = Field("process",
        description="process: rounds are aggregated in a child process at a lower CPU priority, "
        "sharing no GIL with the event loop (fedkey.server.aggregator); thread: in a thread of "
        "the server process.")
    event_queue_size: int = Field(256, ge=1,
        description="Events queued per WebSocket subscriber; past it the oldest is dropped.")

    # -- limits (fedkey.server.runtime.rate_limit, uvicorn) --------------------------------------
    enroll_rate: float = Field(200.0, ge=0,
        description="POST /v1/devices per client IP: a bucket of enroll_burst attempts refilled "
        "at this many a second, 429 + Retry-After when empty (0: no limit). The defaults let "
        "10,000 phones behind one address enroll at once; a secret guesser gets 200 tries a "
        "second.")
    enroll_burst: int = Field(10_000, ge=1,
        description="The enrollment bucket's size: attempts one client IP may make at once (see "
        "enroll_rate).")
    keep_alive: int = Field(75, ge=1,
        description="uvicorn: seconds an idle keep-alive connection is held (above a proxy's "
        "usual 60 s, so the server is never the side that closes a connection the other is about "
        "to reuse).")
    limit_concurrency: int = Field(20_000, ge=1,
        description="uvicorn: connections + requests in flight before it answers 503 (long-polls "
        "count).")
    max_header_bytes: int = Field(16_384, ge=1024,
        description="h11's buffer for a request line + headers still unfinished: past it, 400 and "
        "closed.")
    head_timeout: float = Field(15.0, gt=0, allow_inf_nan=False,
        description="Seconds a connection may take from its opening (or, kept alive, from its "
        "next request's first byte) to the end of a request's head: past them it is closed, so "
        "idle or slowly-typed connections cannot pile up to limit_concurrency.")
    polls_per_device: int = Field(4, ge=1,
        description="Long-polls (GET /v1/rounds/current?wait=) one device may have waiting at "
        "once (429 past).")
    admit_per_tick: int = Field(32, ge=0,
        description="New HTTP requests that begin their work in one event-loop iteration "
        "(fedkey.server.runtime.admission); the others wait their turn for a few ms, so a burst "
        "of arrivals cannot hold the loop for one long iteration (/healthz and /metrics skip the "
        "queue). 0: no limit.")
    # fmt: on

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
            self.strategy,
            self.privacy_config(),
            self.influence_config(),
            self.strategy_params(),
            self.checkpoint_every,
        )
        if problem is not None:
            raise ValueError(problem)
        if self.canary:
            self.canary_spec()  # a malformed FEDKEY_CANARY_FORMAT / _ALPHABET, refused up front
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("HTTPS needs both --tls-cert and --tls-key")
        if self.init is not None:
            self._check_base(self.init)
        return self

    def _check_base(self, init: str) -> None:
        """--init: a readable base checkpoint, and no explicit option that contradicts it."""
        asked = {k: getattr(self, k) for k in FIXED_BY_BASE if k in self.model_fields_set}
        problems = base_conflicts(read_base(init), asked)
        if problems:
            raise ValueError(
                f"--init {init} fixes the model and its vocabulary: drop {'; '.join(problems)}"
            )

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
        """The model of `vocab_size` words these settings ask for; with --init, the base's (its
        dropout replaced by an explicit --dropout)."""
        if self.init is not None:
            dropout = self.dropout if "dropout" in self.model_fields_set else None
            return base_model_config(read_base(self.init), dropout)
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
            eval_topk=self.eval_topk,
            keep_checkpoints=self.keep_checkpoints,
            checkpoint_every=self.checkpoint_every,
            eval_device=self.eval_device,
            init=self.init,
            ngram=None if self.ngram is None else str(ngram_path(self.ngram)),
        )

    def quorum_for(self, expected: int) -> int:
        """Updates needed at the deadline when `expected` uploads were asked for."""
        if expected <= 0:
            return 1
        q = self.quorum if self.quorum is not None else math.ceil(self.quorum_fraction * expected)
        return max(1, min(expected, q))
