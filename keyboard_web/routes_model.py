"""The served model for the page's browser mode: GET /model.onnx, /model.json and the n-gram it
mixes in, /ngram.safetensors, from memory, with the header X-Fedkey-Round."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from fedkey.keyboard_web.deps import KeyboardDep
from fedkey.keyboard_web.schemas import MODEL_HEADERS, ErrorBody
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


@router.get(
    "/ngram.safetensors",
    response_class=Response,
    responses={
        200: {
            "description": "The n-gram the served model mixes in (fedkey.models.ngram, format "
            '"fedkey-kn-1"), as exported and checked against model.json\'s sha256.',
            "content": {"application/octet-stream": {}},
            "headers": MODEL_HEADERS,
        },
        404: {
            "model": ErrorBody,
            "description": "The export names no n-gram, or its file is not used (why: detail).",
        },
    },
)
async def ngram_safetensors(keyboard: KeyboardDep):
    """The served model's n-gram, for the page's in-browser mode."""
    s = keyboard.holder.current
    if s.ngram.lm is None:
        detail = s.ngram.error or "the served model mixes in no n-gram"
        return JSONResponse({"detail": detail}, status_code=404, headers=model_headers(s))
    return Response(s.ngram.data, media_type="application/octet-stream", headers=model_headers(s))
