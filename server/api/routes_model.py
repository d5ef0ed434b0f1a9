"""The global model: GET /v1/model."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from server.api.deps import CoordinatorDep
from server.api.schemas import errors

router = APIRouter(tags=["model"])

#: Bytes per write of a model download. uvicorn waits for a connection's transport to drain
#: between writes, so a download holds about this plus the transport's high-water mark (64 KB)
#: in memory. A whole-body Response put all of a slow reader's 4.4 MB (and h11's copy of it) in
#: its transport at once: the round's 1,000 downloads took the server of 10,000 phones from 0.74
#: to 1.3 GB (fedkey bench load). Under the allocator's mmap threshold, so no mmap per write.
DOWNLOAD_CHUNK = 1 << 16
#: Chunks sent between two yields to the event loop. A fast reader never pauses the transport, so
#: without a yield a whole 4.4 MB download went out in one task step (about 2.5 ms of the loop's
#: CPU); the round's 1,000 downloads, all asked for as it opens, then made event-loop iterations
#: of 0.1-0.3 s in which /healthz waited (fedkey bench load at 10,000 phones, a trace of the
#: loop's iterations). A yield costs about 11 us: every 8 chunks, 4% more CPU a download.
YIELD_EVERY = 8


class ChunkedResponse(Response):
    """A bytes body sent in ``DOWNLOAD_CHUNK`` slices (no copies), with its Content-Length,
    yielding to the event loop every ``YIELD_EVERY`` slices."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        body = memoryview(self.body)
        for i, start in enumerate(range(0, len(body), DOWNLOAD_CHUNK)):
            chunk = body[start : start + DOWNLOAD_CHUNK]
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)  # let the loop serve others between two slices
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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
    return ChunkedResponse(data, media_type="application/octet-stream", headers=headers)
