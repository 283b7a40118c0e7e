"""The contract the service declares is the one it keeps (issue 16, item 8), against a real uvicorn server: the
OpenAPI document lists every error status of each operation with the JSON error body, the bearer scheme when keys
are set, `/metrics` as text/plain and SSE as text/event-stream; 405 and OPTIONS answer a correct `Allow`; booleans
do not slip into number fields; integer fields take what JSON Schema's `integer` admits (2.0 is 2), nothing else."""

from __future__ import annotations

import pytest

from latentlm.service.app import create_app
from latentlm.service.settings import Settings

from .conftest import Server, err

KEY = "contract-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPERATIONS = ["score", "posterior", "decode", "embed", "sample"]


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    s = Server(store, tmp_path_factory.mktemp("contract"), env={"LATENTLM_API_KEYS": KEY})
    yield s
    s.stop()


def test_openapi_declares_errors_security_and_media_types(server):
    c = server.client
    doc = c.get("/openapi.json", headers=AUTH).json()
    err_ref = {"$ref": "#/components/schemas/Error"}
    assert doc["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer", "description": "one of LATENTLM_API_KEYS"}}
    error = doc["components"]["schemas"]["Error"]
    assert set(error["properties"]["error"]["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for op in OPERATIONS:
        post = doc["paths"][f"/v1/{op}"]["post"]
        assert post["security"] == [{"bearer": []}]
        for code in ("400", "401", "404", "413", "422", "429", "503"):
            assert post["responses"][code]["content"]["application/json"]["schema"] == err_ref, (op, code)
    sample = doc["paths"]["/v1/sample"]["post"]["responses"]["200"]["content"]
    assert set(sample) == {"application/json", "text/event-stream"}
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "security" not in doc["paths"]["/health"]["get"]
    for path, item in doc["paths"].items():  # every /v1 operation: 401 and the bearer scheme
        for method, op in item.items():
            if path.startswith("/v1"):
                assert "401" in op["responses"] and op["security"] == [{"bearer": []}], (method, path)
                assert all(r["content"]["application/json"]["schema"] == err_ref
                           for code, r in op["responses"].items() if code >= "400"), (method, path)
    assert "405" in doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert "409" in doc["paths"]["/v1/batches/{batch_id}"]["delete"]["responses"]
    # the declared media types are the ones served
    assert c.get("/metrics", headers=AUTH).headers["content-type"].startswith("text/plain")
    r = c.post("/v1/sample", json={"model": "tiny", "n": 2, "stream": True}, headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")


def test_no_security_scheme_without_keys(store, tmp_path):
    doc = create_app(Settings(store=store, device="cpu", state_dir=tmp_path)).openapi()
    assert "securitySchemes" not in doc["components"]
    post = doc["paths"]["/v1/score"]["post"]
    assert "security" not in post and "401" not in post["responses"]
    assert {"404", "413", "422", "503"} <= set(post["responses"])


def _allow(r) -> set[str]:
    return {m.strip() for m in r.headers["allow"].split(",")}


def test_405_and_options_answer_allow(server):
    c = server.client
    r = c.get("/v1/models/reload", headers=AUTH)  # was 404 "model 'reload' not found"
    e = err(r, 405)
    assert e["code"] == "method_not_allowed" and _allow(r) == {"POST", "OPTIONS"}
    assert c.post("/v1/models/reload", headers=AUTH).status_code == 200
    for path, allow in [("/v1/models/reload", {"POST"}), ("/v1/score", {"POST"}), ("/v1/models/tiny", {"GET"}),
                        ("/v1/files", {"POST"}), ("/v1/batches", {"GET", "POST"}), ("/health", {"GET"}),
                        ("/v1/batches/batch_x", {"GET", "DELETE"}), ("/v1/files/file_x", {"GET", "DELETE"})]:
        r = c.options(path, headers=AUTH)
        assert r.status_code == 204 and _allow(r) == allow | {"OPTIONS"}, (path, r.status_code, r.headers)
    r = c.put("/v1/batches", headers=AUTH)
    err(r, 405)
    assert _allow(r) == {"GET", "POST", "OPTIONS"}
    r = c.delete("/v1/score", headers=AUTH)
    err(r, 405)
    assert _allow(r) == {"POST", "OPTIONS"}
    err(c.options("/v1/nowhere", headers=AUTH), 404)


@pytest.mark.parametrize("body,param,contains", [
    ({"temperature": True}, "temperature", "got bool"),
    ({"temperature": "1"}, "temperature", "expected a number"),
    ({"n": 312.5}, "n", "valid integer"),
    ({"n": "3"}, "n", "valid integer"),
    ({"n": True}, "n", "valid integer"),
    ({"max_tokens": 3.5}, "max_tokens", "valid integer"),
    ({"seed": False}, "seed", "valid integer"),
    ({"stream": 1}, "stream", "valid boolean"),
])
def test_strict_types(server, body, param, contains):
    err(server.client.post("/v1/sample", json={"model": "tiny", **body}, headers=AUTH), 422, param, contains)


def test_numbers_accepted(server):
    r = server.client.post("/v1/sample", json={"model": "tiny", "temperature": 1, "n": 2, "max_tokens": 3},
                           headers=AUTH)
    assert r.status_code == 200, r.text
    integral = {"model": "tiny", "temperature": 1, "n": 2.0, "max_tokens": 3.0, "seed": 5.0}
    same = {"model": "tiny", "temperature": 1, "n": 2, "max_tokens": 3, "seed": 5}
    assert server.client.post("/v1/sample", json=integral, headers=AUTH).json() == server.client.post(
        "/v1/sample", json=same, headers=AUTH).json()  # JSON Schema's integer admits 2.0: taken as 2
    r = server.client.post("/v1/posterior", json={"model": "tiny", "input": [[1.0, 2]], "top_k": 2.0}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == server.client.post("/v1/posterior", json={"model": "tiny", "input": [[1, 2]], "top_k": 2},
                                          headers=AUTH).json()
    err(server.client.post("/v1/posterior", json={"model": "tiny", "input": "w1", "top_k": 2.5}, headers=AUTH),
        422, "top_k")
    err(server.client.post("/v1/score", json={"model": "tiny", "input": "w1", "token_logprobs": 1}, headers=AUTH),
        422, "token_logprobs")
