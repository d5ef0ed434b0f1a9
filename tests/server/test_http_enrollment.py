"""Device identity (fedkey.server.enrollment, fedkey.server.devices): single-use enrollment tokens the operator
mints, a cap on enrolled devices (what a Sybil attack with the shared secret runs into), token
expiry, and revocation, kept across a restart."""

from __future__ import annotations

import time

from fedkey.testing.http import SECRET, make_settings, running
from fedkey.testing.wait import wait_for

OPERATOR = "operator-token-0123456789"
AS_OPERATOR = {"Authorization": f"Bearer {OPERATOR}"}


def enroll(client, credential: str, name: str):
    return client.post("/v1/devices", json={"enrollment_secret": credential, "name": name})


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def mint(client, count: int, ttl: float = 3600.0) -> dict:
    r = client.post("/v1/enrollment-tokens", json={"count": count, "ttl": ttl}, headers=AS_OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_sybil_with_the_shared_secret_stops_at_the_cap(tmp_path):
    """--max-devices 3: the fourth enrollment is refused (403, naming the setting), also from a
    fresh name each time; a revoked device frees its place."""
    settings = make_settings(tmp_path, max_devices=3, wait_devices=10, operator_token=OPERATOR)
    with running(settings) as client:
        tokens = [enroll(client, SECRET, f"sybil-{i}").json()["token"] for i in range(3)]
        for i in range(3, 50):
            refused = enroll(client, SECRET, f"sybil-{i}")
            assert refused.status_code == 403 and "FEDKEY_MAX_DEVICES" in refused.json()["detail"]
        assert client.delete("/v1/devices/sybil-0", headers=AS_OPERATOR).json()["revoked"]
        assert client.get("/v1/rounds/current", headers=bearer(tokens[0])).status_code == 401
        assert client.get("/v1/rounds/current", headers=bearer(tokens[1])).status_code == 200
        assert enroll(client, SECRET, "sybil-0").status_code == 409  # its name stays taken
        assert enroll(client, SECRET, "honest").status_code == 200
        assert client.delete("/v1/devices/sybil-0", headers=AS_OPERATOR).status_code == 404


def test_minted_tokens_enroll_one_device_each_and_only_they_do(tmp_path):
    """--enrollment tokens: no shared secret is made or taken; each minted token enrolls one
    device, once, before it expires; after a restart the unspent ones still work and the spent
    and revoked ones do not."""
    settings = make_settings(
        tmp_path, enrollment="tokens", enrollment_secret=None, operator_token=OPERATOR,
        wait_devices=10,
    )  # fmt: skip
    with running(settings) as client:
        assert not (tmp_path / "run" / "enrollment_secret").exists()
        assert enroll(client, SECRET, "a").status_code == 401
        first, second, third = mint(client, 3)["tokens"]
        a = enroll(client, first, "a")
        assert a.status_code == 200
        again = enroll(client, first, "b")
        assert again.status_code == 401 and "spent" in again.json()["detail"]
        assert enroll(client, second, "a").status_code == 409  # the name is taken...
        assert enroll(client, second, "b").status_code == 200  # ...so the token was not spent
        assert client.delete("/v1/devices/b", headers=AS_OPERATOR).status_code == 200
        soon = mint(client, 1, ttl=0.001)
        wait_for(lambda: time.time() > soon["expires_at"], what="the token did not expire")
        assert enroll(client, soon["tokens"][0], "c").status_code == 401
        device_a = a.json()["token"]
    with running(settings) as client:  # restarted on the same database
        assert client.get("/v1/rounds/current", headers=bearer(device_a)).status_code == 200
        assert enroll(client, first, "d").status_code == 401
        assert enroll(client, third, "d").status_code == 200
        assert enroll(client, third, "e").status_code == 401
        assert enroll(client, SECRET, "e").status_code == 401


def test_only_the_operator_mints_and_revokes(tmp_path):
    with running(make_settings(tmp_path / "none", wait_devices=10)) as client:
        r = client.post("/v1/enrollment-tokens", json={"count": 1}, headers=AS_OPERATOR)
        assert r.status_code == 403 and "FEDKEY_OPERATOR_TOKEN" in r.json()["detail"]
        assert client.delete("/v1/devices/x", headers=AS_OPERATOR).status_code == 403
    settings = make_settings(tmp_path / "token", operator_token=OPERATOR, wait_devices=10)
    with running(settings) as client:
        for header in ({}, bearer("wrong")):
            assert (
                client.post("/v1/enrollment-tokens", json={"count": 1}, headers=header).status_code
                == 401
            )
            assert client.delete("/v1/devices/x", headers=header).status_code == 401
        for body in ({"count": 0}, {"count": 10**6}, {"count": "1"}, {"count": 1, "ttl": -1}):
            r = client.post("/v1/enrollment-tokens", json=body, headers=AS_OPERATOR)
            assert r.status_code == 422 and isinstance(r.json()["detail"], str), body


def test_an_expired_device_token_is_refused_and_the_device_enrolls_again(tmp_path):
    settings = make_settings(tmp_path, device_token_ttl=3600.0, wait_devices=10)
    with running(settings) as client:
        old = enroll(client, SECRET, "phone").json()["token"]
        registry = client.app_ref.state.coordinator.registry
        registry._enrolled_at["phone"] -= 3601.0  # enrolled over an hour ago
        expired = client.get("/v1/rounds/current", headers=bearer(old))
        assert expired.status_code == 401 and "expired" in expired.json()["detail"]
        assert "phone" not in registry.devices  # no round selects it meanwhile
        renewed = enroll(client, SECRET, "phone")
        assert renewed.status_code == 200
        assert client.get("/v1/rounds/current", headers=bearer(old)).status_code == 401
        new = renewed.json()["token"]
        assert client.get("/v1/rounds/current", headers=bearer(new)).status_code == 200
        assert enroll(client, SECRET, "phone").status_code == 409  # not expired: taken
