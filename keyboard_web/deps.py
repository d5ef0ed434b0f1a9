"""What the keyboard's routes depend on: the app's `Keyboard` (fedkey.keyboard_web.service).

`async def`: FastAPI runs a plain `def` dependency in a worker thread, and the keyboard's state
is used from the event loop only.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection

from fedkey.keyboard_web.service import Keyboard


async def get_keyboard(conn: HTTPConnection) -> Keyboard:
    return conn.app.state.keyboard


KeyboardDep = Annotated[Keyboard, Depends(get_keyboard)]
