"""Hostile and odd requests: never a 5xx, always a one-line 4xx reason, nothing changed; the
enrollment rate limit (429 + Retry-After); the limits uvicorn is started with."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from fedkey.federation.updates import validation
from fedkey.runners.processes import SERVER_ENV, free_port, server_env
from fedkey.server.app import MAX_JSON_BODY, _clamp_wait, create_app
from fedkey.server.main import HeadLimitedHttpTools, build_server
from fedkey.server.runtime.rate_limit import RateLimiter
from fedkey.server.settings import MAX_WAIT, Settings
from fedkey.testing.http import SECRET, enroll_phones, make_settings, running, snapshot
from fedkey.testing.wait import wait_for

ENROLL_SHAPE = '{"enrollment_secret": str'


def check(response, status: int, *words: str) -> str:
    """`status`, and a detail of one line holding every word."""
    assert response.status_code == status, (response.status_code, response.text)
    detail = response.json()["detail"]
    assert isinstance(detail, str) and 10 < len(detail) < 400 and "\n" not in detail, detail
    for w in words:
        assert w.lower() in detail.lower(), (w, detail)
    return detail


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two phones enrolled, round 1 open, phone B trained (its upload not sent)."""
    tmp = tmp_path_factory.mktemp("hostile")
    settings = make_settings(tmp, rounds=1, wait_devices=2)
    with running(settings) as client:
        a, b = enroll_phones(client, 2)
        view = wait_for(lambda: (v := b.current()) and v["state"] == "open" and v)
        b.train(view)
        yield {"client": client, "a": a, "b": b, "storage": tmp / "run"}


@pytest.fixture
def unchanged(server):
    client = server["client"]
    before = snapshot(client, server["storage"])
    devices = set(client.app_ref.state.coordinator.registry.devices)
    yield
    assert snapshot(client, server["storage"]) == before
    assert set(client.app_ref.state.coordinator.registry.devices) == devices


DEEP = [b"[" * 60_000, b'{"a":' * 12_000, b"[" * 30_000 + b"]" * 30_000]
assert all(len(body) <= MAX_JSON_BODY for body in DEEP)  # under the body cap: the parser sees it


@pytest.mark.parametrize("body", DEEP, ids=["open-arrays", "open-objects", "closed-arrays"])
def test_deeply_nested_json(server, unchanged, body):
    """Once a RecursionError and a 500; now a 422 on both JSON routes."""
    client, b = server["client"], server["b"]
    check(client.post("/v1/devices", content=body), 422, "nested too deeply", ENROLL_SHAPE)
    r = client.post("/v1/rounds/1/loss", content=body, headers=b.auth)
    check(r, 422, "nested too deeply", "train_loss")


@pytest.mark.parametrize(
    "body,words",
    [
        (b"", ["not valid json"]),
        (b"\xff\xfe\x00garbage", ["not valid json"]),  # not UTF-8
        (b'{"enrollment_secret": "\xff"}', ["not valid json"]),
        (b"{'single': 'quotes'}", ["not valid json"]),
        (b'{"n": 1' + b"0" * 5000 + b"}", ["not valid json"]),  # past Python's int digit limit
        (b"[1, 2]", ["not an array"]),
        (b"42", ["not a number"]),
        (b"1e999", ["not a number"]),
        (b'"s3cret"', ["not a string"]),
        (b"null", ["not null"]),
        (b"true", ["not true or false"]),
    ],
)
def test_bodies_that_are_not_a_json_object(server, unchanged, body, words):
    client, b = server["client"], server["b"]
    check(client.post("/v1/devices", content=body), 422, ENROLL_SHAPE, *words)
    r = client.post("/v1/rounds/1/loss", content=body, headers=b.auth)
    check(r, 422, "train_loss", *words)


@pytest.mark.parametrize(
    "body,status,word",
    [
        (b'{"enrollment_secret": "\\ud800"}', 401, "secret"),  # a lone surrogate: was a 500
        (b'{"enrollment_secret": "\\udfff\\ud800x"}', 401, "secret"),
        (b'{"enrollment_secret": 12}', 401, "secret"),
        (b'{"enrollment_secret": ["test-secret"]}', 401, "secret"),
        (b'{"enrollment_secret": NaN}', 401, "secret"),
        (b'{"enrollment_secret": "test-secret", "name": "ok\\n"}', 422, "name"),
        (b'{"enrollment_secret": "test-secret", "name": "\\ud800"}', 422, "name"),
        (b'{"enrollment_secret": "test-secret", "name": {"a": 1}}', 422, "name"),
        (b'{"enrollment_secret": "test-secret", "name": "' + b"x" * 65 + b'"}', 422, "name"),
        (b'{"enrollment_secret": "test-secret", "num_samples": 1.5}', 422, "num_samples"),
        (b'{"enrollment_secret": "test-secret", "num_samples": -1}', 422, "num_samples"),
        (b'{"enrollment_secret": "test-secret", "num_samples": true}', 422, "num_samples"),
        (b'{"enrollment_secret": "test-secret", "num_samples": 1e400}', 422, "num_samples"),
        (
            b'{"enrollment_secret": "test-secret", "num_samples": 1' + b"0" * 4000 + b"}",
            422,
            "max-samples",
        ),
    ],
)
def test_odd_enrollments(server, unchanged, body, status, word):
    check(server["client"].post("/v1/devices", content=body), status, word)


@pytest.mark.parametrize(
    "body,word",
    [
        (b'{"train_loss": 1e999, "num_samples": 3}', "finite"),
        (b'{"train_loss": -1e999, "num_samples": 3}', "finite"),
        (b'{"train_loss": NaN, "num_samples": 3}', "finite"),
        (b'{"train_loss": Infinity, "num_samples": 3}', "finite"),
        (b'{"train_loss": 1' + b"0" * 400 + b', "num_samples": 3}', "finite"),  # OverflowError
        (b'{"train_loss": -1' + b"0" * 400 + b', "num_samples": 3}', "finite"),
        (b'{"train_loss": "1.0", "num_samples": 3}', "number"),
        (b'{"train_loss": [1.0], "num_samples": 3}', "number"),
        (b'{"train_loss": 1.0, "num_samples": 3.0}', "integer"),
        (b'{"train_loss": 1.0, "num_samples": 1' + b"0" * 40 + b"}", "max-samples"),
        (b'{"train_loss": 1.0, "num_samples": -1' + b"0" * 40 + b"}", "positive"),
        (b'{"train_loss": 1.0}', "integer"),
    ],
)
def test_odd_loss_reports(server, unchanged, body, word):
    b = server["b"]
    check(b.client.post("/v1/rounds/1/loss", content=body, headers=b.auth), 422, word)


@pytest.mark.parametrize(
    "header,value,word",
    [
        ("X-Fedkey-Num-Samples", "1" * 5000, "positive integer"),  # int()'s digit limit
        ("X-Fedkey-Num-Samples", "9" * 40, "max-samples"),
        ("X-Fedkey-Num-Samples", "-7", "positive integer"),
        ("X-Fedkey-Num-Samples", "0x10", "positive integer"),
        ("X-Fedkey-Num-Samples", "1e3", "positive integer"),
        ("X-Fedkey-Num-Samples", "\xff\xfe", "positive integer"),  # latin-1 bytes on the wire
        ("X-Fedkey-Num-Samples", "", "positive integer"),
        ("X-Fedkey-Train-Loss", "1e999", "finite"),
        ("X-Fedkey-Train-Loss", "-" + "9" * 5000, "finite"),
        ("X-Fedkey-Train-Loss", "\xff", "finite"),
        ("X-Fedkey-Train-Loss", "", "finite"),
    ],
)
def test_odd_upload_headers(server, unchanged, header, value, word):
    b = server["b"]
    headers = {**b.upload_headers(), header: value.encode("latin-1")}
    check(b.upload(headers=headers), 422, header, word)


@pytest.mark.parametrize(
    "auth,word",
    [
        (b"Bearer \xff\xfe", "unknown device token"),
        (b"Bearer " + b"x" * 8000, "unknown device token"),
        (b"\xff", "must be 'bearer <token>'"),
        (b"Bearer  ", "must be 'bearer <token>'"),
        (b"Basic \x00", "must be 'bearer <token>'"),
    ],
)
def test_odd_tokens(server, unchanged, auth, word):
    r = server["client"].get("/v1/rounds/current", headers={"Authorization": auth})
    check(r, 401, word)


def test_odd_numbers_in_the_url(server, unchanged):
    client, b = server["client"], server["b"]
    loss = {"train_loss": 1.0, "num_samples": 3}
    for n in ("1" * 5000, "1e3", "nan", "%ff"):
        check(client.post(f"/v1/rounds/{n}/loss", json=loss, headers=b.auth), 422, "n:")
        check(client.post(f"/v1/rounds/{n}/update", content=b"x", headers=b.auth), 422, "n:")
    for n in ("9" * 30, "-1"):
        check(client.post(f"/v1/rounds/{n}/loss", json=loss, headers=b.auth), 409, "not the open")
    for wait in ("x", "1" * 5000 + "x", ""):
        r = client.get("/v1/rounds/current", params={"wait": wait}, headers=b.auth)
        check(r, 422, "wait")
    # numbers that are numbers answer at once (NaN and negatives do not wait; inf waits the
    # longest, MAX_WAIT, which is not tried here)
    for wait in ("nan", "-inf", "-5", "0"):
        r = client.get("/v1/rounds/current", params={"wait": wait}, headers=b.auth)
        assert r.status_code == 200 and r.json()["round"] == 1, r.text


def test_clamp_wait():
    assert _clamp_wait(float("nan")) == 0.0
    assert _clamp_wait(float("-inf")) == 0.0
    assert _clamp_wait(float("inf")) == MAX_WAIT
    assert _clamp_wait(1e400) == MAX_WAIT
    assert _clamp_wait(2.5) == 2.5


def test_odd_if_none_match(server, unchanged):
    client = server["client"]
    for inm in (b"\xff" * 100, b'W/"", *', b",,,", b'"' * 5000):
        r = client.get("/v1/model", headers={"If-None-Match": inm})
        assert r.status_code in (200, 304), r.status_code


def test_then_real_requests_are_taken(server):
    """Last: after all of that, phone B's real loss report and upload are taken."""
    b = server["b"]
    assert b.report_loss().status_code == 200
    assert b.upload().status_code == 200
    prom = server["client"].get("/metrics").text
    assert "fedkey_enroll_rate_limited_total 0.0" in prom


# -- the enrollment rate limit ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A server whose enrollment bucket holds 3 attempts and refills one a 100 s."""
    tmp = tmp_path_factory.mktemp("limited")
    settings = make_settings(tmp, rounds=1, wait_devices=5, enroll_burst=3, enroll_rate=0.01)
    with running(settings) as client:
        yield {"client": client, "storage": tmp / "run"}


def test_enrollment_is_rate_limited(limited):
    client = limited["client"]
    before = snapshot(client, limited["storage"])
    wrong = {"enrollment_secret": "guess"}
    for _ in range(2):  # wrong secrets take tokens too
        check(client.post("/v1/devices", json=wrong), 401, "secret")
    ok = client.post("/v1/devices", json={"enrollment_secret": SECRET, "name": "first"})
    assert ok.status_code == 200, ok.text
    for body in (wrong, {"enrollment_secret": SECRET, "name": "second"}, b"[" * 60_000):
        if isinstance(body, bytes):
            r = client.post("/v1/devices", content=body)
        else:
            r = client.post("/v1/devices", json=body)
        check(r, 429, "too many enrollment attempts", "retry in")
        retry = int(r.headers["Retry-After"])
        assert 1 <= retry <= 100, retry  # a token a 100 s
    coordinator = client.app_ref.state.coordinator
    assert set(coordinator.registry.devices) == {"first"}
    # nothing else is limited, and nothing changed
    assert client.get("/healthz").status_code == 200
    assert client.get("/v1/model").status_code == 200
    assert snapshot(client, limited["storage"]) == before
    assert "fedkey_enroll_rate_limited_total 3.0" in client.get("/metrics").text


def test_limiter_refills_and_says_when():
    now = [100.0]
    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(0.5)  # one token a half-second
    assert limiter.take("b") == 0.0  # per key
    now[0] += 0.25
    assert limiter.take("a") == pytest.approx(0.25)
    now[0] += 0.25
    assert limiter.take("a") == 0.0
    now[0] += 1000.0  # refills up to the burst, no further
    assert [limiter.take("a") for _ in range(4)][-1] > 0


def test_limiter_table_stays_bounded():
    now = [0.0]
    limiter = RateLimiter(rate=1.0, burst=2, max_keys=100, clock=lambda: now[0])
    for i in range(10_000):
        limiter.take(f"10.0.{i // 256}.{i % 256}")
        assert len(limiter) <= 100
    assert limiter.take("10.0.39.15") == 0.0  # the last seen kept its bucket: one token left
    assert limiter.take("10.0.39.15") > 0


def test_defaults_let_ten_thousand_phones_enroll_from_one_address():
    """tests/e2e, `fedkey run` and `fedkey devices` enroll every phone from 127.0.0.1."""
    fields = Settings.model_fields
    rate, burst = fields["enroll_rate"].default, fields["enroll_burst"].default
    assert rate >= 100
    limiter = RateLimiter(rate, burst, clock=lambda: 0.0)  # all at the same instant
    assert all(limiter.take("127.0.0.1") == 0.0 for _ in range(10_000))


def test_rate_zero_turns_the_limit_off(tmp_path):
    app = create_app(make_settings(tmp_path, enroll_rate=0))
    assert app.state.enroll_limiter is None


# -- uvicorn's limits --------------------------------------------------------------------------


def test_uvicorn_config_carries_the_limits(tmp_path):
    config = build_server(make_settings(tmp_path)).config
    assert config.timeout_keep_alive == 75  # past a proxy's 60 s idle timeout
    assert config.limit_concurrency == 20_000
    assert config.http.max_head == 16_384
    assert config.ws_max_size == MAX_JSON_BODY
    assert issubclass(config.http, HeadLimitedHttpTools) and config.loop == "uvloop"
    config = build_server(
        make_settings(tmp_path, keep_alive=120, limit_concurrency=50, max_header_bytes=4096)
    ).config
    assert (config.timeout_keep_alive, config.limit_concurrency) == (120, 50)
    assert config.http.max_head == 4096


def test_uvicorn_answers_past_its_limits(tmp_path, monkeypatch):
    """A real uvicorn (in a thread, on loopback): unfinished headers past max_header_bytes get a 400,
    connections past limit_concurrency a 503, a deep JSON body a 422, not a 500, and a body that
    stalls a 408."""
    monkeypatch.setattr(validation, "BODY_IDLE_TIMEOUT", 0.5)
    port = free_port()
    settings = make_settings(
        tmp_path, port=port, limit_concurrency=3, max_header_bytes=1024, wait_devices=5
    )
    server = build_server(settings, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:

        def up():
            try:
                return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=120, every=0.1, what="the server did not start")
        # one connection each (httpx.post/get close theirs)
        check(httpx.post(f"{base}/v1/devices", content=b"[" * 60_000), 422, "nested too deeply")
        # headers still unfinished past max_header_bytes (a never-ending header block)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"x" * 2000)
            assert sock.recv(4096).startswith(b"HTTP/1.1 400"), "no 400"
            assert wait_for(lambda: sock.recv(4096) == b"", timeout=10)  # and closed
        # a head under the limit, sent in pieces, after a request on the same connection: 200
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for pad in (10, 800):
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"x" * pad)
                sock.sendall(b"\r\n\r\n")
                answer = sock.recv(4096)
                assert answer.startswith(b"HTTP/1.1 200"), answer
        # a body that stops half-way: refused once it has been idle BODY_IDLE_TIMEOUT
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/devices HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"enrollment_secret": '
            )
            answer = b""
            for _ in range(10):  # blocks until the server answers (socket timeout 10 s)
                part = sock.recv(4096)
                answer += part
                if not part or b"stalled" in answer:
                    break
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b"stalled" in answer, answer
        # two idle keep-alive connections, then a request on a third: 3 >= limit_concurrency
        with httpx.Client(base_url=base) as c1, httpx.Client(base_url=base) as c2:
            assert c1.get("/healthz").status_code == 200
            assert c2.get("/healthz").status_code == 200
            with httpx.Client(base_url=base) as c3:
                assert c3.get("/healthz").status_code == 503
        wait_for(up, timeout=10, what="the server did not answer again once connections closed")
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    assert not thread.is_alive()


def test_server_children_get_malloc_arena_max(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert SERVER_ENV == {"MALLOC_ARENA_MAX": "2"}
    assert server_env({"FEDKEY_PORT": "1"}) == {"MALLOC_ARENA_MAX": "2", "FEDKEY_PORT": "1"}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")  # the user's choice is kept
    assert server_env() == {}
