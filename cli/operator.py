"""The operator's commands against a running `fedkey server`: `fedkey enroll-tokens N` mints
single-use enrollment tokens (one device each), `fedkey revoke DEVICE` stops a device's token.
Both authenticate with the server's operator token, read from FEDKEY_OPERATOR_TOKEN."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from fedkey.cli.errors import UserError
from fedkey.cli.options import check_url

SERVER = typer.Option(
    "http://127.0.0.1:8000", "--server", callback=check_url, help="The federation server's URL."
)


def operator_request(method: str, server: str, path: str, **kw: Any) -> Any:
    """One operator request (FEDKEY_OPERATOR_TOKEN as the bearer): its JSON answer, or a
    UserError saying what the server answered."""
    import httpx

    token = os.environ.get("FEDKEY_OPERATOR_TOKEN")
    if not token:
        raise UserError("set FEDKEY_OPERATOR_TOKEN to the server's operator token")
    headers = {"Authorization": f"Bearer {token}"}
    try:
        r = httpx.request(method, server.rstrip("/") + path, headers=headers, timeout=30, **kw)
    except httpx.HTTPError as e:
        raise UserError(f"the server at {server} did not answer: {e}") from None
    if r.is_error:
        try:
            detail = r.json()["detail"]
        except (ValueError, KeyError, TypeError):
            detail = r.text[:200]
        raise UserError(f"{method} {path}: {r.status_code} {detail}")
    return r.json()


def enroll_tokens(
    count: int = typer.Argument(..., min=1, max=100_000, help="How many tokens to mint."),
    server: str = SERVER,
    ttl: float = typer.Option(
        7 * 24 * 3600.0, "--ttl", min=1.0, help="Seconds each token stays usable."
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        dir_okay=False,
        help="Write the tokens here (one a line, readable by you alone) instead of printing them.",
    ),
) -> None:
    """Mint single-use enrollment tokens on a running server: each enrolls one device (as its
    `enrollment_secret`), once, before it expires. Needs FEDKEY_OPERATOR_TOKEN."""
    from fedkey.common.files import atomic_write

    body = {"count": count, "ttl": ttl}
    tokens = operator_request("POST", server, "/v1/enrollment-tokens", json=body)["tokens"]
    text = "".join(t + "\n" for t in tokens)
    if out is None:
        typer.echo(text, nl=False)
        return
    atomic_write(out, text, mode=0o600)
    typer.echo(f"{len(tokens)} enrollment tokens in {out}", err=True)


def revoke(
    device: str = typer.Argument(..., help="The device id to revoke."),
    server: str = SERVER,
) -> None:
    """Revoke a device on a running server: its token stops working at once, it is selected no
    more, and its name cannot be enrolled again. Needs FEDKEY_OPERATOR_TOKEN."""
    from urllib.parse import quote

    answer = operator_request("DELETE", server, f"/v1/devices/{quote(device, safe='')}")
    typer.echo(f"revoked {answer['device_id']}")
