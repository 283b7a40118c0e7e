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


def _inline(schema, doc):
    """`schema` with its `#/components/schemas/...` references replaced by what they name."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline(doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], doc)
        return {k: _inline(v, doc) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_inline(v, doc) for v in schema]
    return schema


def test_streamed_bodies_are_the_declared_events(store, tmp_path):
    """Each event of a streamed answer (the SSE of /v1/sample and /v1/completions, each NDJSON line of /v1/posterior)
    and a completion's JSON answer is what the OpenAPI document declares, one event or line at a time, every object
    closed (`additionalProperties: false`): a field written and not declared fails here, as it fails schemathesis'
    response checks (the same validator, jsonschema_rs)."""
    import json
    import shutil
    import time

    import jsonschema_rs
    from fastapi.testclient import TestClient

    from latentlm.models.registry import save_artifact
    from latentlm.models.tokenizer import tokenizer_files, vocab_for
    from tests.service.test_text_constraint_api import EOS, TOK, peaked_hmm

    shutil.copytree(store, tmp_path / "store")
    t, c = peaked_hmm()
    save_artifact(tmp_path / "store", "bpe", "hmm", t, vocab_for(TOK, eos=EOS), config=c,
                  extra_files=tokenizer_files(TOK))
    keyword = {"include": [["w5"]], "exclude": ["w1 nosuchword"], "max_tokens": 6}
    cases = {
        "/v1/sample": [{"model": "tiny", "n": 3, "max_tokens": 5, "seed": 1, "prefix": "w1", "stop": ["w2"]},
                       {"model": "tiny", "n": 2, "max_tokens": 6, "seed": 2, "constraint": keyword},
                       {"model": "pcfg", "n": 2, "seed": 3}, {"model": "bpe", "n": 2, "max_tokens": 4, "seed": 4}],
        "/v1/posterior": [{"model": "tiny", "input": ["w1 w2 w3", "w4"], "top_k": 2}, {"model": "pcfg",
                                                                                       "input": "w1 w2 w3"}],
        "/v1/completions": [{"model": "tiny", "prompt": ["w1", "w2 w3"], "max_tokens": 4, "n": 2, "seed": 5,
                             "logprobs": 2, "echo": True, "stream_options": {"include_usage": True}},
                            {"model": "bpe", "prompt": "The river", "max_tokens": 4, "seed": 6, "logprobs": 1,
                             "echo": True},
                            {"model": "tiny", "prompt": "w1", "max_tokens": 6, "seed": 7, "constraint": keyword}]}
    with TestClient(create_app(Settings(store=tmp_path / "store", device="cpu", state_dir=tmp_path / "st"))) as c:
        while c.get("/ready").status_code != 200:
            time.sleep(0.05)
        doc = c.get("/openapi.json").json()
        seen = 0
        for path, bodies in cases.items():
            content = doc["paths"][path]["post"]["responses"]["200"]["content"]
            media = "application/x-ndjson" if path == "/v1/posterior" else "text/event-stream"
            declared = _inline(content[media]["schema"], doc)
            for body in bodies:
                if path == "/v1/completions":  # the whole answer too
                    r = c.post(path, json={k: v for k, v in body.items() if k != "stream_options"})
                    assert r.status_code == 200, r.text
                    jsonschema_rs.validate(_inline(content["application/json"]["schema"], doc), r.json())
                r = c.post(path, json={**body, "stream": True})
                assert r.status_code == 200 and r.headers["content-type"].startswith(media), r.text
                if media == "application/x-ndjson":
                    lines = [json.loads(ln) for ln in r.text.splitlines()]
                else:
                    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
                    assert events[-1] == "[DONE]" and all(not e.startswith("data:") for e in events), events
                    for e in events:
                        jsonschema_rs.validate(declared, {"data": e, "event": "message"})
                    declared_data = declared["properties"]["data"]["anyOf"][1]["contentSchema"]
                    lines = [json.loads(e) for e in events[:-1]]
                for line in lines:
                    jsonschema_rs.validate(declared_data if media == "text/event-stream" else declared, line)
                    seen += 1
                with pytest.raises(jsonschema_rs.ValidationError):  # the objects are closed: nothing slips through
                    jsonschema_rs.validate(declared_data if media == "text/event-stream" else declared,
                                           {**lines[0], "undeclared": 1})
        assert seen > 40
