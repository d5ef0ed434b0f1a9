"""The federation's configs as plain data: what a round engine is built from. Standard library
only (no torch), so the command line and `Settings` can build them cheaply. Every list of choices
the server offers is defined here once, as a Literal the command line and Settings reuse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from fedkey.common.config import DP_MECHANISMS, FTRL_MECHANISMS, DPMechanism, TrainConfig
from fedkey.federation.privacy.adaptive_clip import (
    DEFAULT_CLIP_LR,
    count_sensitivity,
    count_stddev_problem,
)

#: The aggregation methods (fedkey.federation.strategies.STRATEGIES has a class for each, and `adafl`).
StrategyName = Literal["fedsgd", "fedavg", "fedatt", "fedattopt", "fedmed"]
STRATEGY_NAMES: tuple[StrategyName, ...] = get_args(StrategyName)
#: FedAtt's layer distance: the flattened L2 norm, or the matrix 2-norm of the original code.
Norm = Literal["l2", "spectral"]
NORMS: tuple[Norm, ...] = get_args(Norm)
#: FedAtt's normalizer: the cohort's softmax (Ji et al. 2019, eq. 4), or the fixed count m with
#: the weights' public ceiling, DP-FedAvg's sensitivity 2S/m (fedkey.federation.strategies.sensitivity).
AttentionNormalizer = Literal["softmax", "fixed"]
ATTENTION_NORMALIZERS: tuple[AttentionNormalizer, ...] = get_args(AttentionNormalizer)

ServerOptName = Literal["none", "momentum", "adam"]
OPTIMIZERS: tuple[ServerOptName, ...] = get_args(ServerOptName)

#: How the server bounds each update before aggregation (fedkey.federation.influence.bounding): adaptive: S = a
#: multiple of the round's median update norm; fixed: a given S; off: no bounding (the papers').
ClipMode = Literal["adaptive", "fixed", "off"]
CLIP_MODES: tuple[ClipMode, ...] = get_args(ClipMode)
#: The clip applies to the whole model's delta, or to each layer's (with sum_l S_l^2 = S^2).
ClipScope = Literal["model", "layer"]
CLIP_SCOPES: tuple[ClipScope, ...] = get_args(ClipScope)
#: How a DP round's cohort is drawn, as the accountant assumes it: a fixed-size sample without
#: replacement (replace-one adjacency) or Poisson sampling (add/remove-one; uniform FedAvg only).
DPSampling = Literal["fixed", "poisson"]
DP_SAMPLINGS: tuple[DPSampling, ...] = get_args(DPSampling)
#: Where `fedkey server` completes its rounds (fedkey.server.aggregator): a child process, so the event
#: loop shares no GIL with the aggregation, or a thread of the server process.
AggregateIn = Literal["process", "thread"]
#: How devices enroll with `fedkey server` (fedkey.server.enrollment): the shared enrollment secret or a
#: token the operator minted, or a minted token only.
EnrollmentMode = Literal["secret", "tokens"]
#: The coordinate trim without DP: with 10 phones one value is clamped at each end, 3 with 30.
DEFAULT_TRIM = 0.1
#: The cosine outlier filter's cut without DP: Iglewicz & Hoaglin's modified z-score 3.5
#: (fedkey.federation.strategies.outliers).
DEFAULT_OUTLIER_Z = 3.5
#: Strategies whose aggregate is the uniform mean under DP (the engine sets every weight to 1).
MEAN_STRATEGIES: tuple[StrategyName, ...] = ("fedsgd", "fedavg")


def scheduled_lr(lr: float, decay: float, round: int) -> float:
    """Round `round`'s (1-based) step size under an exponential schedule: lr * decay^(round - 1).
    The local lr (FederationConfig.lr_decay) and the server lr (ServerOptConfig.lr_decay) follow
    it; a function of the round alone, so a resumed run steps as one never stopped."""
    return lr * decay ** (round - 1)


@dataclass
class ServerOptConfig:
    name: ServerOptName = "none"
    lr: float = 1.0
    momentum: float = 0.9
    beta2: float = 0.99  # Adam
    tau: float = 1e-3  # Adam's adaptivity (Reddi et al.'s epsilon)
    lr_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(
                f"unknown server optimizer {self.name!r}; valid: {', '.join(OPTIMIZERS)}"
            )


@dataclass
class InfluenceConfig:
    """Bounded influence: what one phone's upload can do to the global model.

    Every update's delta is clipped on the server before any strategy sees it (whole model or per
    layer): to ``multiple`` times the round's median update norm (adaptive, the default, 1: the
    median, what honest phones send; fedkey.federation.influence.bounding says why), to ``norm`` (fixed), or not at
    all (off: the seed papers' behaviour; it also turns off the two caps below, the trim and the
    outlier filter). Attention scores are divided by
    ``temperature`` times the bound, so no phone's weight passes ``e^(1/T) / (e^(1/T) + m - 1)``;
    a FedAvg weight n_k is capped at ``weight_cap`` times the round's median n_k. Under DP the clip
    is the DP clip S (fixed, data-independent).

    With the trim, FedAtt's attention also counts no layer distance beyond the round's
    (k+1)-th largest (``Bound.distance_caps``).

    ``trim`` (beta) first clamps every coordinate of every delta to the range of the round's values
    of that coordinate without their ceil(beta m) smallest and largest (winsorizing,
    fedkey.federation.influence.bounding.coordinate_range):
    the clip bounds how far a phone moves the model as a whole, the trim each coordinate to the
    range the round's other phones span, so a backdoor that pushes some coordinates further than
    any honest phone does is cut back to that range.
    None: ``DEFAULT_TRIM`` without DP, 0 under DP (the analysis covers the clip, not the trim).

    ``outlier_z`` first rejects the updates whose mean cosine similarity to the others is
    unusually low (modified z-score above it, fewer than half the cohort;
    fedkey.federation.strategies.outliers): a persistent backdoor's direction, which the clip and the trim
    do not see. None: ``DEFAULT_OUTLIER_Z`` without DP, 0 (off) under DP; 0: off.
    """

    mode: ClipMode = "adaptive"
    norm: float | None = None  # S of the fixed mode
    multiple: float = 1.0  # adaptive: S = multiple * median of the round's norms (FLAME's median)
    scope: ClipScope = "model"
    temperature: float = 1.0  # attention: softmax(score / (T * bound))
    weight_cap: float = 4.0  # n_k <= weight_cap * median n_k
    trim: float | None = None  # coordinate trim beta; None: DEFAULT_TRIM, or 0 under DP
    outlier_z: float | None = None  # cosine filter's cut; None: DEFAULT_OUTLIER_Z, or 0 under DP

    def __post_init__(self) -> None:
        if self.mode not in CLIP_MODES:
            raise ValueError(f"unknown bound mode {self.mode!r}; valid: {', '.join(CLIP_MODES)}")
        if self.scope not in CLIP_SCOPES:
            raise ValueError(f"unknown bound scope {self.scope!r}; valid: {', '.join(CLIP_SCOPES)}")
        if self.mode == "fixed" and self.norm is None:
            raise ValueError("the fixed bound needs its norm S (--bound-norm)")
        for name in ("multiple", "temperature", "weight_cap"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.norm is not None and not self.norm > 0:
            raise ValueError(f"the bound's norm must be > 0, got {self.norm}")
        if self.trim is not None and not 0 <= self.trim < 0.5:
            raise ValueError(f"the coordinate trim must be in [0, 0.5), got {self.trim}")
        if self.outlier_z is not None and not self.outlier_z >= 0:
            raise ValueError(
                f"the outlier filter's cut must be >= 0 (0: off), got {self.outlier_z}"
            )

    def trim_for(self, dp: bool) -> float:
        """The trim beta this round applies: the explicit one, else the default (0 under DP or
        with bounding off)."""
        if self.mode == "off":
            return 0.0
        if self.trim is not None:
            return self.trim
        return 0.0 if dp else DEFAULT_TRIM

    def outlier_z_for(self, dp: bool) -> float:
        """The cosine filter's cut this round applies (0: off): the explicit one, else the
        default (0 under DP or with bounding off)."""
        if self.mode == "off":
            return 0.0
        if self.outlier_z is not None:
            return self.outlier_z
        return 0.0 if dp else DEFAULT_OUTLIER_Z

    @property
    def active(self) -> bool:
        return self.mode != "off"


#: DP's noise multiplier z where none is given and no target epsilon calibrates one.
DEFAULT_NOISE_MULTIPLIER = 1.0


@dataclass
class PrivacyConfig:
    """Client-side randomization of the seed papers (beta) and/or DP (clip + noise + accountant)."""

    beta: float = (
        0.0  # the seed papers: each device adds beta * N(0, sigma^2) before upload; no guarantee
    )
    sigma: float = 1.0
    clip_norm: float | None = None  # DP: clip each update's L2 norm to S ...
    # ... and add N(0, (z * sensitivity)^2) to the aggregate; None: calibrated to target_epsilon
    # over the planned rounds (fedkey.federation.privacy.calibrate), else DEFAULT_NOISE_MULTIPLIER
    noise_multiplier: float | None = None
    # epsilon is reported at this delta; None: 1 / N^1.1 for the N phones (production's choice)
    delta: float | None = None
    target_epsilon: float | None = None
    sampling: DPSampling = "fixed"
    mechanism: DPMechanism = "gaussian"
    # tree, blt: two participations of one phone are at least this many rounds apart; None: the
    # largest the population allows, floor(N / m) (fedkey.federation.privacy.tree.default_separation)
    min_separation: int | None = None
    # Adaptive clipping (fedkey.federation.privacy.adaptive_clip): the clip follows this quantile of the update
    # norms, starting at clip_norm; None: the fixed clip
    clip_quantile: float | None = None
    clip_lr: float = DEFAULT_CLIP_LR  # eta_C: C <- C exp(-eta_C (noised fraction - quantile))
    clip_count_stddev: float | None = None  # sigma_b; None: the expected cohort / 20
    # The noise's secret (fedkey.federation.privacy.secret): None, 256 bits from the operating system kept in the
    # run directory; a passphrase makes the noise reproducible by whoever knows it
    secret: str | None = field(default=None, repr=False)
    # Publish the scores on the held-out text under DP too (fedkey.federation.metrics_row.public_row): a
    # release the accountant does not cover, for demonstrations whose epsilon bounds nothing
    publish_scores: bool = False

    @property
    def dp(self) -> bool:
        return self.clip_norm is not None


@dataclass
class FederationConfig:
    """A federation's configuration; the fields Settings sets are described there
    (fedkey.server.settings), as the flags' help."""

    strategy: StrategyName = "fedavg"
    label: str | None = None  # what metrics and checkpoints call the run (default: the strategy)
    strategy_params: dict = field(default_factory=dict)  # epsilon, norm, beta, selector, ...
    fraction: float = 0.1
    rounds: int = 10
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    influence: InfluenceConfig = field(default_factory=InfluenceConfig)
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    lr_decay: float = 1.0
    eval_batch_size: int = 64
    # where the global model is evaluated each round: auto is the GPU where torch sees one (the
    # full PTB validation and test sets take ~25 s a round on one CPU thread, under 1 s there)
    eval_device: str = "auto"
    ksr_sentences: int = 100  # keystroke savings are costly: measured on the first N test sentences
    eval_topk: bool = True  # the test set's top-1/top-3 every round (False: its perplexity only)
    keep_checkpoints: int = 0
    # a round's checkpoint every N rounds, and at every new best round and the last round; the
    # rounds between are run again on a resume (not under DP: their models were published)
    checkpoint_every: int = 1
    init: str | None = None  # a base checkpoint whose weights round 0 holds (default: fresh ones)
    ngram: str | None = None  # a Kneser-Ney n-gram file: every round also scores the mixture


def dp_problem(
    strategy: StrategyName,
    privacy: PrivacyConfig,
    influence: InfluenceConfig,
    params: dict,
    checkpoint_every: int = 1,
) -> str | None:
    """Why this federation cannot run with a DP guarantee, or None when it can.

    Every choice the server makes from private data must be inside the analysis (the clip, the
    attention cap) or refused here: AdaFL's scores and FedMed's topK and mediation read the
    updates and losses without noise, and attention normalizes by the cohort's own weights, which
    the add/remove-one analysis of Poisson cohorts does not cover. The DP-FTRL mechanisms (tree,
    blt) sample nothing, so they refuse Poisson sampling; the minimum separation is theirs. A
    resume must not run published rounds again (fresh noise on the same phones, unaccounted):
    every round is checkpointed under DP (`checkpoint_every` 1).
    """
    if privacy.mechanism not in DP_MECHANISMS:
        return f"unknown DP mechanism {privacy.mechanism!r}; valid: {', '.join(DP_MECHANISMS)}"
    ftrl = privacy.mechanism in FTRL_MECHANISMS
    if ftrl and not privacy.dp:
        return (
            f"--dp-mechanism {privacy.mechanism} is a DP mechanism: add --dp-clip S to turn DP on"
        )
    if privacy.min_separation is not None and not ftrl:
        return (
            "--dp-min-separation is the tree and blt mechanisms' participation rule: add "
            "--dp-mechanism tree or blt (the gaussian mechanism samples its cohorts instead)"
        )
    if privacy.min_separation is not None and privacy.min_separation < 1:
        return f"--dp-min-separation must be >= 1, got {privacy.min_separation}"
    problem = adaptive_clip_problem(privacy)
    if problem is not None:
        return problem
    if not privacy.dp:
        return None
    if checkpoint_every > 1:
        return (
            "--checkpoint-every above 1 would run published DP rounds again on a resume: "
            "leave it at 1 with DP"
        )
    if ftrl and privacy.sampling == "poisson":
        return (
            f"--dp-mechanism {privacy.mechanism} samples no cohorts (its accounting assumes a "
            "minimum separation instead): drop --dp-sampling poisson"
        )
    if influence.mode == "off":
        return "DP needs bounded updates: drop --bound off (under DP the bound is --dp-clip)"
    if influence.trim:
        return (
            "the coordinate trim clamps each update to the others' values, which the DP "
            "analysis (the clip's sensitivity) does not cover: use --trim 0 under DP"
        )
    if influence.outlier_z:
        return (
            "the cosine outlier filter rejects updates by their direction relative to the "
            "others', which the DP analysis (the clip's sensitivity) does not cover: use "
            "--outlier-z 0 under DP"
        )
    if params.get("selector") == "adafl":
        return (
            "AdaFL selection scores phones by their private updates without noise, so its "
            "choices are not covered by the DP analysis: use uniform selection (drop --adafl)"
        )
    if params.get("max_reach") is not None:
        return (
            "--max-reach scales FedAttOpt's step by the private updates' norms, which its "
            "sensitivity bound does not cover: drop --max-reach under DP"
        )
    if strategy == "fedmed":
        if float(params.get("beta", 1.0)) < 1.0:
            return (
                "FedMed's topK picks uploaders by their private losses without noise: "
                "use --topk-beta 1 under DP"
            )
        if float(params.get("epsilon_med", 0.1)) > 0.0:
            return (
                "FedMed's mediation switches on the change of the private mean loss without "
                "noise: use --epsilon-med 0 (always adaptive) under DP"
            )
    if privacy.sampling == "poisson" and strategy not in MEAN_STRATEGIES:
        return (
            f"{strategy} normalizes attention by the cohort's own weights, which the "
            "add/remove-one analysis of Poisson cohorts does not cover: use --dp-sampling fixed"
        )
    return None


def adaptive_clip_problem(privacy: PrivacyConfig) -> str | None:
    """Why adaptive clipping's options cannot run (None: they can, or they are off)."""
    q, sigma_b = privacy.clip_quantile, privacy.clip_count_stddev
    if q is None:
        if sigma_b is not None:
            return (
                "--dp-clip-count-stddev is adaptive clipping's count noise: add "
                "--dp-clip-quantile q"
            )
        return None
    if not privacy.dp:
        return "--dp-clip-quantile adapts the DP clip: add --dp-clip S (the first round's clip)"
    if not 0 < q < 1:
        return f"--dp-clip-quantile must be in (0, 1), got {q}"
    if not privacy.clip_lr > 0:
        return f"--dp-clip-lr must be > 0, got {privacy.clip_lr}"
    if sigma_b is not None:
        if not sigma_b >= 0:
            return f"--dp-clip-count-stddev must be >= 0, got {sigma_b}"
        z = privacy.noise_multiplier
        if z is None and privacy.target_epsilon is not None:
            # z is calibrated below sigma_b's limit (fedkey.federation.privacy.calibrate)
            return None
        z = DEFAULT_NOISE_MULTIPLIER if z is None else z
        return count_stddev_problem(z, sigma_b, count_sensitivity(privacy.sampling))
    return None
