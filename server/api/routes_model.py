"""The global model: GET /v1/model."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.deps import CoordinatorDep
from server.api.schemas import errors

router = APIRouter(tags=["model"])

MODEL_HEADERS = {
    "ETag": {"description": "the checkpoint's sha256, quoted", "schema": {"type": "string"}},
    "X-Fedkey-Round": {"description": "the round of this model", "schema": {"type": "integer"}},
}


def etag_matches(header: str, sha: str) -> bool:
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        if tag.startswith("W/"):
            tag = tag[2:]
        if tag.strip('"') == sha:
            return True
    return False


@router.get(
    "/v1/model",
    response_class=Response,
    responses={
        200: {
            "description": "the global model as a checkpoint file (safetensors; its header "
            "carries the model config and tokenizer)",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
            "headers": MODEL_HEADERS,
        },
        304: {
            "description": "not modified: If-None-Match holds the ETag",
            "headers": MODEL_HEADERS,
        },
        **errors({}),
    },
    openapi_extra={
        "parameters": [
            {
                "name": "If-None-Match",
                "in": "header",
                "required": False,
                "description": "ETags answered before: 304 when one is the current model's",
                "schema": {"type": "string"},
            }
        ]
    },
)
async def model(request: Request, coordinator: CoordinatorDep):
    """The global model; ETag = its sha256."""
    rnd, data, sha = coordinator.model()
    if_none_match = request.headers.get("if-none-match")
    headers = {
        "ETag": f'"{sha}"',
        "X-Fedkey-Round": str(rnd),
        "Cache-Control": "no-cache",
    }
    if if_none_match and etag_matches(if_none_match, sha):
        return Response(status_code=304, headers=headers)
    headers["Content-Disposition"] = f'attachment; filename="round_{rnd:04d}.safetensors"'
    return Response(data, media_type="application/octet-stream", headers=headers)
