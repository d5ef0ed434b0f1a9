"""The page: GET / (static/index.html), /static/..., and /vendor/... (onnxruntime-web's dist/
for browser mode, or a 404 that says how to install it)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from fedkey.keyboard_web.deps import KeyboardDep
from fedkey.keyboard_web.service import STATIC_DIR, browser_mode_status

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index():
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


no_vendor_router = APIRouter()


@no_vendor_router.get("/vendor/{path:path}", include_in_schema=False)
async def no_vendor(path: str, keyboard: KeyboardDep):
    return JSONResponse(
        {"detail": browser_mode_status(keyboard.ort_dist)["reason"]}, status_code=404
    )


def mount_files(app: FastAPI) -> None:
    """/static, and /vendor when onnxruntime-web is installed (its 404 route when not)."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    ort_dist = app.state.keyboard.ort_dist
    if ort_dist.is_dir():
        app.mount("/vendor", StaticFiles(directory=ort_dist), name="vendor")
    else:
        app.include_router(no_vendor_router)
