"""One request path: a middleware added to the app sees every route, the five operations included (the
streamed sample too), and the OpenAPI document describes each operation with the model its route validates."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.middleware.base import BaseHTTPMiddleware

from latentlm.service.app import create_app
from latentlm.service.schemas import REQUESTS
from latentlm.service.settings import Settings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_a_middleware_sees_every_route(base_store, tmp_path):
    app = create_app(Settings(store=base_store, device="cpu", state_dir=tmp_path))
    seen: list[tuple[str, str, int]] = []

    async def record(request, call_next):
        response = await call_next(request)
        seen.append((request.method, request.url.path, response.status_code))
        response.headers["x-seen-by"] = "recorder"
        return response

    app.add_middleware(BaseHTTPMiddleware, dispatch=record)
    calls = [("POST", "/v1/score", {"model": "tiny", "input": ["w1 w2", "w3"], "token_logprobs": True}),
             ("POST", "/v1/posterior", {"model": "tiny", "input": "w1 w2", "top_k": 2}),
             ("POST", "/v1/decode", {"model": "tiny", "input": "w1 w2"}),
             ("POST", "/v1/decode", {"model": "pcfg", "input": "w1 w2 w3"}),
             ("POST", "/v1/embed", {"model": "lds", "input": "w1 w2"}),
             ("POST", "/v1/sample", {"model": "tiny", "n": 2, "max_tokens": 3}),
             ("POST", "/v1/sample", {"model": "tiny", "n": 2, "max_tokens": 3, "stream": True}),
             ("POST", "/v1/score", {"model": "tiny", "input": "w1", "bogus": 1}),
             ("GET", "/v1/models", None), ("GET", "/health", None), ("GET", "/metrics", None)]
    with TestClient(app) as c:
        while c.get("/ready").status_code != 200:
            pass
        seen.clear()
        for method, path, body in calls:
            r = c.request(method, path, json=body)
            assert r.headers.get("x-seen-by") == "recorder", (path, r.status_code, r.text)
            assert r.status_code == (422 if body and "bogus" in body else 200), (path, r.text)
        pcfg = c.post("/v1/decode", json={"model": "pcfg", "input": "w1 w2 w3"}).json()["data"][0]
    assert "tree" in pcfg, pcfg  # a pcfg decode without `method` answers with its MBR parse
    assert [(m, p) for m, p, _ in seen[: len(calls)]] == [(m, p) for m, p, _ in calls]
    stream = [s for s in seen if s[1] == "/v1/sample"]
    assert len(stream) == 2


def test_openapi_uses_the_request_models(base_store, tmp_path):
    app = create_app(Settings(store=base_store, device="cpu", state_dir=tmp_path))
    doc = app.openapi()
    for op, model in REQUESTS.items():
        body = doc["paths"][f"/v1/{op}"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/" + model.__name__), (op, body)
        schema = doc["components"]["schemas"][model.__name__]
        assert set(schema["properties"]) == set(model.model_fields), op
