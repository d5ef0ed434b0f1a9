"""The served model for the page's browser mode: GET /model.onnx and /model.json, from memory,
with the header X-Fedkey-Round."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from fedkey.keyboard_web.deps import KeyboardDep
from fedkey.keyboard_web.schemas import MODEL_HEADERS
from fedkey.keyboard_web.suggest import Suggester

router = APIRouter(tags=["model"])


def model_headers(s: Suggester) -> dict:
    return {
        "X-Fedkey-Round": str(s.round),
        "Cache-Control": "no-cache",
    }


@router.get(
    "/model.onnx",
    response_class=Response,
    responses={
        200: {
            "description": "The served model (ONNX), as exported.",
            "content": {"application/octet-stream": {}},
            "headers": MODEL_HEADERS,
        }
    },
)
async def model_onnx(keyboard: KeyboardDep):
    """The served model, for the page's in-browser mode."""
    s = keyboard.holder.current
    return Response(s.onnx_bytes, media_type="application/octet-stream", headers=model_headers(s))


@router.get(
    "/model.json",
    response_class=Response,
    responses={
        200: {
            "description": "The served model's metadata (fedkey.export.metadata), as exported.",
            "content": {"application/json": {}},
            "headers": MODEL_HEADERS,
        }
    },
)
async def model_json(keyboard: KeyboardDep):
    """The served model's metadata: vocabulary, shape, round, strategy, metrics, privacy."""
    s = keyboard.holder.current
    return Response(s.metadata_bytes, media_type="application/json", headers=model_headers(s))
