"""A bounded schema fuzz of the federation server: schemathesis reads the
server's own OpenAPI document and drives hypothesis over every operation, with a device's bearer
token, with an unknown token and with none, in positive and negative data. No answer may be a 5xx,
a status the document does not state, or a body, content type or header other than documented;
afterwards the federation is intact: the global model, its checkpoint and the metrics are what
they were, and after a restart the same round completes with real phones.

The server is a real uvicorn on loopback (what a phone meets), with the tiny model on the demo
corpus of the other server tests (fedkey.testing.http), round 1 open and both phones selected. Two
nudges take the fuzz past gates a schema cannot state: about half the enrollments carry the right
secret, and about half of phone B's uploads its real update (so the X-Fedkey-* headers are fuzzed
too, and an update can be taken). The run is bounded and the same every time: MAX_EXAMPLES generated cases per operation on top of
schemathesis's deterministic examples and coverage cases, derandomized, no example database, no
shrinking; every request times out after REQUEST_TIMEOUT s, and long-polls are cut to LONG_POLL s.
"""

from __future__ import annotations

import contextlib
import secrets
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    missing_required_header,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import fedkey.server.api.deps
import fedkey.server.device_views
from fedkey.runners.processes import free_port
from fedkey.server.app import create_app
from fedkey.server.main import build_server
from fedkey.server.settings import Settings
from fedkey.testing.http import SECRET, Phone, make_settings, shards, snapshot, wait_round
from fedkey.testing.wait import wait_for

pytestmark = pytest.mark.slow

#: Generated cases per operation and authorization (hypothesis's max_examples).
MAX_EXAMPLES = 40
#: The longest long-poll during the fuzz (?wait= is clamped to it; 60 s in service).
LONG_POLL = 0.05
#: Seconds a request may take before the fuzz fails it (a hang is a finding too).
REQUEST_TIMEOUT = 30
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
    missing_required_header,
]


def openapi_document() -> dict:
    """The document the server answers at /openapi.json (building the app starts nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        return create_app(make_settings(Path(tmp))).openapi()


DOCUMENT = openapi_document()
#: The fuzz, in schemathesis.toml's terms. A missing required header (the upload's X-Fedkey-*)
#: may be answered by a gate the server checks first: the token (401), the round (409: not the
#: open one; 403: not selected), the body (413, 400).
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 0,
        "suppress-health-check": ["too_slow"],
        "generation": {
            "mode": "all",  # positive and negative data
            "max-examples": MAX_EXAMPLES,
            "deterministic": True,
            "database": "none",
            "no-shrink": True,
            "with-security-parameters": False,  # the test sets Authorization itself
        },
        "checks": {
            "missing_required_header": {"expected-statuses": [400, 401, 403, 409, 413, 422]}
        },
    }
)
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


@contextlib.contextmanager
def live_server(settings: Settings) -> Iterator[str]:
    """`fedkey server` under uvicorn in a thread, on loopback; yields its base URL."""
    server_ = build_server(settings, log_level="warning")
    thread = threading.Thread(target=server_.run, daemon=True)
    thread.start()
    base = f"http://{settings.host}:{settings.port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=120, every=0.1, what="the server did not start")
        yield base
    finally:
        server_.should_exit = True
        thread.join(timeout=60)
    assert not thread.is_alive(), "the server did not stop"


def http_client(base: str) -> httpx.Client:
    """An httpx.Client on `base`, for fedkey.testing.http's phones and snapshots."""
    return httpx.Client(base_url=base, timeout=30)


@dataclass
class Federation:
    """The server under fuzz: where it is, its two phones, and what the fuzz may not change."""

    settings: Settings
    base: str
    client: httpx.Client
    phones: list[Phone]
    before: dict
    running: contextlib.ExitStack
    answered: Counter[tuple[str, str, int]] = field(default_factory=Counter)

    @property
    def storage(self) -> Path:
        return Path(self.settings.storage)

    def stop(self) -> None:
        """Stop the server (and its client)."""
        self.running.close()


@pytest.fixture(scope="module")
def federation(tmp_path_factory) -> Iterator[Federation]:
    """Two phones enrolled and selected in round 1, which is open; rounds=1, so the round's end
    is the run's. The round's deadline is far off: it stays attempt 0 however long the fuzz runs
    (at the deadline it would fail for want of uploads and reopen with every device the fuzz
    enrolled)."""
    settings = make_settings(
        tmp_path_factory.mktemp("fuzz"),
        port=free_port(),
        rounds=1,
        wait_devices=2,
        round_deadline=3600.0,
    )
    with pytest.MonkeyPatch.context() as mp, contextlib.ExitStack() as running:
        mp.setattr(fedkey.server.api.deps, "MAX_WAIT", LONG_POLL)
        mp.setattr(fedkey.server.device_views, "MAX_WAIT", LONG_POLL)
        base = running.enter_context(live_server(settings))
        client = running.enter_context(http_client(base))
        phones = [Phone(client, n, s).enroll() for n, s in shards(2).items()]
        wait_for(lambda: phones[1].current()["state"] == "open")
        for p in phones:
            p.train(p.current())  # their updates, uploaded after the fuzz
        before = snapshot(client, settings.storage)
        yield Federation(settings, base, client, phones, before, running)


def test_the_fuzzed_document_is_the_served_one(federation: Federation) -> None:
    assert federation.client.get("/openapi.json").json() == DOCUMENT


def fuzz(case, federation: Federation, auth: str) -> None:
    """Send `case` with `auth`'s Authorization header and run the checks on the answer."""
    headers = dict(case.headers or {})
    headers.pop("Authorization", None)
    if auth == "device token":  # phone B's: selected in the open round 1
        headers["Authorization"] = f"Bearer {federation.phones[1].token}"
    elif auth == "unknown token":
        headers["Authorization"] = f"Bearer {secrets.token_urlsafe(32)}"
    case.headers = headers
    body = case.body
    if (
        case.path == "/v1/devices"
        and isinstance(body, dict)
        and isinstance(body.get("enrollment_secret"), str)
        and len(body["enrollment_secret"]) % 2 == 0
    ):
        body["enrollment_secret"] = SECRET  # about half the enrollments get past the secret
    if (
        case.path == "/v1/rounds/{n}/update"
        and auth == "device token"
        and isinstance(raw := getattr(body, "data", body), bytes)  # schemathesis's Binary
        and len(raw) % 2 == 0
    ):
        # about half the uploads are phone B's real update: past the body's checks to the
        # X-Fedkey-* headers' (random bytes are refused first, 400, not safetensors)
        case.body = federation.phones[1].body()
    response = case.call(base_url=federation.base, timeout=REQUEST_TIMEOUT)
    federation.answered[(auth, f"{case.method} {case.path}", response.status_code)] += 1
    case.validate_response(response, checks=CHECKS)


@schema.parametrize()
def test_with_the_device_token(case, federation: Federation) -> None:
    fuzz(case, federation, "device token")


@schema.parametrize()
def test_with_an_unknown_token(case, federation: Federation) -> None:
    fuzz(case, federation, "unknown token")


@schema.parametrize()
def test_without_a_token(case, federation: Federation) -> None:
    fuzz(case, federation, "no token")


def test_the_fuzz_reached_past_the_gates(federation: Federation) -> None:
    """The fuzz reached past the gates: the device token past authentication into the round's
    checks, the bodies' and the headers' validation, a loss report and an update taken; about half
    the enrollments past the secret into the name and count checks."""
    answered = federation.answered
    if {auth for auth, _, _ in answered} != {"device token", "unknown token", "no token"}:
        pytest.skip("run with the three fuzz tests above")

    def statuses(auth: str, op: str) -> set[int]:
        return {s for (a, o, s), _ in answered.items() if a == auth and o == op}

    for auth in ("unknown token", "no token"):
        for op in ("GET /v1/rounds/current", "POST /v1/rounds/{n}/loss"):
            assert statuses(auth, op) <= {401, 405, 422}, (auth, op, statuses(auth, op))
    token = "device token"
    assert {200, 422} <= statuses(token, "GET /v1/rounds/current")
    assert {200, 409, 422} <= statuses(token, "POST /v1/rounds/{n}/loss")
    assert {200, 400, 409, 422} <= statuses(token, "POST /v1/rounds/{n}/update")
    assert {200, 401, 422} <= statuses("no token", "POST /v1/devices")
    assert not any(s >= 500 for (_, _, s) in answered)


def test_the_federation_is_intact_after_the_fuzz(federation: Federation) -> None:
    """Model, checkpoints and metrics unchanged; after a restart on the same storage (the rows the
    fuzz wrote read back) round 1 is still open, phone B's loss report and update taken if the
    fuzz sent them, and the two phones complete it (B's update again: the same receipt, or 409 when
    the fuzz's upload of the same bytes declared another sample count or loss)."""
    fuzzed = federation.answered
    reported = fuzzed[("device token", "POST /v1/rounds/{n}/loss", 200)] > 0
    uploaded = fuzzed[("device token", "POST /v1/rounds/{n}/update", 200)] > 0
    assert snapshot(federation.client, federation.storage) == federation.before
    federation.stop()
    settings = federation.settings.model_copy(update={"port": free_port()})
    with live_server(settings) as base, http_client(base) as client:
        assert snapshot(client, federation.storage) == federation.before
        health = client.get("/healthz").json()
        assert (health["round"], health["state"]) == (1, "open"), health
        for p in federation.phones:
            p.client = client  # the same tokens, on the restarted server
            view = p.current()
            assert (view["round"], view["attempt"]) == (1, 0), view
            b = p is federation.phones[1]
            assert view["selected"] and view["uploaded"] == (b and uploaded), view
            assert view["loss_reported"] == (b and reported), view
            r = p.upload()
            if b and uploaded and r.status_code == 409:  # the fuzz's upload declared otherwise
                assert "already uploaded a different update" in r.json()["detail"], r.text
            else:
                assert r.status_code == 200, r.text
        assert wait_round(client, 1)[-1]["round"] == 1
        assert client.get("/v1/model").headers["X-Fedkey-Round"] == "1"
        wait_for(lambda: client.get("/healthz").json()["state"] == "finished")
