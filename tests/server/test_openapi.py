"""/openapi.json states what a client (or a schema fuzzer) relies on: every route, its request body,
its answer, its error statuses and the bearer scheme; and the answers' models change no answer."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from fedkey.common.task import TASK_KEYS
from fedkey.server.app import create_app
from fedkey.testing.http import enroll_phones, make_settings, run_round, running, wait_round
from fedkey.testing.wait import wait_for

ERROR = {"$ref": "#/components/schemas/ErrorBody"}

# (path, method) -> the error statuses it documents (503: uvicorn's, on every route)
ROUTES = {
    ("/v1/devices", "post"): {401, 403, 408, 409, 413, 422, 429, 503, 507},
    ("/v1/enrollment-tokens", "post"): {401, 403, 408, 413, 422, 503, 507},
    ("/v1/devices/{device_id}", "delete"): {401, 403, 404, 422, 503},
    ("/v1/rounds/current", "get"): {401, 422, 429, 503},
    ("/v1/rounds/{n}/loss", "post"): {401, 403, 408, 409, 413, 422, 503, 507},
    ("/v1/rounds/{n}/update", "post"): {400, 401, 403, 408, 409, 413, 422, 503, 507},
    ("/v1/model", "get"): {401, 503},
    ("/v1/metrics", "get"): {401, 503},
    ("/healthz", "get"): {503},
    ("/metrics", "get"): {401, 403, 503},
}
BEARER = {
    ("/v1/model", "get"),  # with FEDKEY_PRIVATE_MODEL (a device's token, or the operator's)
    ("/v1/rounds/current", "get"),
    ("/v1/rounds/{n}/loss", "post"),
    ("/v1/rounds/{n}/update", "post"),
}

# (path, method) of the operator's routes (FEDKEY_OPERATOR_TOKEN)
OPERATOR = {
    ("/metrics", "get"),
    ("/v1/metrics", "get"),
    ("/v1/enrollment-tokens", "post"),
    ("/v1/devices/{device_id}", "delete"),
}


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> dict:
    app = create_app(make_settings(tmp_path_factory.mktemp("openapi")))
    r = TestClient(app).get("/openapi.json")  # no lifespan: the document needs no coordinator
    assert r.status_code == 200
    return r.json()


def operations(doc: dict) -> dict[tuple[str, str], dict]:
    return {(path, m): op for path, item in doc["paths"].items() for m, op in item.items()}


def resolve(doc: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def types(prop: dict) -> set[str]:
    return {p["type"] for p in prop["anyOf"]} if "anyOf" in prop else {prop["type"]}


def test_every_route_is_listed(doc):
    assert set(operations(doc)) == set(ROUTES)


def test_every_route_documents_its_errors(doc):
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # 422 is a {"detail": str}
    assert doc["components"]["schemas"]["ErrorBody"]["properties"] == {
        "detail": {"type": "string", "title": "Detail"}
    }
    for key, op in operations(doc).items():
        responses = op["responses"]
        documented = {int(s) for s in responses} - {200, 304}
        assert documented == ROUTES[key], key
        for status in documented - {503}:
            body = responses[str(status)]
            assert body["content"]["application/json"]["schema"] == ERROR, (key, status)
            assert len(body["description"]) > 10 and "\n" not in body["description"]
        # the server's own 503 (the database busy, a gate's wait) is an ErrorBody with
        # Retry-After; uvicorn's past its connection limit is plain text
        busy = responses["503"]
        assert set(busy["content"]) == {"application/json", "text/plain"}, key
        assert busy["content"]["application/json"]["schema"] == ERROR, key
        assert busy["headers"]["Retry-After"]["schema"] == {"type": "integer"}, key
    for key, status in [
        (("/v1/devices", "post"), "429"),
        (("/v1/rounds/{n}/loss", "post"), "507"),
        (("/v1/rounds/{n}/update", "post"), "507"),
    ]:
        retry = operations(doc)[key]["responses"][status]["headers"]
        assert retry["Retry-After"]["schema"] == {"type": "integer"}
    model = operations(doc)[("/v1/model", "get")]["responses"]
    assert "content" not in model["304"] and "ETag" in model["304"]["headers"]
    assert model["200"]["content"] == {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
    }
    assert "ETag" in model["200"]["headers"] and "X-Fedkey-Round" in model["200"]["headers"]


def test_json_bodies(doc):
    ops = operations(doc)
    for key, fields, required in [
        (
            ("/v1/devices", "post"),
            {"enrollment_secret": {"string"}, "name": {"string", "null"}},
            ["enrollment_secret"],
        ),
        (
            ("/v1/rounds/{n}/loss", "post"),
            {"train_loss": {"number"}, "num_samples": {"integer"}},
            ["train_loss", "num_samples"],
        ),
    ]:
        body = ops[key]["requestBody"]
        assert body["required"] is True
        schema = resolve(doc, body["content"]["application/json"]["schema"])
        assert schema["type"] == "object" and schema["required"] == required
        for name, kinds in fields.items():
            assert types(schema["properties"][name]) == kinds, (key, name)
    enroll = ops[("/v1/devices", "post")]["requestBody"]["content"]["application/json"]["schema"]
    enroll = resolve(doc, enroll)
    assert types(enroll["properties"]["num_samples"]) == {"integer", "null"}
    assert enroll["properties"]["name"]["anyOf"][0]["pattern"].startswith("^[A-Za-z0-9]")


def test_the_upload_is_a_binary_body_with_two_headers(doc):
    op = operations(doc)[("/v1/rounds/{n}/update", "post")]
    assert op["requestBody"]["required"] is True
    assert op["requestBody"]["content"] == {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
    }
    params = {(p["in"], p["name"]): p for p in op["parameters"]}
    assert params[("path", "n")]["schema"]["type"] == "integer"
    assert params[("header", "X-Fedkey-Num-Samples")]["schema"] == {"type": "integer", "minimum": 1}
    assert params[("header", "X-Fedkey-Train-Loss")]["schema"] == {"type": "number"}
    assert params[("header", "X-Fedkey-Num-Samples")]["required"] is True


def test_answers(doc):
    ops = operations(doc)
    answers = {
        ("/v1/devices", "post"): {"device_id", "token"},
        ("/v1/rounds/current", "get"): {
            "round",
            "attempt",
            "state",
            "selected",
            "task",
            "loss_reported",
            "uploaded",
            "upload",
        },
        ("/v1/rounds/{n}/loss", "post"): {"upload"},
        ("/v1/rounds/{n}/update", "post"): {"receipt", "round", "sha256", "bytes"},
        ("/v1/metrics", "get"): {"rounds"},
        ("/healthz", "get"): {"status", "round", "state"},
    }
    for key, fields in answers.items():
        schema = resolve(doc, ops[key]["responses"]["200"]["content"]["application/json"]["schema"])
        assert set(schema["properties"]) == fields, key
        assert schema["additionalProperties"] is True  # keys the model does not name are kept
    task = doc["components"]["schemas"]["Task"]
    assert tuple(task["properties"]) == TASK_KEYS  # the task as fedkey.common.task writes it
    view = doc["components"]["schemas"]["RoundView"]["properties"]
    assert types(view["upload"]) == {"boolean", "null"}
    assert view["task"]["anyOf"][1] == {"type": "null"}
    assert set(ops[("/metrics", "get")]["responses"]["200"]["content"]) == {"text/plain"}


def test_the_bearer_scheme(doc):
    scheme = doc["components"]["securitySchemes"]["bearer"]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    for key, op in operations(doc).items():
        if key in OPERATOR:  # the operator's token, not a device's
            assert op.get("security") == [{"operator": []}]
            continue
        assert op.get("security") == ([{"bearer": []}] if key in BEARER else None), key


def test_response_models_change_no_answer(tmp_path):
    """The answers are the coordinator's own dicts, key for key, value for value (a key the
    models do not name included)."""
    settings = make_settings(tmp_path, rounds=2, wait_devices=2)
    with running(settings) as client:
        coordinator = client.app_ref.state.coordinator
        phones = enroll_phones(client, 2)
        a = phones[0]
        view = wait_for(lambda: (v := a.current()) and v["state"] == "open" and v)
        assert view["task"] is not None
        assert view == json.loads(json.dumps(coordinator.view(a.name)))
        run_round(phones)
        wait_round(client, 1)
        assert client.get("/healthz").json() == coordinator.health()
        assert client.get("/v1/metrics").json() == {
            "rounds": json.loads(json.dumps(client.portal.call(coordinator.metrics_rows)))
        }

        views = coordinator.parts.views
        view_of = views.view
        views.view = lambda device_id: {**view_of(device_id), "new_field": [1, None]}
        answered = a.current()
        assert answered["new_field"] == [1, None]
        assert {k: v for k, v in answered.items() if k != "new_field"} == json.loads(
            json.dumps(view_of(a.name))
        )
