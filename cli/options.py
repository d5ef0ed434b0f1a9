"""The options several commands share: name -> (type, typer.Option) groups that `with_options`
adds to a command, and the Settings, DataConfig and FleetConfig built from them.

The federation's options are the fields of fedkey.server.settings.Settings, declared there once:
`settings_option` derives each one's flag (--x-y), type and choices (a Literal's), default, help
(the field's description), min/max (its ge/le bounds) and environment variable FEDKEY_<NAME>
(flags win). `EXTRAS` adds only what a field cannot say: short aliases, a --x/--no-x pair,
callbacks. The other options (the phones', the fleet's) are typer options of their own.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import typer
from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from fedkey.cli.errors import UserError, validation_problems
from fedkey.common.config import DataConfig, Scheme
from fedkey.device_sim.config import FleetConfig
from fedkey.server.settings import EVAL_DEVICES, Settings


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


#: What a Settings field cannot say about its option: a short alias, a --x/--no-x pair (flag:
#: the flag declaration), a callback that checks the value.
EXTRAS: dict[str, dict[str, Any]] = {
    "tied": {"flag": "--tied/--untied"},
    "eval_topk": {"flag": "--eval-topk/--no-eval-topk"},
    "local_epochs": {"aliases": ("-E",)},
    "batch_size": {"aliases": ("-B",)},
    "fraction": {"aliases": ("-C",)},
    "rounds": {"aliases": ("-R",)},
    "precision": {"callback": lambda value: check_precision(value)},
    "eval_device": {"callback": lambda value: check_eval_device(value)},
}


def _bounds(field: FieldInfo) -> dict[str, Any]:
    """typer's min/max of a field: its inclusive bounds (ge, le). A strict one (gt, lt) typer cannot
    say; Settings refuses the value instead (validation_problems: one line naming the flag)."""
    limits: dict[str, Any] = {}
    for meta in field.metadata:
        if getattr(meta, "ge", None) is not None:
            limits["min"] = meta.ge
        if getattr(meta, "le", None) is not None:
            limits["max"] = meta.le
    return limits


def _cli_type(annotation: Any) -> Any:
    """The type typer parses a field's value as: a secret as a plain str (Settings wraps it)."""
    args = get_args(annotation)
    if SecretStr in (annotation, *args):
        return str | None if type(None) in args else str
    return annotation


def settings_option(name: str, **extra: Any) -> tuple[Any, Any]:
    """(type, typer.Option) of the Settings field `name`, derived from the field; `extra` (with
    EXTRAS[name]) adds flag, aliases, a callback, or another help where a command needs its own."""
    field = Settings.model_fields[name]
    kw = {**_bounds(field), "help": field.description, **EXTRAS.get(name, {}), **extra}
    flags = (kw.pop("flag", f"--{name.replace('_', '-')}"), *kw.pop("aliases", ()))
    kind = _cli_type(field.annotation)
    if kind is not field.annotation:  # a secret: its default is not shown
        kw.setdefault("show_default", False)
    option = typer.Option(field.default, *flags, envvar=f"FEDKEY_{name.upper()}", **kw)
    return kind, option


def settings_group(*names: str) -> dict[str, tuple[Any, Any]]:
    """The options of these Settings fields, in this order."""
    return {name: settings_option(name) for name in names}


DATA = settings_group(
    "data", "paper_protocol", "tokenizer", "vocab_size", "tokenizer_text", "max_train_tokens",
    "max_eval_sentences", "seed",
)  # fmt: skip
MODEL = settings_group("model", "cell", "layers", "tied", "dropout", "init")
TRAIN = settings_group(
    "local_epochs", "batch_size", "lr", "momentum", "clip", "batching", "precision"
)
FEDERATION = settings_group(
    "strategy", "fraction", "rounds", "epsilon", "max_reach", "norm", "fedatt_normalizer", "eta",
    "epsilon_med", "topk_beta", "adafl", "server_opt", "server_lr", "server_momentum",
    "server_lr_decay", "lr_decay", "ksr_sentences", "eval_topk", "ngram", "keep_checkpoints",
    "checkpoint_every", "eval_device",
    "bound", "bound_norm", "bound_multiple", "bound_scope", "attention_temperature", "weight_cap",
    "trim", "outlier_z", "dp_beta", "dp_clip", "dp_noise_multiplier", "dp_sampling", "dp_mechanism",
    "dp_min_separation", "dp_clip_quantile", "dp_clip_lr", "dp_clip_count_stddev", "dp_delta",
    "dp_target_epsilon", "dp_publish_scores", "dp_secret",
)  # fmt: skip
ROUNDS = settings_group("quorum", "round_deadline")
#: The memorization audit (fedkey.models.exposure): simulate, server, run and devices.
CANARY = settings_group("canary", "canary_repeats")
#: `fedkey server`'s own: where it keeps its run, how it listens, how devices enroll.
SERVICE = settings_group(
    "storage", "host", "port", "tls_cert", "tls_key", "enrollment_secret", "enrollment",
    "max_devices", "device_token_ttl", "wait_devices", "database_url", "exit_when_done",
    "export_dir", "export_latest", "max_samples",
)  # fmt: skip

SETTINGS_GROUPS = (DATA, MODEL, TRAIN, FEDERATION, CANARY)

_DATA, _FLEET = DataConfig(), FleetConfig()
#: How the phones' shards are cut and where they train (not Settings: the server never cuts shards).
PHONES = {
    "partition": (
        Scheme,
        typer.Option(
            _DATA.partition,
            "--partition",
            help="iid: the seed papers' equal shards; user: one phone per user; dirichlet: "
            "non-IID; articles: whole articles per phone (WikiText-2's ' = Title = ' headings).",
        ),
    ),
    "alpha": (
        float,
        typer.Option(
            _DATA.alpha, "--alpha", help="Dirichlet concentration (with --partition dirichlet)."
        ),
    ),
    "device": (
        str,
        typer.Option(
            _FLEET.device,
            "--device",
            callback=lambda value: check_device(value),
            help="auto (CUDA when available), cpu or cuda.",
        ),
    ),
    "workers": (
        int | None,
        typer.Option(
            _FLEET.workers,
            "--workers",
            help="Training processes, one torch thread each (default: one per core; 0: in this "
            "process); with --backend ray, trainer actors (default: as many as the cluster "
            "holds); --backend stacked: in this process by default, or stacks in N resident "
            "processes (simulate).",
        ),
    ),
}
#: How the phones of a fleet (devices, run) misbehave.
FLEET = {
    "dropout_rate": (
        float,
        typer.Option(
            _FLEET.dropout_rate,
            "--dropout-rate",
            min=0.0,
            max=1.0,
            help="Chance that a selected phone vanishes for the round (never uploads).",
        ),
    ),
    "slow_rate": (
        float,
        typer.Option(
            _FLEET.slow_rate,
            "--slow-rate",
            min=0.0,
            max=1.0,
            help="Chance that a selected phone is slow (waits --slow-seconds before uploading).",
        ),
    ),
    "slow_seconds": (
        float,
        typer.Option(_FLEET.slow_seconds, "--slow-seconds", help="How long a slow phone waits."),
    ),
}


#: The key of **opts under which `with_options` hands a command its typer.Context.
CONTEXT = "typer_context"


def with_options(*groups: dict):
    """Give a command the shared options of `groups`; they arrive in its **opts, with the
    command's typer.Context (under CONTEXT: build_settings reads which options were given)."""

    def decorate(fn):
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
            for group in groups
            for name, (kind, option) in group.items()
        ]
        extra.append(
            inspect.Parameter(CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        )
        fn.__signature__ = sig.replace(parameters=own + extra)
        fn.__annotations__ = {**fn.__annotations__, **{p.name: p.annotation for p in extra}}
        return fn

    return decorate


def _given(ctx: typer.Context | None, name: str, value: Any) -> bool:
    """Whether the command's option `name` was given (flag or environment) or has a default of
    the command's own, rather than its Settings field's default: Settings then knows which
    options were asked for (--init refuses those that contradict the base)."""
    source = ctx.get_parameter_source(name) if ctx is not None else None
    given = source is not None and source.name != "DEFAULT"
    return given or value != Settings.model_fields[name].default


def build_settings(opts: dict, **overrides) -> Settings:
    """Settings from the options a command received (only the names Settings knows, and of
    those with the field's default only the ones given); a value Settings refuses is a
    UserError, one line per problem."""
    ctx = opts.get(CONTEXT)
    values = {k: v for k, v in opts.items() if k in Settings.model_fields and _given(ctx, k, v)}
    try:
        return Settings(**{**values, **overrides})
    except ValidationError as e:
        raise UserError(validation_problems(e, flags=set(values))) from None


def check_server_data(settings: Settings) -> None:
    """A corpus path that does not exist, found before a server process starts (its loader
    would say so only inside a traceback in the server's log)."""
    from fedkey.corpora.datadir import corpus_path
    from fedkey.corpora.loaders import ACCEPTED_LAYOUTS, CHITCHAT_CORPORA, NAMED_CORPORA

    installed = ("demo", *CHITCHAT_CORPORA)
    for flag, spec in (("--data", settings.data), ("--tokenizer-text", settings.tokenizer_text)):
        if spec is not None and spec.strip() in NAMED_CORPORA:
            corpus_path(spec.strip())  # MissingCorpus: what to run, in one line
        elif (
            spec is not None
            and spec.strip() not in installed
            and not Path(spec).expanduser().exists()
        ):
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
