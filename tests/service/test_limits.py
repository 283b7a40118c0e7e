"""API keys, payload and token limits, and 429 under overload, on a server started with tight limits."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.service.conftest import Server, err, metric

KEYS = "key-one,key-two"


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    s = Server(store, tmp_path_factory.mktemp("strict"),
               env={"LATENTLM_API_KEYS": KEYS, "LATENTLM_MAX_PAYLOAD_BYTES": "4000", "LATENTLM_MAX_QUEUE": "1",
                    "LATENTLM_MAX_REQUEST_TOKENS": "50000", "LATENTLM_MAX_QUEUE_DELAY_MS": "0",
                    "LATENTLM_MAX_FILE_BYTES": "10000"})
    yield s
    s.stop()


AUTH = {"Authorization": "Bearer key-two"}


def test_api_keys(server):
    c = server.client
    assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
    assert c.get("/metrics").status_code == 401  # behind the key by default
    assert c.get("/metrics", headers=AUTH).status_code == 200
    e = err(c.get("/v1/models"), 401, None, "missing API key")
    assert e["code"] == "missing_api_key" and e["type"] == "authentication_error"
    assert c.get("/v1/models").headers["www-authenticate"] == "Bearer"
    err(c.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401, None, "invalid API key")
    err(c.get("/v1/models", headers={"Authorization": "Basic key-one"}), 401, None, "missing API key")
    err(c.post("/v1/score", json={"model": "tiny", "input": "w1"}), 401)
    err(c.post("/v1/score", content=b"not json"), 401)  # auth before validation
    for path in ("/v1/models/reload", "/v1/batches", "/v1/files"):
        assert c.post(path).status_code == 401
    assert c.get("/v1/models", headers=AUTH).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "Bearer key-one"}).status_code == 200
    assert c.post("/v1/score", json={"model": "tiny", "input": "w1"}, headers=AUTH).status_code == 200


def test_payload_limit(server):
    c = server.client
    big = {"model": "tiny", "input": ["w1 " * 2000]}
    e = err(c.post("/v1/score", json=big, headers=AUTH), 413, "body", "exceeds the limit of 4000 bytes")
    assert e["code"] == "payload_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny", "input": "'
        for _ in range(100):
            yield b"w1 " * 20
        yield b'"}'

    err(c.post("/v1/score", content=chunks(), headers=AUTH), 413, "body")
    ok = {"model": "tiny", "input": ["w1 " * 500]}
    assert c.post("/v1/score", json=ok, headers=AUTH).status_code == 200
    # uploads have their own (larger) limit
    ok_file = {"file": ("a.jsonl", b"x" * 5000)}
    assert c.post("/v1/files", files=ok_file, data={"purpose": "batch"}, headers=AUTH).status_code == 200
    big_file = {"file": ("a.jsonl", b"x" * 20000)}
    err(c.post("/v1/files", files=big_file, data={"purpose": "batch"}, headers=AUTH), 413, "body", "10000 bytes")
    # a token limit is a 413 too
    err(c.post("/v1/score", json={"model": "tiny", "input": [[1] * 60_000]}, headers=AUTH), 413)


def test_429_when_the_queue_is_full(server):
    rng = random.Random(0)
    # 64 requests at once (each under the 4,000-byte body limit) against a queue of 1 (LATENTLM_MAX_QUEUE):
    # with the bodies ready before the burst and every connection open at once, arrivals outpace a batch
    # even on a loaded machine
    bodies = [{"model": "tiny", "input": [[rng.randrange(40) for _ in range(1000)]]} for _ in range(64)]

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=AUTH,
                                     limits=httpx.Limits(max_connections=64)) as ac:
            return await asyncio.gather(*(ac.post("/v1/score", json=b) for b in bodies))

    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    r429 = next(r for r in rs if r.status_code == 429)
    assert r429.headers["retry-after"] == "1"
    e = err(r429, 429, None, "server busy")
    assert e["code"] == "queue_full" and e["type"] == "rate_limit_error"
    assert metric(server.client.get("/metrics", headers=AUTH).text, "latentlm_errors_total", status="429") >= 1
