"""The options several commands share, defined once: name -> (type, typer.Option) tables that
`with_options` adds to a command, and the Settings, DataConfig and FleetConfig built from them.

The federation's options come from fedkey.server.settings: their defaults are the Settings defaults and
each one can be set by an environment variable FEDKEY_<NAME> (flags win). The lists of choices are
the Literal types of the modules whose logic they choose (fedkey.federation.config, fedkey.models.config, ...).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from fedkey.cli.errors import UserError, validation_problems
from fedkey.common.config import Batching, DataConfig, Precision, Scheme, TokenizerKind
from fedkey.federation.config import (
    AttentionNormalizer,
    ClipMode,
    ClipScope,
    DPMechanism,
    DPSampling,
    Norm,
    ServerOptName,
    StrategyName,
)
from fedkey.models.config import Cell, Preset
from fedkey.server.settings import EVAL_DEVICES, Settings


def opt(name: str, *flags: str, default: Any = ..., **kw) -> Any:
    """An option whose default is the Settings default and whose env variable is FEDKEY_<NAME>."""
    if default is ...:
        default = Settings.model_fields[name].default
    return typer.Option(default, *flags, envvar=f"FEDKEY_{name.upper()}", **kw)


def check_device(value: str) -> str:
    """--device: auto, cpu, cuda, cuda:N (or mps); a CUDA device only where torch sees a GPU."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", value):
        raise typer.BadParameter(f"{value!r} is not a device: use auto, cpu, cuda or cuda:N")
    if value.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter(f"{value}: torch sees no CUDA GPU here; use cpu or auto")
    return value


def check_eval_device(value: str) -> str:
    """--eval-device: one of fedkey.server.settings.EVAL_DEVICES, and CUDA only where torch sees a GPU."""
    if not re.fullmatch(EVAL_DEVICES, value):
        raise typer.BadParameter(f"{value} is not an evaluation device: use auto, cpu or cuda")
    return check_device(value)


def check_precision(value: str) -> str:
    """--precision bf16 where the hardware lacks native bf16: a warning, not a refusal."""
    if value == "bf16":
        from fedkey.models.precision import native_bf16

        if not (native_bf16("cpu") or native_bf16("cuda")):
            typer.echo(
                "warning: --precision bf16: no native bf16 here (CPU without AVX512-BF16 or "
                "AMX, no bf16 GPU); it runs emulated, likely slower than fp32",
                err=True,
            )
    return value


def check_url(value: str | None) -> str | None:
    """A server's URL: http(s)://HOST[:PORT]."""
    from urllib.parse import urlsplit

    if value is not None:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise typer.BadParameter(f"{value!r} is not a server URL: give http://HOST:PORT")
    return value


def tls_pair(cert: Path | None, key: Path | None) -> tuple[Path, Path] | None:
    """--tls-cert and --tls-key: both (existing files) or neither."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise typer.BadParameter(
            "HTTPS needs both --tls-cert and --tls-key", param_hint="--tls-key"
        )
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not path.is_file():
            raise typer.BadParameter(f"{path}: no such file", param_hint=flag)
    return cert, key


# name -> (type, typer.Option). Groups of options shared by several commands.
DATA = {
    "data": (
        str,
        opt(
            "data",
            "--data",
            help="'demo' (the embedded corpus), 'nus-sms' or 'ubuntu-irc' (real corpora in the data directory: fedkey data fetch), or a directory: train/valid/test.txt (PTB, WikiText-2), one .txt per user, a .jsonl of {user, text}, or a StackExchange Posts.xml.",
        ),
    ),
    "paper_protocol": (
        bool,
        opt(
            "paper_protocol",
            "--paper-protocol",
            help="The seed papers' preprocessing: lowercase, split lines on ' . ', vocabulary from all splits.",
        ),
    ),
    "tokenizer": (
        TokenizerKind,
        opt(
            "tokenizer",
            "--tokenizer",
            help="Word vocabulary or SentencePiece.",
        ),
    ),
    "vocab_size": (
        int,
        opt("vocab_size", "--vocab-size", help="Maximum vocabulary size (specials included)."),
    ),
    "tokenizer_text": (
        str | None,
        opt(
            "tokenizer_text",
            "--tokenizer-text",
            help="SentencePiece: public text the server trains it on (.txt or a corpus dir); never the phones' data. The demo has its own.",
        ),
    ),
    "max_train_tokens": (
        int | None,
        opt(
            "max_train_tokens",
            "--max-train-tokens",
            help="Keep only the first N training words (reduced CPU runs).",
        ),
    ),
    "max_eval_sentences": (
        int | None,
        opt(
            "max_eval_sentences",
            "--max-eval-sentences",
            help="Keep only the first N validation and test sentences.",
        ),
    ),
    "seed": (
        int,
        opt(
            "seed",
            "--seed",
            help="Seeds partitioning, initialization, selection, training and noise.",
        ),
    ),
}
MODEL = {
    "model": (
        Preset,
        opt(
            "model",
            "--model",
            help="Size preset: small 300, medium 650, large 1500 (embedding = hidden).",
        ),
    ),
    "cell": (Cell, opt("cell", "--cell", help="Recurrent cell.")),
    "layers": (int, opt("layers", "--layers", min=1, max=4, help="Recurrent layers.")),
    "tied": (bool, opt("tied", "--tied/--untied", help="Share input and output embeddings.")),
    "dropout": (
        float,
        opt("dropout", "--dropout", min=0.0, max=0.9, help="Dropout on embeddings and outputs."),
    ),
}
TRAIN = {
    "local_epochs": (
        int,
        opt("local_epochs", "--local-epochs", "-E", min=1, help="Local epochs per round."),
    ),
    "batch_size": (
        int,
        opt("batch_size", "--batch-size", "-B", min=1, help="Sentences per batch."),
    ),
    "lr": (
        float,
        opt(
            "lr",
            "--lr",
            help="Local SGD learning rate (the seed papers use 0.01, which learns far slower).",
        ),
    ),
    "momentum": (float, opt("momentum", "--momentum", help="Local SGD momentum.")),
    "clip": (
        float,
        opt("clip", "--clip", help="Gradient-norm clipping in local training (0: off)."),
    ),
    "batching": (
        Batching,
        opt(
            "batching",
            "--batching",
            help="sentences: language modelling. columns: the batches the seed papers' published code trained on (token j of each sentence in a batch, cut to the shortest), to reproduce their numbers; adds their column perplexity to the metrics.",
        ),
    ),
    "precision": (
        Precision,
        opt(
            "precision",
            "--precision",
            callback=lambda value: check_precision(value),
            help="Arithmetic of local training (sent to the phones in the task) and of evaluation: "
            "bf16 mixed precision (bf16 autocast, fp32 weights, loss and updates), fp32, or auto: "
            "bf16 where the hardware has it natively (a CUDA GPU with bf16, a CPU with "
            "AVX512-BF16 or AMX), else fp32; each phone resolves auto on its own hardware.",
        ),
    ),
}
FEDERATION = {
    "strategy": (
        StrategyName,
        opt("strategy", "--strategy", help="Aggregation method."),
    ),
    "fraction": (
        float,
        opt(
            "fraction",
            "--fraction",
            "-C",
            min=0.0,
            max=1.0,
            help="Share of phones selected per round (fedsgd uses all).",
        ),
    ),
    "rounds": (int, opt("rounds", "--rounds", "-R", min=1, help="Federated rounds.")),
    "epsilon": (
        float | None,
        opt("epsilon", "--epsilon", help="Server step size of fedatt / fedattopt (default 1.2)."),
    ),
    "max_reach": (
        float | None,
        opt(
            "max_reach",
            "--max-reach",
            help="fedattopt: cap a round's step at this many times FedAvg's (1: never past the "
            "phones' mean; default: the paper's step, whose reach grows as updates shrink).",
        ),
    ),
    "norm": (Norm, opt("norm", "--norm", help="fedatt distance: l2 (flattened) or spectral.")),
    "fedatt_normalizer": (
        AttentionNormalizer,
        opt(
            "fedatt_normalizer",
            "--fedatt-normalizer",
            help="fedatt: softmax (the paper's) or fixed: the same relative weights over the "
            "cohort's count m, whose DP noise is DP-FedAvg's.",
        ),
    ),
    "eta": (float, opt("eta", "--eta", help="fedmed step size (1 = weighted average).")),
    "epsilon_med": (
        float,
        opt(
            "epsilon_med",
            "--epsilon-med",
            help="fedmed mediation threshold on the change of mean loss.",
        ),
    ),
    "topk_beta": (
        float,
        opt(
            "topk_beta",
            "--topk-beta",
            help="fedmed topK: share of trained phones that upload (1 = off; paper best 0.8).",
        ),
    ),
    "adafl": (
        bool,
        opt(
            "adafl",
            "--adafl",
            help="AdaFL attention-based client selection with a dynamic fraction (0.1 -> 0.5).",
        ),
    ),
    "server_opt": (
        ServerOptName,
        opt(
            "server_opt",
            "--server-opt",
            help="Server optimizer on the aggregate's pseudo-gradient: momentum (FedAvgM) or adam (FedAdam).",
        ),
    ),
    "server_lr": (float, opt("server_lr", "--server-lr", help="Server optimizer step size.")),
    "server_momentum": (
        float,
        opt("server_momentum", "--server-momentum", help="FedAvgM momentum / FedAdam beta1."),
    ),
    "server_lr_decay": (
        float,
        opt(
            "server_lr_decay",
            "--server-lr-decay",
            help="Server lr schedule: round r steps with server lr * decay^(r-1) (1 = constant).",
        ),
    ),
    "lr_decay": (
        float,
        opt(
            "lr_decay",
            "--lr-decay",
            help="Local lr schedule: round r (train-central: epoch r) trains with lr * decay^(r-1) (1 = constant).",
        ),
    ),
    "ksr_sentences": (
        int,
        opt(
            "ksr_sentences",
            "--ksr-sentences",
            min=0,
            help="Keystroke savings are measured on the first N test sentences (0: off).",
        ),
    ),
    "keep_checkpoints": (
        int,
        opt(
            "keep_checkpoints",
            "--keep-checkpoints",
            min=0,
            help="Checkpoints kept on disk: the latest N rounds' and the best round's (0: every round's; a round's model is 13.5 MB at a 10k vocabulary).",
        ),
    ),
    "eval_device": (
        str,
        opt(
            "eval_device",
            "--eval-device",
            callback=lambda value: check_eval_device(value),
            help="Where the server evaluates the global model each round: auto (CUDA when available), cpu or cuda.",
        ),
    ),
    "bound": (
        ClipMode,
        opt(
            "bound",
            "--bound",
            help="Bounded influence: clip every update on the server to a multiple of the round's "
            "median norm (adaptive), to --bound-norm (fixed), or not at all (off: the papers').",
        ),
    ),
    "bound_norm": (
        float | None,
        opt("bound_norm", "--bound-norm", help="The L2 bound S of --bound fixed."),
    ),
    "bound_multiple": (
        float,
        opt(
            "bound_multiple",
            "--bound-multiple",
            help="--bound adaptive: S = this multiple of the round's median update norm.",
        ),
    ),
    "bound_scope": (
        ClipScope,
        opt(
            "bound_scope",
            "--bound-scope",
            help="Clip the whole model's update, or each layer's (sum of S_l^2 = S^2).",
        ),
    ),
    "attention_temperature": (
        float,
        opt(
            "attention_temperature",
            "--attention-temperature",
            help="Attention cap T: scores / (T S), so no weight exceeds e^(1/T) / (e^(1/T) + m - 1).",
        ),
    ),
    "weight_cap": (
        float,
        opt(
            "weight_cap",
            "--weight-cap",
            help="A phone's FedAvg weight n_k counts at most this multiple of the round's median.",
        ),
    ),
    "trim": (
        float | None,
        opt(
            "trim",
            "--trim",
            help="Coordinate trim beta: before the clip, clamp each coordinate of each update to "
            "the range of the round's values without their ceil(beta m) lowest and highest "
            "(default 0.1; 0 under DP, which refuses it).",
        ),
    ),
    "outlier_z": (
        float | None,
        opt(
            "outlier_z",
            "--outlier-z",
            help="Cosine outlier filter: reject an update whose mean cosine to the round's others "
            "is this many modified z-scores below the median (fewer than half the phones; "
            "default 3.5; 0 turns it off; off under DP, which refuses it).",
        ),
    ),
    "dp_beta": (
        float,
        opt(
            "dp_beta",
            "--dp-beta",
            help="The seed papers' randomization: each phone adds beta * N(0, 1) to its weights (no formal guarantee).",
        ),
    ),
    "dp_clip": (
        float | None,
        opt(
            "dp_clip",
            "--dp-clip",
            help="DP: clip each update to this L2 norm S and add noise calibrated to the "
            "strategy's sensitivity (turns DP on; fedavg, fedatt, fedattopt, fedmed).",
        ),
    ),
    "dp_noise_multiplier": (
        float,
        opt(
            "dp_noise_multiplier",
            "--dp-noise-multiplier",
            help="DP noise multiplier z: N(0, (z * sensitivity)^2) on the aggregate.",
        ),
    ),
    "dp_sampling": (
        DPSampling,
        opt(
            "dp_sampling",
            "--dp-sampling",
            help="How DP cohorts are drawn and accounted: fixed (a fixed-size sample, replace-one) "
            "or poisson (each phone with probability C, add/remove-one; fedavg/fedsgd only).",
        ),
    ),
    "dp_mechanism": (
        DPMechanism,
        opt(
            "dp_mechanism",
            "--dp-mechanism",
            help="How DP noise is added: gaussian (DP-FedAvg: fresh noise each round on sampled "
            "cohorts), tree (DP-FTRL, as Gboard trains: tree-aggregated noise on the running "
            "sum of the rounds' aggregates; no sampling, a minimum separation instead) or blt "
            "(DP-FTRL with BLT matrix-factorization noise, correlated across rounds; the same "
            "rule; factorizations shipped for runs of up to a fixed number of rounds).",
        ),
    ),
    "dp_min_separation": (
        int | None,
        opt(
            "dp_min_separation",
            "--dp-min-separation",
            help="With --dp-mechanism tree or blt: a phone that trained in round r trains again no "
            "earlier than round r + b, and the accounting assumes it (default: the largest b "
            "the population allows, floor(phones / cohort)).",
        ),
    ),
    "dp_clip_quantile": (
        float | None,
        opt(
            "dp_clip_quantile",
            "--dp-clip-quantile",
            help="DP adaptive clipping (Andrew et al. 2021): the clip starts at --dp-clip and "
            "follows this quantile of the update norms (e.g. 0.5), from a noised count of the "
            "unclipped updates; the update noise is raised so the total stays at z (off: a fixed "
            "clip).",
        ),
    ),
    "dp_clip_lr": (
        float,
        opt(
            "dp_clip_lr",
            "--dp-clip-lr",
            help="With --dp-clip-quantile: the clip's learning rate eta_C, "
            "C <- C exp(-eta_C (noised unclipped fraction - quantile)).",
        ),
    ),
    "dp_clip_count_stddev": (
        float | None,
        opt(
            "dp_clip_count_stddev",
            "--dp-clip-count-stddev",
            help="With --dp-clip-quantile: the count's noise sigma_b (default: the expected "
            "cohort / 20); it must exceed z (z / 2 with --dp-sampling poisson).",
        ),
    ),
    "dp_delta": (
        float | None,
        opt(
            "dp_delta",
            "--dp-delta",
            help="DP delta for the reported epsilon (default: 1 / N^1.1 for N phones).",
        ),
    ),
    "dp_target_epsilon": (
        float | None,
        opt(
            "dp_target_epsilon",
            "--dp-target-epsilon",
            help="DP: stop before epsilon would pass this budget.",
        ),
    ),
    "dp_publish_scores": (
        bool,
        opt(
            "dp_publish_scores",
            "--dp-publish-scores",
            help="DP: publish the perplexities, top-k and keystroke savings on the held-out text "
            "too (and export the round best on validation), outside what epsilon covers: for a "
            "demonstration whose epsilon bounds nothing anyway.",
        ),
    ),
    "dp_secret": (
        str | None,
        opt(
            "dp_secret",
            "--dp-secret",
            default=None,
            help="DP: a passphrase the noise and the sampled cohorts are drawn from, for research "
            "runs that must be reproducible (their rows say noise_reproducible: true; whoever "
            "knows it can remove the noise). Default: 256 bits from the operating system, kept in "
            "RUN_DIR/secret.key (0600).",
            show_default=False,
        ),
    ),
}
PHONES = {
    "partition": (
        Scheme,
        typer.Option(
            "iid",
            "--partition",
            help="iid: the seed papers' equal shards; user: one phone per user; dirichlet: non-IID; articles: whole articles per phone (WikiText-2's ' = Title = ' headings).",
        ),
    ),
    "alpha": (
        float,
        typer.Option(0.5, "--alpha", help="Dirichlet concentration (with --partition dirichlet)."),
    ),
    "device": (
        str,
        typer.Option(
            "auto",
            "--device",
            callback=lambda value: check_device(value),
            help="auto (CUDA when available), cpu or cuda.",
        ),
    ),
    "workers": (
        int | None,
        typer.Option(
            None,
            "--workers",
            help="Training processes, one torch thread each (default: one per core; 0: in this process); with --backend ray, trainer actors (default: as many as the cluster holds); --backend stacked trains in this process and takes none.",
        ),
    ),
}
ROUNDS = {
    "quorum": (
        int | None,
        opt(
            "quorum",
            "--quorum",
            help="Updates needed to aggregate at the deadline (default: half of those asked).",
        ),
    ),
    "round_deadline": (
        float,
        opt("round_deadline", "--round-deadline", help="Seconds a round stays open."),
    ),
}

FLEET = {
    "dropout_rate": (
        float,
        typer.Option(
            0.0,
            "--dropout-rate",
            min=0.0,
            max=1.0,
            help="Chance that a selected phone vanishes for the round (never uploads).",
        ),
    ),
    "slow_rate": (
        float,
        typer.Option(
            0.0,
            "--slow-rate",
            min=0.0,
            max=1.0,
            help="Chance that a selected phone is slow (waits --slow-seconds before uploading).",
        ),
    ),
    "slow_seconds": (
        float,
        typer.Option(5.0, "--slow-seconds", help="How long a slow phone waits."),
    ),
}
#: The memorization audit (fedkey.models.exposure): simulate, server, run and devices.
CANARY = {
    "canary": (
        bool,
        opt(
            "canary",
            "--canary",
            help="Memorization audit: plant a random secret (drawn with --seed from FEDKEY_CANARY_FORMAT, default 'my secret is _ _ _ _' over one..ten) in the first phone's shard; every round reports its exposure in bits (Carlini et al. 2019).",
        ),
    ),
    "canary_repeats": (
        int,
        opt(
            "canary_repeats",
            "--canary-repeats",
            min=0,
            help="Copies of the canary in the first phone's shard (with --canary; 0: a control, the exposure of a secret no phone holds).",
        ),
    ),
}

SETTINGS_GROUPS = (DATA, MODEL, TRAIN, FEDERATION, CANARY)


def with_options(*groups: dict):
    """Give a command the shared options of `groups`; they arrive in its **opts."""

    def decorate(fn):
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
            for group in groups
            for name, (kind, option) in group.items()
        ]
        fn.__signature__ = sig.replace(parameters=own + extra)
        fn.__annotations__ = {**fn.__annotations__, **{p.name: p.annotation for p in extra}}
        return fn

    return decorate


def build_settings(opts: dict, **overrides) -> Settings:
    """Settings from the options a command received (only the names Settings knows); a value
    Settings refuses is a UserError, one line per problem."""
    values = {k: v for k, v in opts.items() if k in Settings.model_fields}
    try:
        return Settings(**{**values, **overrides})
    except ValidationError as e:
        raise UserError(validation_problems(e, flags=set(values))) from None


def check_server_data(settings: Settings) -> None:
    """A corpus path that does not exist, found before a server process starts (its loader
    would say so only inside a traceback in the server's log)."""
    from fedkey.corpora.datadir import corpus_path
    from fedkey.corpora.loaders import ACCEPTED_LAYOUTS, NAMED_CORPORA

    for flag, spec in (("--data", settings.data), ("--tokenizer-text", settings.tokenizer_text)):
        if spec is not None and spec.strip() in NAMED_CORPORA:
            corpus_path(spec.strip())  # MissingCorpus: what to run, in one line
        elif spec is not None and spec.strip() != "demo" and not Path(spec).expanduser().exists():
            raise UserError(f"{flag}: corpus {spec!r} not found; {ACCEPTED_LAYOUTS}")


def canary_probes(settings: Settings) -> list:
    """With --canary, the round metric of its exposure (fedkey.models.exposure; imports torch)."""
    secret = settings.canary_secret()
    if secret is None:
        return []
    from fedkey.models.exposure import ExposureProbe

    return [ExposureProbe(settings.canary_spec(), secret)]


def phone_data(settings: Settings, opts: dict, clients: int) -> DataConfig:
    """The DataConfig of the phones: the server's data settings plus how shards are cut."""
    return replace(
        settings.data_config(), clients=clients, partition=opts["partition"], alpha=opts["alpha"]
    )
