"""The documentation's reference pages, generated from the code at build time so they cannot drift.

mkdocs.yml names this file under ``hooks:``; its ``on_files`` adds the pages below to the site
(none is a file in docs/):

    reference/cli.md            the `fedkey` command tree (the Typer app, cli.app, walked as click
                                commands): every command, its help, its arguments and options
    reference/configuration.md  server.settings.Settings: every field, its FEDKEY_* variable, type,
                                default and meaning
    reference/http-api.md       the federation server's OpenAPI document (server.app.create_app)
    reference/metrics.md        a metrics row's fields (server.metrics_row)
    reference/checkpoint.md     the checkpoint file (models.checkpoint.METADATA, the model's tensors)

Each generator returns the page's Markdown; tests/test_docs.py calls them.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tempfile
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the hook is loaded by path: the build documents this checkout
    sys.path.insert(0, str(ROOT))

GENERATED_NOTE = "<!-- Generated at build time by tools/docs_reference.py from the code; not a file in docs/. -->"


def cell(text: object) -> str:
    """A value made safe for one cell of a Markdown table."""
    s = " ".join(str(text).split())
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def code(text: object) -> str:
    """Inline code for a table cell (Python-Markdown's tables split no cell at a pipe inside
    backticks, so none is escaped)."""
    s = " ".join(str(text).split())
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def paragraphs(text: str | None) -> str:
    """A docstring-style help text (hard-wrapped lines, blank lines between paragraphs) as
    Markdown paragraphs."""
    if not text:
        return ""
    parts = re.split(r"\n\s*\n", text.replace("\b", "").strip())
    return "\n\n".join(" ".join(p.split()) for p in parts)


# -- the command line ------------------------------------------------------------------------------


def cli_commands() -> list[tuple[str, Any]]:
    """Every command of the `fedkey` app as (full name, click command), groups included, in the
    order `fedkey --help` lists them."""
    import typer.main

    from cli import app

    root = typer.main.get_command(app)
    found: list[tuple[str, Any]] = []

    def walk(name: str, command: Any) -> None:
        found.append((name, command))
        for sub_name, sub in getattr(command, "commands", {}).items():
            if not getattr(sub, "hidden", False):
                walk(f"{name} {sub_name}", sub)

    walk("fedkey", root)
    return found


def _type_of(param: Any, ctx: Any) -> str:
    try:
        shown = str(param.display_type(ctx))  # typer's own rendering: <fedavg|fedatt>, <int range>
    except (AttributeError, TypeError):
        shown = getattr(getattr(param, "type", None), "name", "")
    return shown.strip("<>")


def _default_of(param: Any) -> str:
    if getattr(param, "required", False):
        return "required"
    default = param.default
    if callable(default) or default is None or default is False or default == "":
        return ""
    if isinstance(default, bool) and getattr(param, "secondary_opts", None):
        return code(param.opts[0] if default else param.secondary_opts[0])
    if isinstance(default, (list, tuple)):
        return code(", ".join(map(str, default))) if default else ""
    return code(default)


def _range_of(param: Any) -> str:
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    if low is None and high is None:
        return ""
    if low is not None and high is not None:
        return f" ({low} to {high})"
    return f" (at least {low})" if low is not None else f" (at most {high})"


def cli_reference() -> str:
    """reference/cli.md: every `fedkey` command with its help and its parameters."""
    from typer._click import Context

    lines = [
        GENERATED_NOTE,
        "# Command line",
        "",
        "Every command of `fedkey` (`python -m cli` is the same program), as `fedkey <command> "
        "--help` prints it. Options marked with a `FEDKEY_*` variable can also be set by that "
        "environment variable; a flag wins over the variable.",
        "",
    ]
    for name, command in cli_commands():
        ctx = Context(command, info_name=name)
        lines += [f"## `{name}`", "", paragraphs(command.help), ""]
        subcommands = getattr(command, "commands", {})
        if subcommands:
            lines += ["| command | what it does |", "|---|---|"]
            for sub_name, sub in subcommands.items():
                summary = paragraphs(sub.short_help or sub.help).split("\n\n")[0]
                slug = re.sub(r"[^a-z0-9]+", "-", f"{name} {sub_name}".lower()).strip("-")
                lines.append(f"| [`{name} {sub_name}`](#{slug}) | {cell(summary)} |")
            lines.append("")
        params = [p for p in command.params if not getattr(p, "hidden", False)]
        arguments = [p for p in params if getattr(p, "param_type_name", "") == "argument"]
        options = [p for p in params if getattr(p, "param_type_name", "") == "option"]
        if arguments:
            lines += ["| argument | type | meaning |", "|---|---|---|"]
            for p in arguments:
                meaning = getattr(p, "help", None) or ""
                required = "" if getattr(p, "required", False) else " (optional)"
                lines.append(
                    f"| {code(p.name.upper())} | {cell(_type_of(p, ctx))} | {cell(meaning)}{required} |"
                )
            lines.append("")
        if options:
            lines += ["| option | type | default | meaning |", "|---|---|---|---|"]
            for p in options:
                flags = " / ".join(code(f) for f in [*p.opts, *p.secondary_opts])
                meaning = cell(getattr(p, "help", None) or "")
                if p.envvar:
                    envvars = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar)
                    meaning += " " + " ".join(f"[env: {code(e)}]" for e in envvars)
                kind = "flag" if getattr(p, "is_flag", False) else _type_of(p, ctx)
                lines.append(
                    f"| {flags} | {cell(kind + _range_of(p))} | {_default_of(p)} | {meaning} |"
                )
            lines.append("")
    return "\n".join(lines)


# -- the configuration -----------------------------------------------------------------------------


def _comments(source: str) -> dict[str, str]:
    """Settings field name -> the comment that explains it in server/settings.py: the comment on
    its line, else the comment lines directly above it."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Settings")
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        row = node.lineno
        if row in comments and not lines[row - 1].lstrip().startswith("#"):
            found[node.target.id] = comments[row]
            continue
        above: list[str] = []
        row -= 1
        while row in comments and lines[row - 1].lstrip().startswith("#"):
            if comments[row].startswith("--"):  # a section header: "-- model ----"
                break
            above.insert(0, comments[row])
            row -= 1
        found[node.target.id] = " ".join(above)
    return found


def _option_helps() -> dict[str, tuple[str, str]]:
    """FEDKEY_* variable -> (the flag, its help), from every command that has the option."""
    helps: dict[str, tuple[str, str]] = {}
    for _, command in cli_commands():
        for p in getattr(command, "params", []):
            envvar = getattr(p, "envvar", None)
            if isinstance(envvar, str) and getattr(p, "help", None) and envvar not in helps:
                helps[envvar] = (p.opts[0], p.help)
    return helps


def _type_name(annotation: Any) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"typing\.Literal\[(.*?)\]", lambda m: m.group(1).replace(", ", " | "), text)
    text = text.replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")
    return text.replace("NoneType", "None").replace("'", "")


def settings_fields() -> dict[str, Any]:
    """server.settings.Settings's fields, name -> pydantic FieldInfo."""
    from server.settings import Settings

    return dict(Settings.model_fields)


def configuration_reference() -> str:
    """reference/configuration.md: every Settings field."""
    import server.settings
    from server.settings import Settings

    prefix = str(Settings.model_config.get("env_prefix", "FEDKEY_"))
    comments = _comments(Path(server.settings.__file__).read_text())
    helps = _option_helps()
    lines = [
        GENERATED_NOTE,
        "# Configuration",
        "",
        "`fedkey server` (and `python -m server.main`, which `fedkey run` starts) is configured by "
        "one pydantic-settings class, `server/settings.py`. Every field is an environment "
        f"variable `{prefix}<NAME>`; the federation's options are also flags of `simulate`, "
        "`server` and `run`, with the same defaults (a flag wins over the variable). The flag "
        "column names the flag where there is one.",
        "",
        "| variable | flag | type | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, field in settings_fields().items():
        envvar = f"{prefix}{name.upper()}"
        flag, help_text = helps.get(envvar, ("", ""))
        meaning = field.description or help_text or comments.get(name, "")
        default = field.default
        if type(default).__name__ == "SecretStr" or default is None:
            shown = "" if default is None else "(secret)"
        else:
            shown = code(default)
        limits = [
            f"{op} {getattr(m, attr)}"
            for m in field.metadata
            for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if getattr(m, attr, None) is not None
        ]
        kind = _type_name(field.annotation) + (f" ({', '.join(limits)})" if limits else "")
        lines.append(
            f"| {code(envvar)} | {code(flag) if flag else ''} | {cell(kind)} | {shown} | {cell(meaning)} |"
        )
    lines.append("")
    return "\n".join(lines)


# -- the HTTP API ------------------------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    """The federation server's OpenAPI document, from an app built on a throwaway storage."""
    from server.app import create_app
    from server.settings import Settings

    with tempfile.TemporaryDirectory() as storage:
        return create_app(Settings(storage=Path(storage))).openapi()


def _schema_text(schema: dict[str, Any] | None) -> str:
    if not schema:
        return ""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if schema.get("type") == "array":
        return f"list of {_schema_text(schema.get('items'))}"
    if "anyOf" in schema:
        return " or ".join(_schema_text(s) for s in schema["anyOf"])
    return str(schema.get("type", schema.get("format", "")))


def _websockets() -> Iterator[tuple[str, str]]:
    """(path, description) of the app's WebSocket routes, which OpenAPI leaves out: the
    description is the docstring of the module that defines each route."""
    from server.app import create_app
    from server.settings import Settings

    with tempfile.TemporaryDirectory() as storage:
        app = create_app(Settings(storage=Path(storage)))

    def walk(routes: Any) -> Iterator[Any]:
        for route in routes:
            inner = getattr(route, "original_router", None) or getattr(route, "router", None)
            if inner is not None and hasattr(inner, "routes"):
                yield from walk(inner.routes)
            else:
                yield route

    for route in walk(app.routes):
        if "WebSocket" in type(route).__name__:
            module = sys.modules.get(getattr(route.endpoint, "__module__", ""))
            text = route.endpoint.__doc__ or (module.__doc__ if module else "") or ""
            yield route.path, paragraphs(text)


def http_api_reference() -> str:
    """reference/http-api.md: each route of the OpenAPI document, and the schemas it names."""
    doc = openapi_document()
    inline: dict[str, Any] = {}  # request bodies the document spells out in place
    lines = [
        GENERATED_NOTE,
        "# HTTP API",
        "",
        f"The federation server's routes (`fedkey server`; OpenAPI {doc.get('openapi', '')}, "
        f"version {doc['info'].get('version', '')}). A running server serves the same document at "
        "`/openapi.json` and an explorer at `/docs`. Every error is a JSON body "
        '`{"detail": "<message>"}`; "bearer" means `Authorization: Bearer <token>`, the token '
        "`POST /v1/devices` returned.",
        "",
    ]
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            lines += [f"## `{method.upper()} {path}`", "", paragraphs(op.get("description"))]
            lines.append("")
            auth = "bearer" if op.get("security") else "none"
            lines += ["| part | description |", "|---|---|", f"| auth | {auth} |"]
            for p in op.get("parameters", []):
                what = f"{p['in']} parameter {code(p['name'])}"
                need = "required" if p.get("required") else "optional"
                kind = _schema_text(p.get("schema"))
                lines.append(f"| {what} | {cell(kind)}, {need}: {cell(p.get('description', ''))} |")
            body = op.get("requestBody")
            if body:
                for media, content in body.get("content", {}).items():
                    schema = content.get("schema") or {}
                    if "properties" in schema and "title" in schema:  # an inline body: listed below
                        inline[schema["title"]] = schema
                        shown = f"[{schema['title']}](#{schema['title'].lower()})"
                    else:
                        shown = _schema_text(schema)
                    lines.append(
                        f"| request body | {code(media)} {shown} "
                        f"{cell(body.get('description', '') or schema.get('description', ''))} |"
                    )
            responses = op.get("responses", {})
            for status in sorted(responses):
                answer = responses[status]
                media = ", ".join(
                    f"{code(m)} {_schema_text(c.get('schema'))}".strip()
                    for m, c in answer.get("content", {}).items()
                )
                lines.append(f"| {status} | {cell(answer.get('description', ''))} {media} |")
            lines.append("")
    sockets = list(_websockets())
    if sockets:
        lines += [
            "## WebSockets",
            "",
            "Not in the OpenAPI document, which describes HTTP only.",
            "",
        ]
        for path, text in sockets:
            lines += [f"### `WS {path}`", "", text, ""]
    schemas = {**doc.get("components", {}).get("schemas", {}), **inline}
    if schemas:
        lines += ["## Schemas", ""]
        for name, schema in sorted(schemas.items()):
            lines += [f"### {name}", "", paragraphs(schema.get("description")), ""]
            props = schema.get("properties", {})
            if props:
                required = set(schema.get("required", []))
                lines += ["| field | type | required | meaning |", "|---|---|---|---|"]
                for field, spec in props.items():
                    need = "yes" if field in required else ""
                    lines.append(
                        f"| {code(field)} | {_schema_text(spec) or cell(spec.get('title', ''))} "
                        f"| {need} | {cell(spec.get('description', ''))} |"
                    )
                lines.append("")
    return "\n".join(lines)


# -- metrics.jsonl ---------------------------------------------------------------------------------


def metrics_reference() -> str:
    """reference/metrics.md: the fields of a metrics row (server.metrics_row)."""
    from server import metrics_row

    lines = [
        GENERATED_NOTE,
        "# Metrics rows",
        "",
        paragraphs(metrics_row.__doc__).split("\n\n")[0],
        "",
        "A run writes one row a round to `RUN_DIR/metrics.jsonl` (round 0 is the initial model); "
        "a server also answers them at `GET /v1/metrics`, with NaN and infinities as null. "
        "`fedkey ngram` writes one row, round 0, without the precision and device fields.",
        "",
        "## Every row",
        "",
        "| field | type | meaning |",
        "|---|---|---|",
    ]
    for name, field in metrics_row.ALWAYS.items():
        lines.append(f"| {code(name)} | {cell(field.type)} | {cell(field.description)} |")
    lines += [
        "",
        "## When an option asks for them",
        "",
        "| field | type | when | meaning |",
        "|---|---|---|---|",
    ]
    for name, field in metrics_row.CONDITIONAL.items():
        lines.append(
            f"| {code(name)} | {cell(field.type)} | {field.when} | {cell(field.description)} |"
        )
    lines.append("")
    return "\n".join(lines)


# -- the checkpoint ------------------------------------------------------------------------------


def checkpoint_reference() -> str:
    """reference/checkpoint.md: what a checkpoint file holds (models.checkpoint)."""
    import dataclasses

    from models import checkpoint
    from models.config import ModelConfig

    config = ModelConfig.preset("small", 10_000)
    shapes = checkpoint.expected_shapes(config)
    lines = [
        GENERATED_NOTE,
        "# Checkpoint format",
        "",
        paragraphs(checkpoint.__doc__),
        "",
        "A run's checkpoints are `RUN_DIR/checkpoints/round_NNNN.safetensors` (`round_0000` is "
        "the initial model); with a server optimizer its buffers are in "
        "`server_opt_NNNN.safetensors` beside them. `fedkey info` prints what one holds.",
        "",
        f"## Metadata (format {checkpoint.FORMAT_VERSION})",
        "",
        'The safetensors header\'s metadata has one key, `"fedkey"`, whose value is a JSON '
        "object with these keys:",
        "",
        "| key | meaning |",
        "|---|---|",
    ]
    for key, meaning in checkpoint.METADATA.items():
        lines.append(f"| {code(key)} | {cell(meaning)} |")
    lines += [
        "",
        "The model config (`model`):",
        "",
        "| field | default |",
        "|---|---|",
    ]
    for f in dataclasses.fields(ModelConfig):
        default = "" if f.default is dataclasses.MISSING else code(f.default)
        lines.append(f"| {code(f.name)} | {default} |")
    lines += [
        "",
        "## Tensors",
        "",
        "One tensor per parameter, named as in the model's `state_dict`; a tied model (the "
        "default) stores the matrix its embedding and output layer share once. The small preset "
        "(GRU, 300, tied) at a 10,000-word vocabulary:",
        "",
        "| tensor | shape | dtype |",
        "|---|---|---|",
    ]
    for name, (shape, dtype) in shapes.items():
        lines.append(
            f"| {code(name)} | {code(list(shape))} | {code(str(dtype).removeprefix('torch.'))} |"
        )
    lines += [
        "",
        "Loading a checkpoint whose tensors do not match its `model` config fails with a message "
        "naming the tensor.",
        "",
        "Read one in Python:",
        "",
        "```python",
        "import json",
        "from safetensors import safe_open",
        "",
        'with safe_open("runs/fedatt/checkpoints/round_0005.safetensors", "pt") as f:',
        '    meta = json.loads(f.metadata()["fedkey"])',
        "    tensors = {name: f.get_tensor(name) for name in f.keys()}",
        "```",
        "",
    ]
    return "\n".join(lines)


#: docs path -> its generator.
PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_reference,
    "reference/configuration.md": configuration_reference,
    "reference/http-api.md": http_api_reference,
    "reference/metrics.md": metrics_reference,
    "reference/checkpoint.md": checkpoint_reference,
}


# -- the mkdocs hook -------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add every generated page to the site's files."""
    from mkdocs.structure.files import File

    for path, generate in PAGES.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=generate()))
    return files


if __name__ == "__main__":  # python tools/docs_reference.py reference/cli.md: print one page
    for page in sys.argv[1:] or list(PAGES):
        print(PAGES[page]())
