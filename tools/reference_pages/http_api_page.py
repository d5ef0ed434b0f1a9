"""reference/http-api.md: the federation server's OpenAPI document (fedkey.server.app.create_app), each
route and the schemas it names, and the WebSocket routes OpenAPI leaves out."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tools.reference_pages.markup import GENERATED_NOTE, cell, code, paragraphs


def openapi_document() -> dict[str, Any]:
    """The federation server's OpenAPI document, from an app built on a throwaway storage."""
    from fedkey.server.app import create_app
    from fedkey.server.settings import Settings

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
    from fedkey.server.app import create_app
    from fedkey.server.settings import Settings

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
